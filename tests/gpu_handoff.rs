//! The hand-off of a `StreamAllocator`'s blocks between processes on a GPU: zero copy both ways,
//! memory back on the device once the sender gives pages back while the receiver still runs, kept
//! mappings used again, and thousands of hand-offs to receivers killed at random leaving nothing
//! behind. Each test runs this executable again as its receivers (`common::rerun_this_test`),
//! which play the role the environment names; they talk with the test over a Unix socket of
//! their own (the tickets, as length-prefixed records), and every wait is bounded.

mod common;

use cuvmm::alloc::{DevicePtr, SleepMode, StreamAllocator, Tag};
use cuvmm::ipc::handoff::{Lease, Receiver, Sender, Ticket};
use cuvmm::kernels::Kernels;
use cuvmm::{Context, DeviceSlice, Stream};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const ROLE: &str = "CUVMM_HANDOFF_ROLE";
const SOCK: &str = "CUVMM_HANDOFF_SOCKET";
/// The longest any one step may take before the test fails instead of waiting.
const BOUND: Duration = Duration::from_secs(30);
/// The sender, descriptors and device memory are the process's: these tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

fn words(ptr: u64, n: usize) -> DeviceSlice<'static, u32> {
    // SAFETY: every caller passes a live block or lease of at least `n` words and orders its work.
    unsafe { DeviceSlice::from_raw_parts(ptr, n) }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits until `f` holds, failing the test after `within`.
fn eventually(what: &str, within: Duration, f: impl Fn() -> bool) {
    let end = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < end, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One record: a little-endian u32 length, then the bytes.
fn send(s: &mut UnixStream, bytes: &[u8]) {
    s.write_all(&(bytes.len() as u32).to_le_bytes()).unwrap();
    s.write_all(bytes).unwrap();
}

fn recv(s: &mut UnixStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).expect("a record from the other process within the bound");
    let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut b).expect("a whole record");
    b
}

fn u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn bytes_of(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A receiving process, killed (if still running) when dropped, so that a failing test leaves
/// none behind.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Kid {
    fn alive(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }

    /// Waits for it to exit by itself, within the bound.
    fn exits_cleanly(mut self) {
        let end = Instant::now() + BOUND;
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "a receiving process failed: {status:?}");
                return;
            }
            assert!(Instant::now() < end, "a receiving process did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Starts this test again as a receiver in `role`, connected back over a socket of its own.
/// `test` is the test's name (its thread's, taken on that thread).
fn spawn(test: &str, role: &str) -> (Kid, UnixStream) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "cuvmm-handoff-test-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(SOCK, &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let kid = Kid(child);
    listener.set_nonblocking(true).unwrap();
    let end = Instant::now() + BOUND;
    let mut s = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(Instant::now() < end, "the receiving process never connected");
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    let _ = std::fs::remove_file(path);
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    // Its context and receiver made: device memory counted from here, tickets taken at once.
    assert_eq!(recv(&mut s), b"ready");
    (kid, s)
}

fn test_name() -> String {
    std::thread::current().name().expect("the test's thread").to_owned()
}

