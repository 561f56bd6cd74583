//! The hand-off's protocol on the CPU: pages are memfds, mappings are the descriptors kept open,
//! and the waits before a release are closures the tests control.

use super::frame::{Frame, Token};
use super::receiver::{self, Mapped, Place, Placed, Settle};
use super::sender::{self, Shared};
use super::{link, Ticket};
use crate::alloc::BlockShare;
use crate::error::{Error, Result};
use crate::vmm::placements::Event;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

/// Counters shared by a test's fakes.
#[derive(Default)]
struct Counts {
    exported: AtomicUsize,
    let_go: AtomicUsize,
    unmapped: AtomicUsize,
    /// Pages placed in a mirror, and unmapped from it.
    placed: AtomicUsize,
    unplaced: AtomicUsize,
}

/// Where a fake mirror maps the sender's address `a`.
const MIRROR_AT: u64 = 0x5000_0000_0000;

struct FakePlace {
    counts: Arc<Counts>,
}

impl Place for FakePlace {
    fn place(&mut self, fd: OwnedFd, addr: u64, _size: u64) -> Result<Box<dyn Placed>> {
        let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert!(flags & libc::FD_CLOEXEC != 0, "a placed page's descriptor is inherited by children");
        self.counts.placed.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(FakePlaced { here: MIRROR_AT + addr, _fd: fd, counts: self.counts.clone() }))
    }

    fn settler(&self) -> Settle {
        Arc::new(|| Ok(()))
    }
}

struct FakePlaced {
    here: u64,
    _fd: OwnedFd,
    counts: Arc<Counts>,
}

impl Placed for FakePlaced {
    fn here(&self) -> u64 {
        self.here
    }
}

impl Drop for FakePlaced {
    fn drop(&mut self) {
        self.counts.unplaced.fetch_add(1, Ordering::SeqCst);
    }
}

struct FakeShared {
    pages: Vec<OwnedFd>,
    serials: Vec<u64>,
    counts: Arc<Counts>,
    /// Held by `descriptors` until the test lets it go.
    gate: Option<Arc<Mutex<()>>>,
}

impl Shared for FakeShared {
    fn descriptors(&self) -> Result<Vec<OwnedFd>> {
        if let Some(g) = &self.gate {
            drop(g.lock().unwrap());
        }
        self.counts.exported.fetch_add(1, Ordering::SeqCst);
        Ok(self.pages.iter().map(|p| p.try_clone().unwrap()).collect())
    }

    fn serials(&self) -> &[u64] {
        &self.serials
    }
}

impl Drop for FakeShared {
    fn drop(&mut self) {
        self.counts.let_go.fetch_add(1, Ordering::SeqCst);
    }
}

struct FakeMapped {
    /// Open for as long as the pages are mapped, as a real import holds them.
    _fds: Vec<OwnedFd>,
    counts: Arc<Counts>,
}

impl Mapped for FakeMapped {
    fn base(&self) -> u64 {
        0x7000_0000_0000
    }

    fn settle(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn assume_idle(&mut self) {}
}

impl Drop for FakeMapped {
    fn drop(&mut self) {
        self.counts.unmapped.fetch_add(1, Ordering::SeqCst);
    }
}

fn memfd() -> OwnedFd {
    nix::sys::memfd::memfd_create(c"cuvmm-test-page", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).unwrap()
}

fn inode(fd: std::os::fd::BorrowedFd<'_>) -> u64 {
    nix::sys::stat::fstat(fd.as_raw_fd()).unwrap().st_ino
}

struct World {
    s: Arc<sender::Inner>,
    r: Arc<receiver::Inner>,
    counts: Arc<Counts>,
}

impl World {
    fn new() -> World {
        World {
            s: sender::Inner::start().unwrap(),
            r: receiver::Inner::start().unwrap(),
            counts: Arc::default(),
        }
    }

    /// Offers `n` pages with serials from `first`.
    fn offer(
        &self,
        first: u64,
        n: usize,
        group: Option<u64>,
        gate: Option<Arc<Mutex<()>>>,
    ) -> (Ticket, Vec<u64>) {
        self.offer_at(first, n, group, gate, 0x1000_0000)
    }

