//! The receiving side: one connection per sending process, read by the library's own thread
//! (answers, revocations, placements, a sender's end); the mappings kept while their sender keeps
//! the pages, and the mirror of its address space its pages are placed in ahead; and releases told
//! only after the work that used the memory is known done.

use super::frame::{Frame, Placement, Refusal, Token, RELEASES_PER_MESSAGE};
use super::link::{self, Wake};
use super::ticket::Ticket;
use crate::error::{record_drop, Error, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Pages mapped in this process; dropping it unmaps them.
pub(crate) trait Mapped: Send + Sync {
    /// Where the first page lies here.
    fn base(&self) -> u64;
    /// Waits for all work that may use the mapping (the device's): what a lease dropped without
    /// naming its streams waits for, on the library's thread.
    fn settle(&self) -> Result<()>;
    /// Its drop unmaps without waiting: every user's work is known done.
    ///
    /// # Safety
    /// No work that uses the pages may be queued or running when it is dropped.
    unsafe fn assume_idle(&mut self);
}

/// A mapping shared by the leases over it and the kept table; the last holder unmaps it.
type Shared = Arc<Mutex<Option<Box<dyn Mapped>>>>;

/// What maps a sender's pages in this process's mirror of its address space, where a block's
/// pages lie side by side as they lie there.
pub(crate) trait Place: Send {
    /// Maps the page `fd` describes (`size` bytes) where the sender's address `addr` falls in the
    /// mirror, readable and writable by this process's device.
    fn place(&mut self, fd: OwnedFd, addr: u64, size: u64) -> Result<Box<dyn Placed>>;
    /// Waits for all work that may use the mirror's pages (the device's): what a lease over them
    /// dropped without naming its streams waits for.
    fn settler(&self) -> Settle;
}

/// A page mapped in the mirror; dropping it unmaps at once (it is dropped only once no lease
/// uses it, every lease over it released after its work).
pub(crate) trait Placed: Send {
    /// Where it lies here.
    fn here(&self) -> u64;
}

/// Waits for the device's work.
pub(crate) type Settle = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// A page in the mirror and the leases that use it.
struct MirrorPage {
    serial: u64,
    size: u64,
    page: Box<dyn Placed>,
    users: usize,
}

/// A connection's mirror: the sender's pages placed ahead, by their address there.
struct Mirror {
    place: Box<dyn Place>,
    settle: Settle,
    pages: HashMap<u64, MirrorPage>,
    /// Pages unplaced or revoked while leases used them, by (address there, serial): unmapped
    /// when the last lets go.
    stale: HashMap<(u64, u64), MirrorPage>,
}

impl Mirror {
    /// Takes `addr`'s page out of the mirror: unmapped now if no lease uses it.
    fn remove(&mut self, addr: u64) {
        if let Some(p) = self.pages.remove(&addr).filter(|p| p.users > 0) {
            self.stale.insert((addr, p.serial), p);
        }
    }

    /// Maps the pages of a placement (or closes their descriptors where it cannot: a place
    /// still held by a page that leases use, or a refusal of the driver).
    fn place(&mut self, placements: Vec<Placement>, fds: Vec<OwnedFd>) {
        for (p, fd) in placements.into_iter().zip(fds) {
            let busy = self.stale.keys().any(|&(a, _)| a == p.addr)
                || self.pages.get(&p.addr).is_some_and(|old| old.users > 0);
            if busy {
                continue;
            }
            self.pages.remove(&p.addr); // unmapped before its place is mapped again
            match self.place.place(fd, p.addr, p.size) {
                Ok(page) => {
                    self.pages.insert(p.addr, MirrorPage { serial: p.serial, size: p.size, page, users: 0 });
                }
                Err(e) => record_drop::<()>(Err(e)),
            }
        }
    }

    /// The block of `ticket` if each of its pages lies in the mirror, side by side: one more
    /// lease uses them. Its address here, and its pages (address there, serial).
    fn claim(&mut self, ticket: &Ticket) -> Option<(u64, Vec<(u64, u64)>)> {
        let (first, page) = (ticket.share.first_page, ticket.page());
        let mut pages = Vec::with_capacity(ticket.share.pages.len());
        let mut base = 0;
        for (k, &serial) in ticket.share.pages.iter().enumerate() {
            let at = first.checked_add(k as u64 * page)?;
            let p = self.pages.get(&at).filter(|p| p.serial == serial && p.size == page)?;
            if k == 0 {
                base = p.page.here();
            } else if p.page.here() != base + k as u64 * page {
                return None;
            }
            pages.push((at, serial));
        }
        for (at, _) in &pages {
            self.pages.get_mut(at).expect("checked").users += 1;
        }
        Some((base, pages))
    }

    /// One lease fewer over the pages at `addrs` (with their serials).
    fn unclaim(&mut self, pages: &[(u64, u64)]) {
        for &(addr, serial) in pages {
            if let Some(p) = self.pages.get_mut(&addr).filter(|p| p.serial == serial) {
                p.users -= 1;
            } else if let Some(p) = self.stale.get_mut(&(addr, serial)) {
                p.users -= 1;
                if p.users == 0 {
                    self.stale.remove(&(addr, serial));
                }
            }
        }
    }
}

/// The mirror's pages under one lease.
struct MirrorLease {
    conn: Arc<Conn>,
    pages: Vec<(u64, u64)>,
    base: u64,
    settle: Settle,
}

impl Mapped for MirrorLease {
    fn base(&self) -> u64 {
        self.base
    }

    fn settle(&self) -> Result<()> {
        (self.settle)()
    }

    unsafe fn assume_idle(&mut self) {
        // Its pages are unmapped only once no lease uses them.
    }
}

impl Drop for MirrorLease {
    fn drop(&mut self) {
        if let Some(m) = lock(&self.conn.st).mirror.as_mut() {
            m.unclaim(&self.pages);
        }
    }
}

/// An answer whose descriptors are still arriving: its offers and the descriptors so far.
type Partial = (Vec<(Token, u32)>, Vec<OwnedFd>);

/// How a taken offer is waited for before its sender is told: the work that used the memory.
pub(crate) type Wait = Box<dyn FnOnce() -> Result<()> + Send>;

/// Seconds an offer taken along (the rest of a fetched group) waits to be asked for before it is
/// let go: a pickle's tensors are rebuilt one after another, so one still waiting belongs to a
/// load that failed.
pub const ALONG_FOR: Duration = Duration::from_secs(60);

/// Counters of a receiver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Connections to sending processes.
    pub connections: usize,
    /// Leases not released yet (their memory in use here).
    pub leases: usize,
    /// Mappings kept (in use, or idle while their sender keeps the pages).
    pub kept: usize,
    /// Bytes of those mappings.
    pub kept_bytes: u64,
    /// Releases waiting for the work that used their memory.
    pub releasing: usize,
    /// Releases not told because waiting for that work failed: their memory stays held (by the
    /// sender) and mapped (here) until this process exits.
    pub held_for_good: u64,
    /// Mappings unmapped because their sender gave the pages back.
    pub revoked: u64,
    /// Pages of senders placed in this process's mirrors of them, ahead of any hand-off.
    pub mirrored: usize,
    /// Takes that found every page of their block in a mirror: no descriptor, no mapping.
    pub mirror_takes: u64,
}