/// The receiving side, in the copy of the test that `spawn` started: plays the role the
/// environment names and returns true, or returns false at once in the test itself.
fn receiver_role() -> bool {
    let Some(role) = std::env::var_os(ROLE) else { return false };
    let mut s = UnixStream::connect(std::env::var_os(SOCK).unwrap()).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let r = Receiver::global().unwrap();
    send(&mut s, b"ready");
    let take = |b: &[u8]| r.take(&ctx, &Ticket::from_bytes(b).unwrap(), &[], BOUND).unwrap();
    match role.to_str().unwrap() {
        // Checks the sender's pattern through the lease, writes the next one, releases.
        "zero-copy" => {
            let k = Kernels::load(&ctx).unwrap();
            let t = recv(&mut s);
            let lease = take(&t);
            let n = lease.len() / 4;
            let bad = k.count_pattern_mismatches(&st, &words(lease.ptr(), n), 0, 77).unwrap();
            k.pattern_u32(&st, &mut common::words_mut(lease.ptr(), n), 0, 78).unwrap();
            lease.release_after(&st).unwrap();
            send(&mut s, &bytes_of(&[bad]));
            recv(&mut s); // the sender has checked: exit
        }
        // Takes every ticket of a record, releases them all; answers its counters when asked.
        "memory" => loop {
            let m = recv(&mut s);
            match &m[..] {
                b"bye" => break,
                b"stats" => {
                    let x = r.stats();
                    send(&mut s, &bytes_of(&[x.kept as u64, x.kept_bytes, x.revoked, x.leases as u64]));
                }
                _ => {
                    let mut leases = Vec::new();
                    let mut at = 0;
                    while at < m.len() {
                        let len = u32::from_le_bytes(m[at..at + 4].try_into().unwrap()) as usize;
                        leases.push(take(&m[at + 4..at + 4 + len]));
                        at += 4 + len;
                    }
                    for l in leases {
                        l.release_after(&st).unwrap();
                    }
                    eventually("released", BOUND, || r.stats().releasing == 0);
                    send(&mut s, b"released");
                }
            }
        },
        // Each ticket: the lease's address and the counters after it, its first word, released.
        "kept" => loop {
            let t = recv(&mut s);
            if t.is_empty() {
                break;
            }
            let lease = take(&t);
            let first = common::read(&ctx, lease.ptr(), 1)[0];
            let x = r.stats();
            let (kept, conns) = (x.kept as u64, x.connections as u64);
            send(
                &mut s,
                &bytes_of(&[lease.ptr(), kept, conns, u64::from(first), x.mirror_takes, x.mirrored as u64]),
            );
            lease.release_after(&st).unwrap();
        },
        // Takes each ticket, checks its first word is the one named with it, answers, and lets go
        // in one of three ways; keeps up to three leases at a time unreleased.
        "stress" => {
            let mut kept: std::collections::VecDeque<Lease> = Default::default();
            loop {
                let m = recv(&mut s);
                if m.is_empty() {
                    break;
                }
                let want = u32::from_le_bytes(m[..4].try_into().unwrap());
                let lease = take(&m[4..]);
                let got = common::read(&ctx, lease.ptr(), 1)[0];
                send(&mut s, &got.to_le_bytes());
                match want % 3 {
                    0 => lease.release_after(&st).unwrap(),
                    1 => drop(lease),
                    _ => {
                        kept.push_back(lease);
                        if kept.len() > 3 {
                            kept.pop_front().unwrap().release_after(&st).unwrap();
                        }
                    }
                }
            }
            drop(kept);
            eventually("every release told", BOUND, || {
                let x = r.stats();
                x.leases == 0 && x.releasing == 0
            });
        }
        other => panic!("unknown role {other}"),
    }
    true
}

/// The sending side of a test: its turn, a context, a stream, an allocator and the sender.
fn sending_side() -> (MutexGuard<'static, ()>, Context, Stream, StreamAllocator, Sender) {
    let turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    (turn, ctx, st, alloc, Sender::global().unwrap())
}

/// A block handed over is the sender's memory: the receiver reads the sender's bytes and writes
/// its own, which the sender reads once the receiver has let go.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_handed_over_is_the_same_memory_both_ways() {
    if receiver_role() {
        return;
    }
    let (_turn, ctx, st, alloc, sender) = sending_side();
    let k = Kernels::load(&ctx).unwrap();
    let before = sender.stats();
    let n = 6 * MIB / 4;
    let mut b = alloc.allocate(n * 4, &st).unwrap();
    k.pattern_u32(&st, &mut b.as_mut_slice(), 0, 77).unwrap();
    st.synchronize().unwrap();
    let (kid, mut s) = spawn(&test_name(), "zero-copy");
    let ticket = sender.offer(&alloc, b.ptr() + 4096, None).unwrap();
    assert_eq!((ticket.block(), ticket.len()), (b.ptr(), (n * 4) as u64), "the block holding the address");
    send(&mut s, &ticket.to_bytes());
    let bad = u64s(&recv(&mut s))[0];
    assert_eq!(bad, 0, "the receiver read other bytes than the sender wrote");
    eventually("the receiver let go", BOUND, || sender.stats().held == before.held);
    assert_eq!(k.count_pattern_mismatches(&st, &b.as_slice(), 0, 78).unwrap(), 0, "the receiver's writes");
    assert_eq!(alloc.stats().exported, 0);
    send(&mut s, b"bye");
    kid.exits_cleanly();
    drop(b);
    assert_eq!(alloc.stats().freed_shared, 0);
}

fn free(ctx: &Context) -> usize {
    ctx.memory_info().unwrap().free
}

/// Device memory a receiver may hold beside what it maps (page tables and the like).
const TOLERANCE: usize = 64 * MIB;