    /// [`offer`](Self::offer) of pages that lie from `first_page` on in the sender.
    fn offer_at(
        &self,
        first: u64,
        n: usize,
        group: Option<u64>,
        gate: Option<Arc<Mutex<()>>>,
        first_page: u64,
    ) -> (Ticket, Vec<u64>) {
        let pages: Vec<OwnedFd> = (0..n).map(|_| memfd()).collect();
        let inodes = pages.iter().map(|p| inode(p.as_fd())).collect();
        let serials: Vec<u64> = (first..first + n as u64).collect();
        let shared = FakeShared { pages, serials: serials.clone(), counts: self.counts.clone(), gate };
        let token = self.s.offer(Box::new(shared), group).unwrap();
        let page: usize = 2 << 20;
        let share = BlockShare {
            block: crate::alloc::DevicePtr::new(first_page),
            len: (page * n) as u64,
            first_page,
            page,
            pages: serials,
        };
        let t = Ticket { address: self.s.address.clone(), pid: self.s.pid, token, device: [0; 16], share };
        (t, inodes)
    }

    /// Takes `t`, checking that the descriptors are the offered pages, close-on-exec.
    fn take(&self, t: &Ticket, inodes: &[u64], timeout: Duration) -> Result<receiver::Lease> {
        self.take_with(t, inodes, timeout, None)
    }