struct KeptMap {
    map: Shared,
    bytes: u64,
    users: usize,
    revoked: bool,
}

enum Answer {
    Waiting,
    Abandoned,
    Got(Result<Vec<OwnedFd>>),
}

/// A question waiting for its answer: a fetch (answered with pages) or a hold (with a grant).
struct Slot {
    token: Token,
    hold: bool,
    answer: Mutex<Answer>,
    cv: Condvar,
}

impl Slot {
    fn new(token: Token, hold: bool) -> Arc<Slot> {
        Arc::new(Slot { token, hold, answer: Mutex::new(Answer::Waiting), cv: Condvar::new() })
    }

    /// Its answer, waited for until `deadline`; a timeout leaves the slot abandoned (its answer,
    /// when it comes, is let go by the library's thread).
    fn wait(&self, deadline: Instant) -> Result<Vec<OwnedFd>> {
        let mut a = lock(&self.answer);
        loop {
            if let Answer::Got(r) = std::mem::replace(&mut *a, Answer::Waiting) {
                return r;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *a = Answer::Abandoned;
                return Err(Error::Timeout { received: 0, expected: 1 });
            }
            a = self.cv.wait_timeout(a, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

#[derive(Default)]
struct ConnState {
    /// Fetches sent and not answered yet, in the order sent (the order of the answers).
    waiting: VecDeque<Arc<Slot>>,
    partial: Option<Partial>,
    along: HashMap<Token, (Vec<OwnedFd>, Instant)>,
    kept: HashMap<Vec<u64>, KeptMap>,
    /// Asked for once a take gave what maps its pages.
    mirror: Option<Mirror>,
    /// Messages the socket had no room for, sent by the library's thread when it has.
    out: VecDeque<Vec<u8>>,
    closed: bool,
}

pub(crate) struct Conn {
    address: Vec<u8>,
    sock: OwnedFd,
    st: Mutex<ConnState>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Conn {
    /// Sends `frame` after everything queued before it (never blocks: what the socket has no
    /// room for waits for the library's thread). Called with the state locked, so that a fetch's
    /// place among the answers is its place among the messages.
    fn send(&self, st: &mut ConnState, frame: &Frame, wake: &Wake) {
        let Ok(bytes) = frame.encode() else { return };
        if st.closed {
            return; // the sender is gone: it let go of everything
        }
        if st.out.is_empty() {
            match link::send(self.sock.as_fd(), &bytes, &[]) {
                Ok(true) => return,
                Ok(false) => {}
                Err(_) => {
                    st.closed = true;
                    return;
                }
            }
        }
        st.out.push_back(bytes);
        wake.wake();
    }
}

pub(crate) struct Inner {
    conns: Mutex<HashMap<Vec<u8>, Arc<Conn>>>,
    wake: Wake,
    releases: Mutex<VecDeque<Release>>,
    more: Condvar,
    leases: AtomicUsize,
    releasing: AtomicUsize,
    held_for_good: AtomicU64,
    revoked: AtomicU64,
    mirror_takes: AtomicU64,
    /// How long an offer taken along waits to be asked for ([`ALONG_FOR`]; shorter in tests).
    along_for: Mutex<Duration>,
}

struct Release {
    conn: Arc<Conn>,
    token: Token,
    key: Option<Vec<u64>>,
    map: Shared,
    wait: Wait,
}

impl Inner {
    pub(crate) fn start() -> Result<Arc<Inner>> {
        let inner = Arc::new(Inner {
            conns: Mutex::new(HashMap::new()),
            wake: Wake::new()?,
            releases: Mutex::new(VecDeque::new()),
            more: Condvar::new(),
            leases: AtomicUsize::new(0),
            releasing: AtomicUsize::new(0),
            held_for_good: AtomicU64::new(0),
            revoked: AtomicU64::new(0),
            mirror_takes: AtomicU64::new(0),
            along_for: Mutex::new(ALONG_FOR),
        });
        let (io, rel) = (Arc::downgrade(&inner), Arc::downgrade(&inner));
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map(drop)
                .map_err(|e| Error::invalid(format!("starting {name}: {e}")))
        };
        spawn("cuvmm-handoff-io", Box::new(move || io_thread(io)))?;
        spawn("cuvmm-handoff-release", Box::new(move || release_thread(rel)))?;
        Ok(inner)
    }

    #[cfg(test)]
    pub(crate) fn set_along_for(&self, d: Duration) {
        *lock(&self.along_for) = d;
    }

    pub(crate) fn stats(&self) -> ReceiverStats {
        let conns: Vec<Arc<Conn>> = lock(&self.conns).values().cloned().collect();
        let (mut kept, mut kept_bytes, mut mirrored) = (0, 0, 0);
        for c in &conns {
            let st = lock(&c.st);
            kept += st.kept.len();
            kept_bytes += st.kept.values().map(|k| k.bytes).sum::<u64>();
            mirrored += st.mirror.as_ref().map_or(0, |m| m.pages.len());
        }
        ReceiverStats {
            connections: conns.len(),
            leases: self.leases.load(Ordering::Relaxed),
            kept,
            kept_bytes,
            releasing: self.releasing.load(Ordering::Relaxed),
            held_for_good: self.held_for_good.load(Ordering::Relaxed),
            revoked: self.revoked.load(Ordering::Relaxed),
            mirrored,
            mirror_takes: self.mirror_takes.load(Ordering::Relaxed),
        }
    }

    /// The connection to `ticket`'s sender, made and checked if there is none.
    fn conn(&self, ticket: &Ticket, deadline: Instant) -> Result<Arc<Conn>> {
        if let Some(c) = lock(&self.conns).get(&ticket.address) {
            return Ok(c.clone());
        }
        let name = ticket
            .address
            .strip_prefix(&[0u8][..])
            .ok_or_else(|| Error::Protocol("not an abstract address".into()))?;
        let sock = link::connect(name, deadline)?;
        // Before any token goes out or any descriptor comes in: whoever holds the name must be
        // the process the ticket names, running as us (abstract names are free for any local user
        // to take once their owner has gone).
        link::peer(sock.as_fd(), Some(ticket.pid))?;
        let c =
            Arc::new(Conn { address: ticket.address.clone(), sock, st: Mutex::new(ConnState::default()) });
        let kept = lock(&self.conns).entry(ticket.address.clone()).or_insert(c).clone();
        self.wake.wake(); // the library's thread reads it from now on
        Ok(kept)
    }

    /// Takes the offer of `ticket`, mapping its pages with `map` unless a kept mapping of them is
    /// there already, or (given `place`, what maps pages in a mirror as this take would map them)
    /// the sender placed them in this connection's mirror. The first take given `place` asks the
    /// sender to place its pages from then on.
    pub(crate) fn take(
        self: &Arc<Self>,
        ticket: &Ticket,
        timeout: Duration,
        map: impl FnOnce(Vec<OwnedFd>) -> Result<Box<dyn Mapped>>,
        place: Option<Box<dyn Place>>,
    ) -> Result<Lease> {
        let deadline = Instant::now() + timeout;
        let conn = self.conn(ticket, deadline)?;
        let token = ticket.token;
        let mirror_ok = place.is_some();
        let mut held_along = false;
        let (slot, kept) = {
            let mut st = lock(&conn.st);
            if st.closed {
                drop(st);
                self.forget(&conn);
                return Err(gone());
            }
            let along = st.along.remove(&token);
            let reuse = match st.kept.get_mut(&ticket.share.pages).filter(|k| !k.revoked) {
                Some(k) => {
                    k.users += 1;
                    Some((k.map.clone(), Some(ticket.share.pages.clone())))
                }
                None if place.is_some() => self.claim_mirror(&conn, &mut st, ticket).map(|m| (m, None)),
                None => None,
            };
            let pair = if let Some((map, key)) = reuse {
                if along.is_some() {
                    // Taken along: the sender holds it for us already (descriptors that came
                    // with it are closed unused).
                    drop(st);
                    return Ok(self.lease(conn, ticket, key, map));
                }
                // Claimed with no descriptor; used only once the sender grants it (the offer
                // may be gone: taken by another, let go, expired).
                let slot = Slot::new(token, true);
                st.waiting.push_back(slot.clone());
                conn.send(&mut st, &Frame::Hold(token), &self.wake);
                (slot, Some((map, key)))
            } else if along.as_ref().is_some_and(|(f, _)| !f.is_empty()) {
                drop(st);
                let (fds, _) = along.expect("checked");
                return self.mapped(conn, ticket, fds, map, mirror_ok);
            } else {
                // Not taken yet, or taken along by a hold without its pages (the sender then
                // answers them for the offer it holds for us).
                held_along = along.is_some();
                let slot = Slot::new(token, false);
                st.waiting.push_back(slot.clone());
                conn.send(&mut st, &Frame::Fetch(token), &self.wake);
                (slot, None)
            };
            if let Some(place) = place.filter(|_| st.mirror.is_none() && !st.closed) {
                // After the question, so that the answer does not wait for the placements.
                let settle = place.settler();
                st.mirror = Some(Mirror { place, settle, pages: HashMap::new(), stale: HashMap::new() });
                conn.send(&mut st, &Frame::Mirror(ticket.device), &self.wake);
            }
            pair
        };
        let answer = slot.wait(deadline);
        if held_along && answer.is_err() {
            // Held for us all the same: let go.
            let mut st = lock(&conn.st);
            conn.send(&mut st, &Frame::Release(vec![token]), &self.wake);
        }
        match kept {
            Some((map, key)) => match answer {
                Ok(_) => Ok(self.lease(conn, ticket, key, map)),
                Err(e) => {
                    let unmap = match key {
                        Some(key) => self.unuse(&mut lock(&conn.st), &key),
                        None => None, // the mirror's pages: one user fewer as `map` drops
                    };
                    drop(map);
                    if let Some(m) = unmap {
                        idle_unmap(&m);
                    }
                    Err(e)
                }
            },
            None => self.mapped(conn, ticket, answer?, map, mirror_ok),
        }
    }

    /// A lease's mapping over the mirror's pages of `ticket`'s block, if they are all there
    /// (counted as a take served by the mirror).
    fn claim_mirror(&self, conn: &Arc<Conn>, st: &mut ConnState, ticket: &Ticket) -> Option<Shared> {
        let m = st.mirror.as_mut()?;
        let (base, pages) = m.claim(ticket)?;
        self.mirror_takes.fetch_add(1, Ordering::Relaxed);
        let lease = MirrorLease { conn: conn.clone(), pages, base, settle: m.settle.clone() };
        Some(Arc::new(Mutex::new(Some(Box::new(lease) as Box<dyn Mapped>))))
    }

    /// One user fewer of the kept mapping under `key`; the mapping to unmap if it was the last
    /// of a revoked one.
    fn unuse(&self, st: &mut ConnState, key: &[u64]) -> Option<Shared> {
        let k = st.kept.get_mut(key)?;
        k.users -= 1;
        if k.users == 0 && (k.revoked || st.closed) {
            return st.kept.remove(key).map(|k| k.map);
        }
        None
    }

    /// Maps the descriptors a fetch got, unless (`mirror_ok`) the pages lie in the mirror: the
    /// sender places a block's pages before it answers for the block, so they may have come
    /// while the fetch waited. On failure, lets the offer go.
    fn mapped(
        self: &Arc<Self>,
        conn: Arc<Conn>,
        ticket: &Ticket,
        fds: Vec<OwnedFd>,
        map: impl FnOnce(Vec<OwnedFd>) -> Result<Box<dyn Mapped>>,
        mirror_ok: bool,
    ) -> Result<Lease> {
        if mirror_ok {
            let mut st = lock(&conn.st);
            if let Some(m) = self.claim_mirror(&conn, &mut st, ticket) {
                drop(st);
                drop(fds);
                return Ok(self.lease(conn, ticket, None, m));
            }
        }
        let r = if fds.len() == ticket.share.pages.len() {
            map(fds)
        } else {
            Err(Error::Protocol(format!(
                "{} page descriptors for a ticket of {} pages",
                fds.len(),
                ticket.share.pages.len()
            )))
        };
        let m = match r {
            Ok(m) => Arc::new(Mutex::new(Some(m))),
            Err(e) => {
                let mut st = lock(&conn.st);
                conn.send(&mut st, &Frame::Release(vec![ticket.token]), &self.wake);
                return Err(e);
            }
        };
        let mut st = lock(&conn.st);
        let key = if st.kept.contains_key(&ticket.share.pages) || st.closed {
            None // mapped by another thread meanwhile (this one is not kept), or the sender gone
        } else {
            let bytes = ticket.page() * ticket.share.pages.len() as u64;
            st.kept.insert(
                ticket.share.pages.clone(),
                KeptMap { map: m.clone(), bytes, users: 1, revoked: false },
            );
            Some(ticket.share.pages.clone())
        };
        drop(st);
        Ok(self.lease(conn, ticket, key, m))
    }

    fn lease(
        self: &Arc<Self>,
        conn: Arc<Conn>,
        ticket: &Ticket,
        key: Option<Vec<u64>>,
        map: Shared,
    ) -> Lease {
        self.leases.fetch_add(1, Ordering::Relaxed);
        let base = lock(&map).as_ref().map_or(0, |m| m.base());
        Lease {
            inner: self.clone(),
            conn: Some(conn),
            token: ticket.token,
            key,
            map,
            ptr: base + ticket.offset(),
            len: ticket.share.len,
        }
    }

    /// Tells the sender of `ticket` that this process will not use it.
    pub(crate) fn let_go(&self, ticket: &Ticket, timeout: Duration) -> Result<()> {
        let conn = self.conn(ticket, Instant::now() + timeout)?;
        let mut st = lock(&conn.st);
        st.along.remove(&ticket.token);
        conn.send(&mut st, &Frame::Release(vec![ticket.token]), &self.wake);
        Ok(())
    }

    fn forget(&self, conn: &Arc<Conn>) {
        let mut conns = lock(&self.conns);
        if conns.get(&conn.address).is_some_and(|c| Arc::ptr_eq(c, conn)) {
            conns.remove(&conn.address);
        }
    }
}

fn gone() -> Error {
    Error::Protocol("the sending process has gone (or its connection broke)".into())
}

/// One offer taken: the sender's block mapped here, held until released.
pub struct Lease {
    inner: Arc<Inner>,
    conn: Option<Arc<Conn>>,
    token: Token,
    key: Option<Vec<u64>>,
    map: Shared,
    ptr: u64,
    len: u64,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Lease {
    /// The block's address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The block's size.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the block is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lets go once `wait` has returned, on the library's release thread: the sender is told,
    /// and the mapping unmapped unless kept. A `wait` that fails keeps both for good (the work
    /// that used the memory may still run).
    pub(crate) fn release_after_wait(mut self, wait: Wait) {
        self.queue_release(wait);
    }

    fn queue_release(&mut self, wait: Wait) {
        let Some(conn) = self.conn.take() else { return };
        let r = Release { conn, token: self.token, key: self.key.take(), map: self.map.clone(), wait };
        self.inner.releasing.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.releases).push_back(r);
        self.inner.more.notify_one();
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let map = self.map.clone();
        // Named no streams: the device's work is waited for, on the release thread.
        self.queue_release(Box::new(move || lock(&map).as_ref().map_or(Ok(()), |m| m.settle())));
        self.inner.leases.fetch_sub(1, Ordering::Relaxed);
    }
}

fn release_thread(inner: Weak<Inner>) {
    loop {
        let Some(i) = inner.upgrade() else { return };
        let batch: Vec<Release> = {
            let mut q = lock(&i.releases);
            while q.is_empty() {
                q = i.more.wait_timeout(q, Duration::from_secs(1)).unwrap_or_else(|e| e.into_inner()).0;
                if q.is_empty() && Arc::strong_count(&i) == 1 {
                    return; // (tests) nobody can queue a release any more
                }
            }
            q.drain(..).collect()
        };
        // Waited in order; a release is told with the others of its connection.
        let mut tell: Vec<(Arc<Conn>, Vec<Token>)> = Vec::new();
        let mut unmap = Vec::new();
        for r in batch {
            if let Err(e) = (r.wait)() {
                record_drop::<()>(Err(e));
                i.held_for_good.fetch_add(1, Ordering::Relaxed);
                // Neither told nor unmapped: the mapping is leaked, so no drop unmaps it.
                if let Some(k) = &r.key {
                    let mut st = lock(&r.conn.st);
                    if let Some(k) = st.kept.remove(k) {
                        std::mem::forget(k.map);
                    }
                }
                std::mem::forget(r.map);
                i.releasing.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            {
                let mut st = lock(&r.conn.st);
                let keep = r.key.as_ref().and_then(|k| st.kept.get_mut(k)).is_some_and(|k| {
                    k.users -= 1;
                    k.users > 0 || !k.revoked
                });
                if !keep {
                    if let Some(k) = &r.key {
                        st.kept.remove(k);
                    }
                    unmap.push(r.map.clone());
                }
            }
            match tell.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &r.conn)) {
                Some((_, ts)) => ts.push(r.token),
                None => tell.push((r.conn.clone(), vec![r.token])),
            }
            i.releasing.fetch_sub(1, Ordering::Relaxed);
        }
        for m in unmap {
            idle_unmap(&m);
        }
        for (c, tokens) in tell {
            let mut st = lock(&c.st);
            for part in tokens.chunks(RELEASES_PER_MESSAGE) {
                c.send(&mut st, &Frame::Release(part.to_vec()), &i.wake);
            }
        }
    }
}

/// Unmaps a mapping whose users' work is done (if no other lease still holds it).
fn idle_unmap(m: &Shared) {
    if Arc::strong_count(m) > 1 {
        return; // a lease or the kept table still holds it; the last one unmaps
    }
    if let Some(mut map) = lock(m).take() {
        // SAFETY: every lease of it was released after its wait completed, and none is left.
        unsafe { map.assume_idle() };
        drop(map);
    }
}

fn io_thread(inner: Weak<Inner>) {
    if let Some(i) = inner.upgrade() {
        link::make_fd_room(i.wake.fd());
    }
    loop {
        let Some(i) = inner.upgrade() else { return };
        let conns: Vec<Arc<Conn>> = lock(&i.conns).values().cloned().collect();
        let mut fds = vec![PollFd::new(i.wake.fd(), PollFlags::POLLIN)];
        for c in &conns {
            let out = !lock(&c.st).out.is_empty();
            let ev = if out { PollFlags::POLLIN | PollFlags::POLLOUT } else { PollFlags::POLLIN };
            fds.push(PollFd::new(c.sock.as_fd(), ev));
        }
        // A tick to let go of offers taken along and never asked for, and to notice the end.
        let tick = PollTimeout::try_from(1000).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, tick) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                record_drop::<()>(Err(Error::Os { call: "poll (hand-off)", errno: e }));
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let ready: Vec<PollFlags> = fds.iter().map(|p| p.revents().unwrap_or(PollFlags::empty())).collect();
        drop(fds);
        if !ready[0].is_empty() {
            i.wake.drain();
        }
        let mut unmap = Vec::new();
        for (c, r) in conns.iter().zip(&ready[1..]) {
            if r.contains(PollFlags::POLLOUT) {
                flush(c, &mut unmap);
            }
            if r.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
                read(&i, c, &mut unmap);
            }
            expire_along(&i, c);
            if lock(&c.st).closed {
                i.forget(c);
            }
        }
        for m in unmap {
            idle_unmap(&m);
        }
        if Arc::strong_count(&i) == 1 {
            return; // (tests) nobody holds the receiver or a lease any more
        }
    }
}

fn flush(c: &Conn, unmap: &mut Vec<Shared>) {
    let mut st = lock(&c.st);
    while let Some(b) = st.out.front() {
        match link::send(c.sock.as_fd(), b, &[]) {
            Ok(true) => {
                st.out.pop_front();
            }
            Ok(false) => return,
            Err(_) => {
                close(&mut st, unmap);
                return;
            }
        }
    }
}

/// The sender is gone or out of step: every fetch waiting fails, and kept mappings nobody uses
/// are given up (their pages are the sender's no more; leases in use keep theirs): returned,
/// for the caller to unmap once it holds no lock.
fn close(st: &mut ConnState, unmap: &mut Vec<Shared>) {
    st.closed = true;
    st.out.clear();
    st.along.clear();
    st.partial = None;
    for s in st.waiting.drain(..) {
        answer(&s, Err(gone()));
    }
    st.kept.retain(|_, k| {
        k.revoked = true;
        if k.users == 0 {
            unmap.push(k.map.clone());
        }
        k.users > 0
    });
    if let Some(m) = st.mirror.as_mut() {
        let placed: Vec<u64> = m.pages.keys().copied().collect();
        for addr in placed {
            m.remove(addr);
        }
    }
}

fn answer(s: &Slot, r: Result<Vec<OwnedFd>>) -> bool {
    let mut a = lock(&s.answer);
    if matches!(*a, Answer::Abandoned) {
        return false;
    }
    *a = Answer::Got(r);
    s.cv.notify_all();
    true
}

fn read(i: &Inner, c: &Arc<Conn>, unmap: &mut Vec<Shared>) {
    loop {
        let got = link::recv(c.sock.as_fd());
        let mut st = lock(&c.st);
        match got {
            Ok(None) => return,
            Ok(Some((frame, fds))) => {
                if let Err(e) = handle(i, c, &mut st, frame, fds, unmap) {
                    record_drop::<()>(Err(e));
                    close(&mut st, unmap);
                    return;
                }
            }
            Err(e) => {
                if !matches!(e, Error::PeerClosed { .. }) {
                    record_drop::<()>(Err(e));
                }
                close(&mut st, unmap);
                return;
            }
        }
    }
}

fn handle(
    i: &Inner,
    c: &Arc<Conn>,
    st: &mut ConnState,
    frame: Frame,
    fds: Vec<OwnedFd>,
    unmap: &mut Vec<Shared>,
) -> Result<()> {
    match frame {
        Frame::Offered(entries) if st.partial.is_none() => st.partial = Some((entries, Vec::new())),
        Frame::Pages(_) if st.partial.is_some() => {
            let (entries, mut got) = st.partial.take().expect("checked");
            got.extend(fds);
            let total: usize = entries.iter().map(|&(_, n)| n as usize).sum();
            if got.len() > total {
                return Err(Error::Protocol("more page descriptors than the answer announced".into()));
            }
            if got.len() < total {
                st.partial = Some((entries, got));
                return Ok(());
            }
            let slot =
                st.waiting.pop_front().ok_or_else(|| Error::Protocol("an answer nobody asked for".into()))?;
            if slot.hold || entries[0].0 != slot.token {
                answer(&slot, Err(Error::Protocol("the sender answered another question".into())));
                return Err(Error::Protocol("an answer for another fetch".into()));
            }
            let mut rest = got.into_iter();
            let mut parts: Vec<(Token, Vec<OwnedFd>)> =
                entries.iter().map(|&(t, n)| (t, rest.by_ref().take(n as usize).collect())).collect();
            let first = parts.remove(0);
            if answer(&slot, Ok(first.1)) {
                let now = Instant::now();
                for (t, f) in parts {
                    st.along.insert(t, (f, now));
                }
            } else {
                // Its fetch gave up waiting: everything this answer handed over is let go.
                let tokens: Vec<Token> =
                    std::iter::once(first.0).chain(parts.into_iter().map(|(t, _)| t)).collect();
                c.send(st, &Frame::Release(tokens), &i.wake);
            }
        }
        Frame::Held(along) if st.partial.is_none() => {
            let slot =
                st.waiting.pop_front().ok_or_else(|| Error::Protocol("a grant nobody asked for".into()))?;
            if !slot.hold {
                answer(&slot, Err(Error::Protocol("the sender answered another question".into())));
                return Err(Error::Protocol("a grant for a fetch".into()));
            }
            if answer(&slot, Ok(Vec::new())) {
                let now = Instant::now();
                for t in along {
                    st.along.insert(t, (Vec::new(), now));
                }
            } else {
                // Its take gave up waiting: the offer, and what came along, are let go.
                let tokens: Vec<Token> = std::iter::once(slot.token).chain(along).collect();
                c.send(st, &Frame::Release(tokens), &i.wake);
            }
        }
        Frame::Refused(r) if st.partial.is_none() => {
            let slot =
                st.waiting.pop_front().ok_or_else(|| Error::Protocol("a refusal nobody asked for".into()))?;
            let why = match r {
                Refusal::Unknown => "the sending process has no such offer (taken already, or let go)",
                Refusal::Failed => "the sending process could not export the pages (its error log says why)",
                Refusal::Withdrawn => {
                    "the sending process let the offer go untaken (withdrawn, or past its time to live)"
                }
            };
            answer(&slot, Err(Error::Protocol(why.into())));
        }
        Frame::Placed(placements) => {
            let m =
                st.mirror.as_mut().ok_or_else(|| Error::Protocol("placements nobody asked for".into()))?;
            m.place(placements, fds);
        }
        Frame::Unplaced(addrs) => {
            if let Some(m) = st.mirror.as_mut() {
                for addr in addrs {
                    m.remove(addr);
                }
            }
        }
        Frame::Revoke(serials) => {
            if let Some(m) = st.mirror.as_mut() {
                let hit: Vec<u64> =
                    m.pages.iter().filter(|(_, p)| serials.contains(&p.serial)).map(|(&a, _)| a).collect();
                for addr in hit {
                    m.remove(addr);
                    i.revoked.fetch_add(1, Ordering::Relaxed);
                }
            }
            let hit: Vec<Vec<u64>> =
                st.kept.keys().filter(|k| k.iter().any(|s| serials.contains(s))).cloned().collect();
            for key in hit {
                let k = st.kept.get_mut(&key).expect("listed");
                k.revoked = true;
                if k.users == 0 {
                    let k = st.kept.remove(&key).expect("listed");
                    unmap.push(k.map);
                    i.revoked.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        other => return Err(Error::Protocol(format!("a sender's message out of order: {other:?}"))),
    }
    Ok(())
}

fn expire_along(i: &Inner, c: &Conn) {
    let along_for = *lock(&i.along_for);
    let mut st = lock(&c.st);
    let now = Instant::now();
    let stale: Vec<Token> =
        st.along.iter().filter(|(_, (_, at))| now - *at > along_for).map(|(t, _)| *t).collect();
    if stale.is_empty() {
        return;
    }
    for t in &stale {
        st.along.remove(t);
    }
    for part in stale.chunks(RELEASES_PER_MESSAGE) {
        c.send(&mut st, &Frame::Release(part.to_vec()), &i.wake);
    }
}