/// Waits at most 100 ms after the sender gave its pages back for the device's free memory to
/// reach `baseline` (less the tolerance); returns how long it took.
fn back_within_100_ms(ctx: &Context, baseline: usize, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        let f = free(ctx);
        if f + TOLERANCE >= baseline {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_millis(100),
            "{what}: {} MiB of the device still held 100 ms after the sender gave its pages back",
            (baseline - f) / MIB
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Offers the block holding `p` to a "kept" receiver; the ticket, and the receiver's answer once it
/// has let go: the lease's address, kept mappings, connections, the first word, takes served by
/// the mirror, pages in it.
fn hand_one(s: &mut UnixStream, sender: &Sender, alloc: &StreamAllocator, p: u64) -> (Ticket, Vec<u64>) {
    let let_go = sender.stats().let_go;
    let t = sender.offer(alloc, p, None).unwrap();
    send(s, &t.to_bytes());
    let r = u64s(&recv(s));
    eventually("released", BOUND, || sender.stats().let_go == let_go + 1);
    (t, r)
}

/// Hands `blocks` over in one record and waits for the receiver to release them all.
fn hand_over(s: &mut UnixStream, sender: &Sender, alloc: &StreamAllocator, blocks: &[u64]) {
    let mut m = Vec::new();
    for &p in blocks {
        let t = sender.offer(alloc, p, None).unwrap().to_bytes();
        m.extend_from_slice(&(t.len() as u32).to_le_bytes());
        m.extend_from_slice(&t);
    }
    send(s, &m);
    assert_eq!(recv(s), b"released");
    eventually("the receiver's releases told", BOUND, || sender.stats().held == 0);
}

/// The receiver's kept mappings of pages the sender gives back go at once: 4 GiB handed over and
/// released is back on the device within 100 ms of an `empty_cache`, and of a sleep, while the
/// receiving process still runs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn memory_comes_back_within_100_ms_of_the_sender_giving_pages_back_while_the_receiver_runs() {
    if receiver_role() {
        return;
    }
    let (_turn, ctx, st, alloc, sender) = sending_side();
    let (mut kid, mut s) = spawn(&test_name(), "memory");
    let ask = |s: &mut UnixStream| {
        send(s, b"stats");
        u64s(&recv(s))
    };

    // empty_cache: 16 blocks of 256 MiB.
    let baseline = free(&ctx);
    let blocks: Vec<_> = (0..16).map(|_| alloc.allocate(256 * MIB, &st).unwrap()).collect();
    st.synchronize().unwrap();
    assert!(free(&ctx) + 4096 * MIB <= baseline + TOLERANCE, "the blocks hold no memory");
    hand_over(&mut s, &sender, &alloc, &blocks.iter().map(|b| b.ptr()).collect::<Vec<_>>());
    let x = ask(&mut s);
    assert!(x[0] > 0 && x[1] >= (4096 * MIB) as u64, "the receiver keeps no mappings: {x:?}");
    drop(blocks);
    assert_eq!((alloc.stats().exported, alloc.stats().freed_shared), (0, 0));
    alloc.empty_cache().unwrap();
    let took = back_within_100_ms(&ctx, baseline, "empty_cache");
    assert!(kid.alive(), "the receiving process exited");
    let x = ask(&mut s);
    assert_eq!((x[0], x[1], x[3]), (0, 0, 0), "the receiver still keeps mappings: {x:?} ({took:?})");

    // A sleep: 4 tagged blocks of 256 MiB, their pages given back while the blocks stay live.
    let tag = Tag::new("handoff-sleep").unwrap();
    let baseline = free(&ctx);
    let blocks: Vec<_> = (0..4).map(|_| alloc.allocate_tagged(256 * MIB, &st, tag).unwrap()).collect();
    st.synchronize().unwrap();
    hand_over(&mut s, &sender, &alloc, &blocks.iter().map(|b| b.ptr()).collect::<Vec<_>>());
    alloc.sleep(tag, SleepMode::Discard).unwrap();
    back_within_100_ms(&ctx, baseline, "a sleep");
    assert!(kid.alive(), "the receiving process exited");
    assert_eq!(ask(&mut s)[0], 0, "the receiver still keeps mappings of the sleeping tag");
    alloc.wake(tag).unwrap();
    drop(blocks);
    alloc.empty_cache().unwrap();
    send(&mut s, b"bye");
    kid.exits_cleanly();
    assert_eq!(sender.stats().held + sender.stats().offered, 0);
}

/// The same pages handed over again are claimed with the mapping the receiver kept: the same
/// address, no new mapping, the sender's new bytes seen through it; a neighbouring block on the
/// same pages too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_same_block_handed_again_uses_the_mapping_the_receiver_kept() {
    if receiver_role() {
        return;
    }
    let (_turn, ctx, st, alloc, sender) = sending_side();
    let k = Kernels::load(&ctx).unwrap();
    let mut a = alloc.allocate(8 * MIB, &st).unwrap();
    let mut b = alloc.allocate(8 * MIB, &st).unwrap();
    let (kid, mut s) = spawn(&test_name(), "kept");
    let mut round = |p: u64, value: u32, slice: &mut cuvmm::DeviceSliceMut<'_, u32>| {
        k.fill_u32(&st, slice, value).unwrap();
        st.synchronize().unwrap();
        hand_one(&mut s, &sender, &alloc, p)
    };
    let (t1, first) = round(a.ptr(), 1, &mut a.as_mut_slice());
    let (t2, again) = round(a.ptr(), 2, &mut a.as_mut_slice());
    assert_eq!(t1.serials(), t2.serials());
    assert_eq!(first[1..4], [1, 1, 1], "one mapping kept, one connection, the sender's bytes: {first:?}");
    assert_eq!(again[0], first[0], "the block mapped again at another address");
    assert_eq!(again[1..4], [1, 1, 2], "a second mapping, or the sender's new bytes not seen: {again:?}");
    let (t3, next) = round(b.ptr(), 3, &mut b.as_mut_slice());
    if t3.serials() == t1.serials() {
        assert_eq!(next[0] - first[0], b.ptr() - a.ptr(), "the neighbour on the same pages");
        assert_eq!(next[1..4], [1, 1, 3]);
    } else {
        assert_eq!(next[3], 3);
    }
    send(&mut s, &[]);
    kid.exits_cleanly();
}