    /// [`take`](Self::take), given `place` for the mirror.
    fn take_with(
        &self,
        t: &Ticket,
        inodes: &[u64],
        timeout: Duration,
        place: Option<Box<dyn Place>>,
    ) -> Result<receiver::Lease> {
        let counts = self.counts.clone();
        let inodes = inodes.to_vec();
        self.r.take(
            t,
            timeout,
            move |fds| {
                for (f, want) in fds.iter().zip(&inodes) {
                    assert_eq!(inode(f.as_fd()), *want, "the offered page");
                    let flags = nix::fcntl::fcntl(f.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
                    assert!(
                        flags & libc::FD_CLOEXEC != 0,
                        "a received page descriptor is inherited by children"
                    );
                }
                Ok(Box::new(FakeMapped { _fds: fds, counts }) as Box<dyn Mapped>)
            },
            place,
        )
    }

    fn held(&self) -> usize {
        self.s.stats().held
    }
}

/// Waits until `f` holds (the other side's threads act on their own time).
fn eventually(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < end, "not within {T:?}: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn done() -> receiver::Wait {
    Box::new(|| Ok(()))
}

#[test]
fn a_taken_offer_is_let_go_only_after_the_wait_that_orders_its_release() {
    let w = World::new();
    let (t, inodes) = w.offer(1, 3, None, None);
    let lease = w.take(&t, &inodes, T).unwrap();
    assert_eq!(lease.ptr(), 0x7000_0000_0000);
    assert_eq!(w.held(), 1);
    let (go, gate) = mpsc::channel::<()>();
    lease.release_after_wait(Box::new(move || {
        gate.recv().unwrap();
        Ok(())
    }));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(w.counts.let_go.load(Ordering::SeqCst), 0, "let go before the receiver's work was done");
    assert_eq!(w.r.stats().releasing, 1);
    go.send(()).unwrap();
    eventually("the sender lets go", || w.counts.let_go.load(Ordering::SeqCst) == 1 && w.held() == 0);
    // Kept while the sender keeps the pages.
    assert_eq!(w.counts.unmapped.load(Ordering::SeqCst), 0);
    assert_eq!(w.r.stats().kept, 1);
}

#[test]
fn the_same_pages_again_are_claimed_without_descriptors_or_a_wait() {
    let w = World::new();
    let (t, inodes) = w.offer(10, 2, None, None);
    w.take(&t, &inodes, T).unwrap().release_after_wait(done());
    eventually("let go", || w.counts.let_go.load(Ordering::SeqCst) == 1);
    // Offered again over the same pages (serials): the mapping kept is used.
    let again = Ticket {
        token: w
            .s
            .offer(
                Box::new(FakeShared {
                    pages: vec![memfd(), memfd()],
                    serials: t.share.pages.clone(),
                    counts: w.counts.clone(),
                    gate: None,
                }),
                None,
            )
            .unwrap(),
        ..t.clone()
    };
    let lease = w.r.take(&again, T, |_| panic!("mapped again"), None).unwrap();
    eventually("the sender holds it", || w.held() == 1);
    // Once ahead of the first fetch, once for its answer; nothing for pages sent already.
    assert_eq!(w.counts.exported.load(Ordering::SeqCst), 2, "descriptors made again");
    drop(lease); // no streams named: settled, then released
    eventually("let go", || w.counts.let_go.load(Ordering::SeqCst) == 2);
}

#[test]
fn pages_the_sender_gives_back_are_unmapped_at_once_when_idle_and_at_release_when_in_use() {
    let w = World::new();
    let (a, ia) = w.offer(20, 1, None, None);
    let (b, ib) = w.offer(30, 2, None, None);
    w.take(&a, &ia, T).unwrap().release_after_wait(done());
    let in_use = w.take(&b, &ib, T).unwrap();
    eventually("a let go", || w.counts.let_go.load(Ordering::SeqCst) == 1);
    assert_eq!(w.r.stats().kept, 2);
    w.s.released(20);
    w.s.released(31);
    eventually("the idle mapping unmapped", || w.counts.unmapped.load(Ordering::SeqCst) == 1);
    assert_eq!(w.r.stats().kept, 1);
    assert_eq!(w.r.stats().revoked, 1);
    in_use.release_after_wait(done());
    eventually("the revoked one unmapped at its release", || w.counts.unmapped.load(Ordering::SeqCst) == 2);
    assert_eq!(w.r.stats().kept, 0);
    assert_eq!(w.s.stats().revocations, 2);
    // A page never sent to a receiver is revoked from nobody.
    w.s.released(99);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(w.s.stats().revocations, 2);
}

#[test]
fn a_kept_mapping_is_used_only_once_the_sender_grants_the_hold() {
    let w = World::new();
    let (t, inodes) = w.offer(40, 1, None, None);
    w.take(&t, &inodes, T).unwrap().release_after_wait(done());
    eventually("let go", || w.held() == 0 && w.r.stats().releasing == 0);
    // The same pages offered again, and let go before the receiver presents the ticket.
    let again = |w: &World| {
        let shared = FakeShared {
            pages: vec![memfd()],
            serials: t.share.pages.clone(),
            counts: w.counts.clone(),
            gate: None,
        };
        Ticket { token: w.s.offer(Box::new(shared), None).unwrap(), ..t.clone() }
    };
    let withdrawn = again(&w);
    assert!(w.s.withdraw(&withdrawn.token));
    let e = w.r.take(&withdrawn, T, |_| panic!("mapped"), None).unwrap_err();
    assert!(e.to_string().contains("untaken"), "{e}");
    assert_eq!(w.r.stats().leases, 0, "a lease over memory the sender may have reused");
    // The kept mapping serves the next grant.
    let granted = again(&w);
    let lease = w.r.take(&granted, T, |_| panic!("mapped"), None).unwrap();
    assert_eq!(w.held(), 1);
    drop(lease);
    eventually("let go", || w.held() == 0);
}

#[test]
fn a_group_over_kept_mappings_is_claimed_with_one_hold_and_a_member_without_one_fetches_its_pages() {
    let w = World::new();
    // First hand-off: three blocks mapped and kept.
    let first: Vec<_> = (0..3).map(|k| w.offer(900 + 10 * k, 1, Some(5), None)).collect();
    for (t, i) in &first {
        w.take(t, i, T).unwrap().release_after_wait(done());
    }
    eventually("let go", || w.held() == 0 && w.r.stats().releasing == 0);
    // Again, in one group, with a fourth block never mapped here.
    let again = |t: &Ticket| {
        let shared = FakeShared {
            pages: vec![memfd()],
            serials: t.share.pages.clone(),
            counts: w.counts.clone(),
            gate: None,
        };
        Ticket { token: w.s.offer(Box::new(shared), Some(6)).unwrap(), ..t.clone() }
    };
    let tickets: Vec<Ticket> = first.iter().map(|(t, _)| again(t)).collect();
    let (new, inew) = w.offer(990, 1, Some(6), None);
    let lease = w.r.take(&tickets[0], T, |_| panic!("mapped"), None).unwrap();
    assert_eq!(w.held(), 4, "the group came along with the hold");
    // The others over their kept mappings: no message, nothing mapped.
    let mut leases = vec![lease];
    for t in &tickets[1..] {
        leases.push(w.r.take(t, Duration::ZERO, |_| panic!("mapped"), None).unwrap());
    }
    // The one never mapped: its pages, for the offer held already.
    leases.push(w.take(&new, &inew, T).unwrap());
    assert_eq!(w.held(), 4);
    for l in leases {
        l.release_after_wait(done());
    }
    eventually("all let go", || w.held() == 0);
    assert_eq!(w.counts.let_go.load(Ordering::SeqCst), 7);
}

#[test]
fn a_fetch_of_an_offer_let_go_untaken_is_told_so() {
    let w = World::new();
    let (t, _) = w.offer(50, 1, None, None);
    assert!(w.s.withdraw(&t.token));
    assert!(!w.s.withdraw(&t.token), "withdrawn twice");
    let e = w.r.take(&t, T, |_| panic!("mapped"), None).unwrap_err();
    assert!(e.to_string().contains("untaken"), "{e}");
    assert_eq!(w.counts.let_go.load(Ordering::SeqCst), 1);
}

#[test]
fn a_group_travels_in_one_answer() {
    let w = World::new();
    let offers: Vec<_> = (0..5).map(|i| w.offer(100 + 10 * i, 2, Some(7), None)).collect();
    let leases: Vec<_> = offers.iter().map(|(t, i)| w.take(t, i, T).unwrap()).collect();
    // Each offer's descriptors made ahead as it was offered, then for the one answer.
    assert_eq!(w.counts.exported.load(Ordering::SeqCst), 10);
    assert_eq!(w.held(), 5);
    assert_eq!(w.s.stats().offered, 0);
    for l in leases {
        l.release_after_wait(done());
    }
    eventually("all let go", || w.counts.let_go.load(Ordering::SeqCst) == 5);
}

#[test]
fn a_group_member_never_asked_for_is_let_go_when_released_untaken() {
    let w = World::new();
    let (a, ia) = w.offer(200, 1, Some(1), None);
    let (b, _) = w.offer(210, 1, Some(1), None);
    let lease = w.take(&a, &ia, T).unwrap();
    assert_eq!(w.held(), 2, "b came along");
    w.r.let_go(&b, T).unwrap();
    eventually("b let go", || w.counts.let_go.load(Ordering::SeqCst) == 1);
    drop(lease);
    eventually("a let go", || w.counts.let_go.load(Ordering::SeqCst) == 2);
}

#[test]
fn offers_taken_along_and_never_asked_for_are_let_go_and_their_descriptors_closed() {
    let w = World::new();
    w.r.set_along_for(Duration::from_millis(50));
    let (a, ia) = w.offer(260, 1, Some(2), None);
    let (_b, ib) = w.offer(270, 1, Some(2), None);
    let lease = w.take(&a, &ia, T).unwrap();
    assert_eq!(w.held(), 2, "b came along");
    // b's pickle failed to load: nobody asks for it. Its descriptors go, and the sender lets go
    // (dropping its own): no descriptor of b's page is left in this process.
    eventually("b let go", || w.counts.let_go.load(Ordering::SeqCst) == 1 && w.held() == 1);
    let open = |ino: u64| {
        std::fs::read_dir("/proc/self/fd").unwrap().flatten().any(|e| {
            std::fs::metadata(e.path()).is_ok_and(|m| std::os::unix::fs::MetadataExt::ino(&m) == ino)
        })
    };
    eventually("b's descriptors closed", || !open(ib[0]));
    assert!(open(ia[0]), "a's page is still mapped (its descriptor held by the fake mapping)");
    drop(lease);
    eventually("a let go", || w.held() == 0);
}

#[test]
fn an_answer_that_comes_after_its_fetch_gave_up_is_let_go_and_never_given_to_the_next_fetch() {
    let w = World::new();
    let gate = Arc::new(Mutex::new(()));
    let held = gate.lock().unwrap();
    let (slow, islow) = w.offer(300, 1, None, Some(gate.clone()));
    let (next, inext) = w.offer(310, 1, None, None);
    let e = w.take(&slow, &islow, Duration::from_millis(100)).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    drop(held);
    // The next fetch gets its own pages (checked by inode in `take`), not the late answer's.
    let lease = w.take(&next, &inext, T).unwrap();
    // (The counters move just after the offer is dropped.)
    eventually("the late answer let go", || w.counts.let_go.load(Ordering::SeqCst) == 1 && w.held() == 1);
    drop(lease);
    eventually("all let go", || w.held() == 0);
}

#[test]
fn a_release_whose_wait_failed_is_never_told_and_its_mapping_never_unmapped() {
    let w = World::new();
    let (t, inodes) = w.offer(400, 1, None, None);
    let lease = w.take(&t, &inodes, T).unwrap();
    lease.release_after_wait(Box::new(|| Err(Error::invalid("the device wait failed"))));
    eventually("the failure counted", || w.r.stats().held_for_good == 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(w.held(), 1, "the sender was told although the receiver's work may still run");
    assert_eq!(w.counts.unmapped.load(Ordering::SeqCst), 0);
    let _ = crate::error::take_drop_error();
}

#[test]
fn an_offer_is_taken_once() {
    let w = World::new();
    let (t, inodes) = w.offer(500, 1, None, None);
    let lease = w.take(&t, &inodes, T).unwrap();
    // A second receiver with the same ticket (its own connection) is refused.
    let r2 = receiver::Inner::start().unwrap();
    let e = r2.take(&t, T, |_| panic!("mapped"), None).unwrap_err();
    assert!(e.to_string().contains("no such offer"), "{e}");
    let bogus = Ticket { token: Token([0xee; 16]), ..t.clone() };
    assert!(r2.take(&bogus, T, |_| panic!("mapped"), None).is_err());
    drop(lease);
    eventually("let go", || w.held() == 0);
}

#[test]
fn a_ticket_naming_another_process_is_refused_before_anything_is_sent() {
    let w = World::new();
    let (t, _) = w.offer(600, 1, None, None);
    let wrong = Ticket { pid: t.pid + 1, ..t.clone() };
    let e = w.r.take(&wrong, T, |_| panic!("mapped"), None).unwrap_err();
    assert!(e.to_string().contains("not by the sending process"), "{e}");
    assert_eq!(w.s.stats().offered, 1);
}

#[test]
fn offers_nobody_takes_are_let_go_after_their_time_to_live() {
    let w = World::new();
    w.s.set_ttl(Some(Duration::from_millis(50)));
    let (t, _) = w.offer(700, 1, None, None);
    eventually("expired", || w.counts.let_go.load(Ordering::SeqCst) == 1);
    assert_eq!(w.s.stats().expired, 1);
    assert!(w.r.take(&t, T, |_| panic!("mapped"), None).is_err());
}

#[test]
fn a_full_backlog_delays_a_connection_until_its_deadline_instead_of_failing_it() {
    let mut name = b"cuvmm-test-backlog-".to_vec();
    let mut rnd = [0u8; 8];
    super::random(&mut rnd).unwrap();
    name.extend(rnd.iter().map(|b| b'a' + b % 26));
    let listener = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    let addr = nix::sys::socket::UnixAddr::new_abstract(&name).unwrap();
    nix::sys::socket::bind(listener.as_raw_fd(), &addr).unwrap();
    nix::sys::socket::listen(&listener, nix::sys::socket::Backlog::new(1).unwrap()).unwrap();
    // Fill the backlog with connections nobody accepts.
    let mut filled = Vec::new();
    loop {
        let s = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC | nix::sys::socket::SockFlag::SOCK_NONBLOCK,
            None,
        )
        .unwrap();
        match nix::sys::socket::connect(s.as_raw_fd(), &addr) {
            Ok(()) => filled.push(s),
            Err(_) => break,
        }
        assert!(filled.len() < 64, "the backlog never filled");
    }
    let start = Instant::now();
    let e = link::connect(&name, start + Duration::from_millis(150)).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert!(
        start.elapsed() >= Duration::from_millis(140),
        "failed before its deadline: {:?}",
        start.elapsed()
    );
    // Room made (one accepted) before the deadline: it connects.
    let fd = listener.as_raw_fd();
    let accepter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        nix::sys::socket::accept(fd).unwrap()
    });
    link::connect(&name, Instant::now() + T).unwrap();
    let accepted = accepter.join().unwrap();
    nix::unistd::close(accepted).unwrap();
    drop(listener);
}

#[test]
fn releases_from_many_threads_at_once_are_all_told() {
    let w = Arc::new(World::new());
    let n = 64;
    let threads: Vec<_> = (0..8)
        .map(|k| {
            let w = w.clone();
            std::thread::spawn(move || {
                for i in 0..n {
                    let (t, inodes) = w.offer(10_000 + 1000 * k + 10 * i, 1, None, None);
                    let lease = w.take(&t, &inodes, T).unwrap();
                    if i % 2 == 0 {
                        lease.release_after_wait(done());
                    } else {
                        drop(lease);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    eventually("every release told", || {
        w.counts.let_go.load(Ordering::SeqCst) == 8 * n as usize && w.held() == 0
    });
    assert_eq!(w.r.stats().leases, 0);
}

/// Milliseconds of CPU the hand-off's threads of this process have used.
fn handoff_threads_cpu() -> u64 {
    let tick = 1000 / nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as u64;
    let mut ms = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("cuvmm-handoff") {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // The fields after the command (which may hold spaces), from the third on.
        let rest: Vec<&str> = stat.rsplit_once(')').map_or("", |r| r.1).split_whitespace().collect();
        if rest.len() > 12 {
            ms += (rest[11].parse::<u64>().unwrap_or(0) + rest[12].parse::<u64>().unwrap_or(0)) * tick;
        }
    }
    ms
}

/// The receiving process of [`a_receiver_that_ends_its_connection_is_let_go_only_once_its_process_is_gone`]:
/// it fetches the offer named in its environment, closes the connection, and lives on a while.
#[test]
#[ignore = "the receiving process of another test"]
fn receiving_child() {
    let Ok(hex) = std::env::var("CUVMM_TEST_HANDOFF_TICKET") else { return };
    let bytes: Vec<u8> =
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let t = Ticket::from_bytes(&bytes).unwrap();
    let sock = link::connect(&t.address[1..], Instant::now() + T).unwrap();
    link::peer(sock.as_fd(), Some(t.pid)).unwrap();
    let fetch = super::Frame::Fetch(t.token).encode().unwrap();
    assert!(link::send(sock.as_fd(), &fetch, &[]).unwrap());
    let mut got = 0;
    while got < 2 {
        match link::recv(sock.as_fd()).unwrap() {
            Some(_) => got += 1,
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    drop(sock);
    std::thread::sleep(Duration::from_millis(400));
}

#[test]
fn a_receiver_that_ends_its_connection_is_let_go_only_once_its_process_is_gone() {
    let w = World::new();
    let (t, _) = w.offer(800, 1, None, None);
    let hex: String = t.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc::handoff::tests::receiving_child", "--ignored", "--quiet", "--test-threads=1"])
        .env("CUVMM_TEST_HANDOFF_TICKET", hex)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    eventually("taken", || w.held() == 1);
    let cpu = handoff_threads_cpu();
    // Its connection ends well before it exits: the block stays held while it may still run.
    std::thread::sleep(Duration::from_millis(200));
    let alive = child.try_wait().unwrap().is_none();
    if alive {
        assert_eq!(w.held(), 1, "let go while the receiving process still runs");
    }
    assert!(child.wait().unwrap().success());
    eventually("let go once it exited", || w.held() == 0);
    let spent = handoff_threads_cpu() - cpu;
    assert!(spent < 100, "the hand-off's threads spent {spent} ms of CPU while a connection had ended");
    assert_eq!(w.counts.let_go.load(Ordering::SeqCst), 1);
}

#[test]
fn the_most_descriptors_a_message_can_bring_on_a_frame_that_carries_none_are_all_closed() {
    use nix::sys::socket::{
        sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
    };
    let (a, b) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
    )
    .unwrap();
    let name = c"cuvmm-test-overflow";
    let sent: Vec<OwnedFd> = (0..253)
        .map(|_| nix::sys::memfd::memfd_create(name, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).unwrap())
        .collect();
    let raw: Vec<i32> = sent.iter().map(|f| f.as_raw_fd()).collect();
    let copies = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_link(e.path())
                    .is_ok_and(|l| l.to_string_lossy().contains("cuvmm-test-overflow"))
            })
            .count()
    };
    let frame = Frame::Release(vec![Token([7; 16])]).encode().unwrap();
    sendmsg::<()>(
        a.as_raw_fd(),
        &[std::io::IoSlice::new(&frame)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    assert!(link::recv(b.as_fd()).is_err(), "a release carries no descriptor");
    assert_eq!(copies(), sent.len(), "every descriptor that arrived was closed");
}

/// The sender's pages of 2 MiB mapped from `addr` on, serials from `serial`: what its allocator
/// tells once a receiver asked.
fn place(w: &World, device: [u8; 16], serial: u64, addr: u64, n: u64) {
    for k in 0..n {
        let e = Event::Placed { device, serial: serial + k, addr: addr + k * PAGE, size: PAGE, fd: memfd() };
        w.s.placement(e);
    }
}

const PAGE: u64 = 2 << 20;

impl World {
    /// Takes `t` through the mirror if it can, else mapping it as [`take`](Self::take) does.
    fn take_placing(&self, t: &Ticket, inodes: &[u64]) -> Result<receiver::Lease> {
        self.take_with(t, inodes, T, Some(Box::new(FakePlace { counts: self.counts.clone() })))
    }

    /// A first take through the mirror's path: the receiver asks to be placed. No other release
    /// may be on its way.
    fn mirrored(&self) {
        let before = self.counts.let_go.load(Ordering::SeqCst);
        let (t, inodes) = self.offer(1, 1, None, None);
        self.take_placing(&t, &inodes).unwrap().release_after_wait(done());
        eventually("the first offer let go", || self.counts.let_go.load(Ordering::SeqCst) == before + 1);
    }
}

#[test]
fn pages_placed_ahead_are_taken_with_no_descriptor_and_no_mapping() {
    let w = World::new();
    w.mirrored();
    place(&w, [0; 16], 100, 0x4000_0000, 3);
    eventually("three pages placed", || w.r.stats().mirrored == 3);
    assert_eq!(w.counts.placed.load(Ordering::SeqCst), 3);
    // The last two pages, offered as a block starting 4 KiB into the first of them.
    let (mut t, _) = w.offer_at(101, 2, None, None, 0x4000_0000 + PAGE);
    t.share.block = crate::alloc::DevicePtr::new(0x4000_0000 + PAGE + 4096);
    t.share.len -= 4096;
    let exported = w.counts.exported.load(Ordering::SeqCst);
    let lease =
        w.r.take(&t, T, |_| panic!("mapped"), Some(Box::new(FakePlace { counts: w.counts.clone() })))
            .unwrap();
    assert_eq!(lease.ptr(), MIRROR_AT + 0x4000_0000 + PAGE + 4096, "the block's place in the mirror");
    assert_eq!(w.r.stats().mirror_takes, 1);
    assert_eq!(w.held(), 1, "claimed by a hold the sender granted");
    drop(lease);
    eventually("let go", || w.counts.let_go.load(Ordering::SeqCst) == 2);
    // At most the descriptors made ahead of a fetch; none sent for it, and nothing unmapped.
    assert!(w.counts.exported.load(Ordering::SeqCst) <= exported + 1);
    assert_eq!(w.counts.unplaced.load(Ordering::SeqCst), 0);
    assert_eq!(w.r.stats().mirrored, 3);
}

#[test]
fn a_page_unplaced_or_revoked_is_unmapped_at_once_when_idle_and_when_its_last_lease_lets_go() {
    let w = World::new();
    w.mirrored();
    place(&w, [0; 16], 200, 0x4000_0000, 2);
    eventually("placed", || w.r.stats().mirrored == 2);
    let (t, _) = w.offer_at(200, 1, None, None, 0x4000_0000);
    let placer = Some(Box::new(FakePlace { counts: w.counts.clone() }) as Box<dyn Place>);
    let lease = w.r.take(&t, T, |_| panic!("mapped"), placer).unwrap();
    // Page 200 unmapped in the sender while the lease uses it; page 201 given back, idle here.
    w.s.placement(Event::Unplaced { device: [0; 16], addr: 0x4000_0000 });
    w.s.released(201);
    eventually("the idle page unmapped", || w.counts.unplaced.load(Ordering::SeqCst) == 1);
    assert_eq!(w.r.stats().mirrored, 0);
    // A new page mapped where the used one still lies is not placed over it.
    place(&w, [0; 16], 300, 0x4000_0000, 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(w.counts.placed.load(Ordering::SeqCst), 2, "placed over a page in use");
    lease.release_after_wait(done());
    eventually("the used page unmapped at its release", || w.counts.unplaced.load(Ordering::SeqCst) == 2);
    // Placed again once its place is free.
    place(&w, [0; 16], 301, 0x4000_0000, 1);
    eventually("placed again", || w.r.stats().mirrored == 1);
}

#[test]
fn a_block_not_wholly_placed_side_by_side_is_fetched_and_mapped() {
    let w = World::new();
    w.mirrored();
    place(&w, [0; 16], 400, 0x4000_0000, 1);
    place(&w, [0; 16], 401, 0x4000_0000 + 2 * PAGE, 1); // a gap where the block's second page lies
    eventually("placed", || w.r.stats().mirrored == 2);
    let (t, inodes) = w.offer_at(400, 2, None, None, 0x4000_0000);
    let lease = w.take_placing(&t, &inodes).unwrap();
    assert_eq!(lease.ptr(), 0x7000_0000_0000, "mapped for the take");
    assert_eq!(w.r.stats().mirror_takes, 0);
    // A serial that differs from the page placed there is fetched too.
    let (t2, inodes2) = w.offer_at(999, 1, None, None, 0x4000_0000 + 2 * PAGE);
    assert_eq!(w.take_placing(&t2, &inodes2).unwrap().ptr(), 0x7000_0000_0000);
    assert_eq!(w.r.stats().mirror_takes, 0);
    drop(lease);
}

#[test]
fn pages_are_placed_only_for_receivers_that_asked_for_their_device() {
    let w = World::new();
    // A receiver that took with no way to place (peers named, say) asks for nothing.
    let (t, inodes) = w.offer(1, 1, None, None);
    w.take(&t, &inodes, T).unwrap().release_after_wait(done());
    eventually("let go", || w.counts.let_go.load(Ordering::SeqCst) == 1);
    place(&w, [0; 16], 500, 0x4000_0000, 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(w.counts.placed.load(Ordering::SeqCst), 0);
    w.mirrored();
    place(&w, [7; 16], 501, 0x4000_0000, 1); // another device's page
    place(&w, [0; 16], 502, 0x6000_0000, 1);
    eventually("its device's page placed", || w.r.stats().mirrored == 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(w.counts.placed.load(Ordering::SeqCst), 1);
    // A take that cannot use the mirror maps its own, and leaves the mirror's page unused.
    let (t, inodes) = w.offer_at(502, 1, None, None, 0x6000_0000);
    let lease = w.take(&t, &inodes, T).unwrap();
    assert_eq!((lease.ptr(), w.r.stats().mirror_takes), (0x7000_0000_0000, 0));
    w.s.placement(Event::Unplaced { device: [0; 16], addr: 0x6000_0000 });
    eventually("the unused page unmapped", || w.counts.unplaced.load(Ordering::SeqCst) == 1);
    drop(lease);
}