/// Blocks allocated after a receiver took one are placed in its mirror as their pages are
/// mapped: their first hand-off maps nothing there, reads the sender's bytes, and the memory is
/// back on the device within 100 ms of the sender giving the pages back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn blocks_made_after_a_first_take_are_taken_from_the_receivers_mirror() {
    if receiver_role() {
        return;
    }
    let (_turn, ctx, st, alloc, sender) = sending_side();
    let k = Kernels::load(&ctx).unwrap();
    let (kid, mut s) = spawn(&test_name(), "kept");
    let mut round = |p: u64| hand_one(&mut s, &sender, &alloc, p).1;
    // On a small page: the large pages of the blocks below are all mapped after the receiver
    // asked (a page mapped before is not placed, and a block on it is fetched).
    let mut small = alloc.allocate(MIB, &st).unwrap();
    k.fill_u32(&st, &mut small.as_mut_slice(), 1).unwrap();
    st.synchronize().unwrap();
    let first = round(small.ptr());
    assert_eq!((first[4], first[3]), (0, 1), "a first take through the mirror, or other bytes: {first:?}");
    let baseline = free(&ctx);
    let mut big: Vec<_> = (0..4).map(|_| alloc.allocate(256 * MIB, &st).unwrap()).collect();
    for (i, b) in big.iter_mut().enumerate() {
        k.fill_u32(&st, &mut b.as_mut_slice(), 10 + i as u32).unwrap();
    }
    st.synchronize().unwrap();
    for (i, b) in big.iter().enumerate() {
        let r = round(b.ptr());
        assert_eq!(r[4], 1 + i as u64, "block {i} mapped for its take: {r:?}");
        assert!(r[5] >= 8, "pages in the mirror: {r:?}");
        assert_eq!(r[3], 10 + i as u64, "block {i}: the sender's bytes");
    }
    drop(big);
    alloc.empty_cache().unwrap();
    back_within_100_ms(&ctx, baseline, "empty_cache after hand-offs from the mirror");
    send(&mut s, &[]);
    kid.exits_cleanly();
}

/// 10,000 hand-offs to four receivers at once, two of them SIGKILLed once each at a random point
/// (a ticket in flight, leases held) and replaced: every answer is the sender's bytes, no process
/// waits past its bound, and at the end the sender holds and offers nothing (what the killed
/// receivers never took expired, and only that), its descriptors are back to their count before,
/// the allocator shares nothing, and the device's memory is back after `empty_cache`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ten_thousand_hand_offs_to_receivers_killed_at_random_leave_nothing_behind() {
    if receiver_role() {
        return;
    }
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let test = test_name();
    let ctx = ctx();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let sender = Sender::global().unwrap();
    let ttl = Duration::from_secs(2);
    sender.set_offer_ttl(Some(ttl));
    let _no_ttl_after = NoTtl(sender.clone());
    // Whatever the driver opens for its first export, before the descriptors are counted.
    {
        let st = Stream::non_blocking(&ctx).unwrap();
        let b = alloc.allocate(MIB, &st).unwrap();
        drop(alloc.export(DevicePtr::new(b.ptr())).unwrap());
        alloc.unexport(DevicePtr::new(b.ptr())).unwrap();
        drop(b);
        alloc.empty_cache().unwrap();
    }
    eventually("no connection left by an earlier test", BOUND, || sender.stats().connections == 0);
    let fds = open_fds();
    let used = ctx.memory_info().unwrap().used();
    let start = sender.stats();
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    const WORKERS: u64 = 4;
    const EACH: u64 = 2500;
    // Alive until everything is let go: blocks are freed on them while still shared.
    let streams: Vec<Stream> = (0..WORKERS).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
    let (offers, unanswered): (Vec<u64>, Vec<u64>) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|w| {
                let (ctx, alloc, sender, test) = (ctx.clone(), alloc.clone(), sender.clone(), test.clone());
                let st = &streams[w as usize];
                scope.spawn(move || {
                    let mut x = seed.wrapping_mul(w + 1) | 1;
                    let mut rnd = move |n: u64| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x % n
                    };
                    // Workers 1 and 3 kill their receiver once, somewhere in the middle.
                    let kill_at = (w % 2 == 1).then(|| 200 + rnd(EACH - 400));
                    let (mut kid, mut s) = spawn(&test, "stress");
                    let (mut offers, mut unanswered) = (0, 0);
                    for i in 0..EACH {
                        let size = [4096, 100_000, MIB, 3 * MIB, 9 * MIB][rnd(5) as usize];
                        let b = alloc.allocate(size, st).unwrap();
                        let value = (w << 24 | i) as u32;
                        cuvmm::stream::copy::to_device(&ctx, &mut common::words_mut(b.ptr(), 1), &[value])
                            .unwrap();
                        let t = sender.offer(&alloc, b.ptr(), None).unwrap();
                        offers += 1;
                        drop(b); // freed while shared: kept out of later blocks until let go
                        let mut m = value.to_le_bytes().to_vec();
                        m.extend(t.to_bytes());
                        send(&mut s, &m);
                        if Some(i) == kill_at {
                            // A ticket in flight (taken or not) and up to three leases held.
                            std::thread::sleep(Duration::from_micros(rnd(2000)));
                            kid.0.kill().unwrap();
                            kid.0.wait().unwrap();
                            unanswered += 1;
                            (kid, s) = spawn(&test, "stress");
                            continue;
                        }
                        let got = u32::from_le_bytes(recv(&mut s).try_into().unwrap());
                        assert_eq!(got, value, "worker {w}, hand-off {i}: other bytes (seed {seed})");
                    }
                    send(&mut s, &[]);
                    kid.exits_cleanly();
                    (offers, unanswered)
                })
            })
            .collect();
        workers.into_iter().map(|h| h.join().expect("a worker failed")).unzip()
    });
    let (offers, unanswered): (u64, u64) = (offers.iter().sum(), unanswered.iter().sum());
    assert_eq!(offers, WORKERS * EACH);
    eventually("the sender lets go of everything", ttl + BOUND, || {
        let x = sender.stats();
        x.held == 0 && x.offered == 0 && x.connections == 0
    });
    let end = sender.stats();
    let (let_go, expired) = (end.let_go - start.let_go, end.expired - start.expired);
    assert_eq!(let_go + expired, offers, "offers neither let go nor expired (seed {seed})");
    assert!(expired <= unanswered, "{expired} offers expired, {unanswered} tickets unanswered (seed {seed})");
    let stats = alloc.stats();
    assert_eq!((stats.exported, stats.freed_shared, stats.live), (0, 0, 0), "{stats:?}");
    alloc.empty_cache().unwrap();
    let after = alloc.stats();
    if after.mapped != 0 {
        // What a second emptying gives back says whether the first came too early for it.
        alloc.empty_cache().unwrap();
        panic!("pages left mapped after empty_cache: {after:?}; after a second one: {:?}", alloc.stats());
    }
    assert_eq!(open_fds(), fds, "descriptors left open (seed {seed})");
    drop(streams);
    eventually("the device's memory back", BOUND, || ctx.memory_info().unwrap().used() <= used + TOLERANCE);
}

/// Gives offers back their default, no time to live, when the test that set one ends (passing or not).
struct NoTtl(Sender);

impl Drop for NoTtl {
    fn drop(&mut self) {
        self.0.set_offer_ttl(None);
    }
}
