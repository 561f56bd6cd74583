//! The sending side: offers, the thread that answers receivers, what each connection holds, and
//! the revocation of pages this process gives back.

use super::frame::{
    Frame, Placement, Refusal, Token, FDS_PER_MESSAGE, OFFERS_PER_ANSWER, SERIALS_PER_MESSAGE,
};
use super::link::{self, Peer, Wake};
use crate::error::{record_drop, Error, Result};
use crate::vmm::placements::{self, Event};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What an offer holds in the sender until its receiver lets go: dropping it is the letting go
/// (for an allocator's block, the end of one sharing of it).
pub(crate) trait Shared: Send + Sync {
    /// New descriptors of the pages, in address order, for a receiver that maps none of them.
    fn descriptors(&self) -> Result<Vec<OwnedFd>>;
    /// The pages' serials, in address order.
    fn serials(&self) -> &[u64];
}

/// Messages a connection may have waiting to be sent before the receiver counts as stalled: it
/// is then cut off (what it holds is let go once its process has gone).
const QUEUED_MOST: usize = 4096;

/// Tokens of offers let go untaken that are remembered, so that a late fetch or hold of one is
/// told it was withdrawn rather than unknown.
const GONE_MOST: usize = 4096;

/// Counters of a sender.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Offers not taken yet.
    pub offered: usize,
    /// Offers taken whose receivers have not let go.
    pub held: usize,
    /// Receiving processes connected (or gone, with offers held until their exit is seen).
    pub connections: usize,
    /// Offers withdrawn untaken after their time to live.
    pub expired: u64,
    /// Pages revoked from receivers (given back here while a receiver may map them).
    pub revocations: u64,
    /// Offers let go.
    pub let_go: u64,
}

struct Untaken {
    shared: Arc<dyn Shared>,
    group: Option<u64>,
    made: Instant,
}

#[derive(Default)]
struct State {
    offers: HashMap<Token, Untaken>,
    groups: HashMap<u64, Vec<Token>>,
    /// Serials of exported pages given back since the server last looked.
    released: Vec<u64>,
    stats: SenderStats,
    ttl: Option<Duration>,
    /// Offers let go untaken (expired, withdrawn, declined), newest last.
    gone: VecDeque<Token>,
    /// Offers made since the server last looked, whose pages' descriptors it makes ahead of a
    /// fetch.
    fresh: Vec<Token>,
    /// Pages mapped and unmapped since the server last looked, in order, for the receivers that
    /// mirror them.
    placements: Vec<Event>,
}

impl State {
    fn forget(&mut self, t: Token) {
        if self.gone.len() == GONE_MOST {
            self.gone.pop_front();
        }
        self.gone.push_back(t);
    }

    /// Why no offer has token `t`.
    fn refusal(&self, t: &Token) -> Refusal {
        if self.gone.contains(t) {
            Refusal::Withdrawn
        } else {
            Refusal::Unknown
        }
    }

    fn take(&mut self, t: &Token) -> Option<Untaken> {
        let u = self.offers.remove(t)?;
        if let Some(g) = u.group {
            if let Some(members) = self.groups.get_mut(&g) {
                members.retain(|m| m != t);
                if members.is_empty() {
                    self.groups.remove(&g);
                }
            }
        }
        self.stats.offered -= 1;
        self.stats.held += 1;
        Some(u)
    }

    /// Takes the offer under `t` and the untaken rest of its group (at most what one answer
    /// carries).
    fn take_with_group(&mut self, t: &Token) -> Option<(Untaken, Vec<(Token, Untaken)>)> {
        let first = self.take(t)?;
        let mut along = Vec::new();
        if let Some(g) = first.group {
            let members: Vec<Token> = self
                .groups
                .get(&g)
                .map(|m| m.iter().take(OFFERS_PER_ANSWER - 1).copied().collect())
                .unwrap_or_default();
            for m in members {
                if let Some(u) = self.take(&m) {
                    along.push((m, u));
                }
            }
        }
        Some((first, along))
    }

    fn put_back(&mut self, t: Token, u: Untaken) {
        if let Some(g) = u.group {
            self.groups.entry(g).or_default().push(t);
        }
        self.offers.insert(t, u);
        self.stats.offered += 1;
        self.stats.held -= 1;
    }
}

pub(crate) struct Inner {
    pub(crate) address: Vec<u8>,
    pub(crate) pid: u32,
    wake: Wake,
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// Listens at a fresh abstract address and starts the thread that answers.
    pub(crate) fn start() -> Result<Arc<Inner>> {
        let pid = std::process::id();
        let mut rnd = [0u8; 8];
        super::random(&mut rnd)?;
        let hex: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("cuvmm-handoff-{pid}-{hex}").into_bytes();
        let listener = link::listen(&name)?;
        let mut address = vec![0u8];
        address.extend_from_slice(&name);
        let inner = Arc::new(Inner { address, pid, wake: Wake::new()?, state: Mutex::new(State::default()) });
        let server = Server { inner: inner.clone(), listener, conns: Vec::new() };
        std::thread::Builder::new()
            .name("cuvmm-handoff".into())
            .spawn(move || server.run())
            .map_err(|e| Error::invalid(format!("starting the hand-off thread: {e}")))?;
        Ok(inner)
    }

    /// Offers `shared`; returns the token that takes it.
    pub(crate) fn offer(&self, shared: Box<dyn Shared>, group: Option<u64>) -> Result<Token> {
        let mut t = [0u8; 16];
        super::random(&mut t)?;
        let token = Token(t);
        let mut s = lock(&self.state);
        if let Some(g) = group {
            s.groups.entry(g).or_default().push(token);
        }
        s.offers.insert(token, Untaken { shared: Arc::from(shared), group, made: Instant::now() });
        s.stats.offered += 1;
        s.fresh.push(token);
        drop(s);
        // The server makes its descriptors while the ticket travels (and its expiry may come
        // before the server's next one).
        self.wake.wake();
        Ok(token)
    }

    /// Lets go of the offer under `t` unless it was taken; whether it was there.
    pub(crate) fn withdraw(&self, t: &Token) -> bool {
        let u = {
            let mut s = lock(&self.state);
            let u = s.take(t);
            if u.is_some() {
                s.stats.held -= 1;
                s.stats.let_go += 1;
                s.forget(*t);
            }
            u
        };
        u.is_some() // dropped (let go) without the lock
    }

    pub(crate) fn stats(&self) -> SenderStats {
        lock(&self.state).stats
    }

    pub(crate) fn set_ttl(&self, ttl: Option<Duration>) {
        lock(&self.state).ttl = ttl;
        self.wake.wake();
    }

    /// Pages of this process given back to the device: receivers that keep mappings of them are
    /// asked to let go. Called under allocators' locks: only queues and wakes.
    pub(crate) fn released(&self, serial: u64) {
        lock(&self.state).released.push(serial);
        self.wake.wake();
    }

    /// A page of this process mapped or unmapped, for the receivers that mirror them. Called
    /// under allocators' locks: only queues and wakes.
    pub(crate) fn placement(&self, e: Event) {
        lock(&self.state).placements.push(e);
        self.wake.wake();
    }
}

/// Messages of placements for one connection, in the order of the events.
enum Batch {
    Placed(Vec<Placement>, Vec<OwnedFd>),
    Unplaced(Vec<u64>),
}

/// Adds the page `p` placed, with its descriptor, to what is told to `conn` in `batch`.
fn placed_in(conn: &mut Conn, batch: &mut Vec<Batch>, p: Placement, fd: OwnedFd) {
    conn.placed.insert(p.addr, p.serial);
    conn.sent.insert(p.serial);
    match batch.last_mut() {
        Some(Batch::Placed(ps, fds)) if ps.len() < FDS_PER_MESSAGE => {
            ps.push(p);
            fds.push(fd);
        }
        _ => batch.push(Batch::Placed(vec![p], vec![fd])),
    }
}

/// One receiving process's connection, as the server sees it.
struct Conn {
    /// None once it ended: a closed peer's socket would wake every poll.
    sock: Option<OwnedFd>,
    peer: Peer,
    /// What it took and has not let go of.
    held: HashMap<Token, Arc<dyn Shared>>,
    /// Serials of the pages whose descriptors it was given (it may keep mappings of them).
    sent: HashSet<u64>,
    out: VecDeque<(Vec<u8>, Vec<OwnedFd>)>,
    /// The device (by UUID) whose pages it mirrors, once it asked.
    mirror: Option<[u8; 16]>,
    /// Where pages placed in its mirror lie here (address to serial).
    placed: HashMap<u64, u64>,
}

impl Conn {
    /// Its socket ended (closed, out of step, stalled): it is asked nothing more, and what it
    /// holds is let go once its process is gone.
    fn ended(&self) -> bool {
        self.sock.is_none()
    }

    fn end(&mut self) {
        self.sock = None;
        self.out.clear();
    }
}

struct Server {
    inner: Arc<Inner>,
    listener: OwnedFd,
    conns: Vec<Conn>,
}

impl Server {
    /// Answers for the rest of the process's life (its state is the process's).
    fn run(mut self) {
        link::make_fd_room(self.listener.as_fd());
        loop {
            self.turn();
        }
    }

    fn turn(&mut self) {
        let timeout = self.next_expiry().map_or(PollTimeout::NONE, |d| {
            PollTimeout::try_from(d.as_millis().min(60_000) as i32 + 1).unwrap_or(PollTimeout::MAX)
        });
        let (wake, listener, ready) = {
            let mut fds = vec![
                PollFd::new(self.inner.wake.fd(), PollFlags::POLLIN),
                PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
            ];
            for c in &self.conns {
                // An ended connection's pidfd stands in for its socket: no event of it is read.
                let sock = c.sock.as_ref().map_or(c.peer.pidfd.as_fd(), |s| s.as_fd());
                let mut ev = PollFlags::POLLIN;
                if !c.out.is_empty() {
                    ev |= PollFlags::POLLOUT;
                }
                fds.push(PollFd::new(sock, if c.ended() { PollFlags::empty() } else { ev }));
                fds.push(PollFd::new(c.peer.pidfd.as_fd(), PollFlags::POLLIN));
            }
            if let Err(e) = poll(&mut fds, timeout) {
                if e != nix::errno::Errno::EINTR {
                    record_drop::<()>(Err(Error::Os { call: "poll (hand-off)", errno: e }));
                    std::thread::sleep(Duration::from_millis(10));
                }
                return;
            }
            let r = |p: &PollFd| p.revents().unwrap_or(PollFlags::empty());
            let ready: Vec<(PollFlags, PollFlags)> =
                fds[2..].chunks(2).map(|c| (r(&c[0]), r(&c[1]))).collect();
            (r(&fds[0]), r(&fds[1]), ready)
        };
        if !wake.is_empty() {
            self.inner.wake.drain();
            self.place();
            self.revoke();
            self.make_ahead();
        }
        if !listener.is_empty() {
            self.accept();
        }
        for (i, (sock, pidfd)) in ready.into_iter().enumerate() {
            let c = &mut self.conns[i];
            if !pidfd.is_empty() {
                // Its process is gone (after the kernel closed its descriptors, its device
                // work with them): nothing it held can be used any more.
                c.end();
                let n = c.held.len();
                c.held.clear();
                self.let_go(n);
                continue;
            }
            if self.conns[i].ended() {
                continue;
            }
            if sock.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
                self.read(i);
            }
            if sock.contains(PollFlags::POLLOUT) {
                self.flush(i);
            }
        }
        // A connection whose process is gone, or that ended holding nothing, is closed.
        self.conns.retain(|c| !(c.ended() && c.held.is_empty()));
        lock(&self.inner.state).stats.connections = self.conns.len();
        self.expire();
    }

    fn accept(&mut self) {
        loop {
            match link::accept(self.listener.as_fd()) {
                Ok(Some(sock)) => match link::peer(sock.as_fd(), None) {
                    Ok(peer) => self.conns.push(Conn {
                        sock: Some(sock),
                        peer,
                        held: HashMap::new(),
                        sent: HashSet::new(),
                        out: VecDeque::new(),
                        mirror: None,
                        placed: HashMap::new(),
                    }),
                    Err(e) => record_drop::<()>(Err(e)),
                },
                Ok(None) => return,
                Err(e) => {
                    // Out of descriptors, say: let some go before trying again.
                    record_drop::<()>(Err(e));
                    std::thread::sleep(Duration::from_millis(5));
                    return;
                }
            }
        }
    }

    fn let_go(&self, n: usize) {
        if n > 0 {
            let mut s = lock(&self.inner.state);
            s.stats.held -= n;
            s.stats.let_go += n as u64;
        }
    }

    /// Reads and answers what connection `i` sent; ends it on anything out of order.
    fn read(&mut self, i: usize) {
        while let Some(sock) = &self.conns[i].sock {
            match link::recv(sock.as_fd()) {
                Ok(Some((frame, _))) => {
                    if let Err(e) = self.answer(i, frame) {
                        record_drop::<()>(Err(e));
                        self.conns[i].end();
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    if !matches!(e, Error::PeerClosed { .. }) {
                        record_drop::<()>(Err(e));
                    }
                    self.conns[i].end();
                }
            }
        }
    }

    fn answer(&mut self, i: usize, frame: Frame) -> Result<()> {
        match frame {
            Frame::Fetch(t) => self.fetch(i, t),
            Frame::Hold(t) => {
                let (taken, why) = {
                    let mut s = lock(&self.inner.state);
                    (s.take_with_group(&t), s.refusal(&t))
                };
                let Some((first, along)) = taken else {
                    return self.queue(i, Frame::Refused(why), Vec::new());
                };
                // The rest of its group comes along, held without descriptors: a receiver that
                // maps their pages too takes them with no message; one that does not fetches
                // their pages (a fetch of an offer a connection holds answers its pages).
                let c = &mut self.conns[i];
                c.held.insert(t, first.shared);
                let mut tokens = Vec::with_capacity(along.len());
                for (m, u) in along {
                    c.held.insert(m, u.shared);
                    tokens.push(m);
                }
                self.queue(i, Frame::Held(tokens), Vec::new())
            }
            Frame::Release(ts) => {
                let mut n = 0;
                for t in ts {
                    if self.conns[i].held.remove(&t).is_some() {
                        n += 1;
                        continue;
                    }
                    // An offer it will not use, let go untaken (dropped without the lock).
                    let untaken = {
                        let mut s = lock(&self.inner.state);
                        let u = s.take(&t);
                        if u.is_some() {
                            s.forget(t);
                        }
                        u
                    };
                    n += usize::from(untaken.is_some());
                }
                self.let_go(n);
                Ok(())
            }
            Frame::Mirror(uuid) => {
                // Pages mapped from now on are placed in its mirror as they are mapped.
                self.conns[i].mirror = Some(uuid);
                placements::want();
                Ok(())
            }
            other => Err(Error::Protocol(format!("a receiver sent a sender's message ({other:?})"))),
        }
    }

    /// Answers a fetch of `t`: it and the rest of its group not taken yet, with their pages; or,
    /// for an offer this connection holds already (taken along by a hold), its pages alone.
    fn fetch(&mut self, i: usize, t: Token) -> Result<()> {
        if let Some(shared) = self.conns[i].held.get(&t).cloned() {
            return match shared.descriptors() {
                Ok(fds) => {
                    self.conns[i].sent.extend(shared.serials().iter().copied());
                    self.answer_pages(i, vec![(t, fds.len() as u32)], fds)
                }
                Err(e) => {
                    record_drop::<()>(Err(e));
                    self.queue(i, Frame::Refused(Refusal::Failed), Vec::new())
                }
            };
        }
        let (first, along) = {
            let mut s = lock(&self.inner.state);
            match s.take_with_group(&t) {
                Some(x) => x,
                None => {
                    let why = s.refusal(&t);
                    drop(s);
                    return self.queue(i, Frame::Refused(why), Vec::new());
                }
            }
        };
        // The descriptors are made without the state's lock: offers go on meanwhile.
        let fds = match first.shared.descriptors() {
            Ok(fds) => fds,
            Err(e) => {
                record_drop::<()>(Err(e));
                drop(first);
                self.let_go(1);
                for (m, u) in along {
                    lock(&self.inner.state).put_back(m, u);
                }
                return self.queue(i, Frame::Refused(Refusal::Failed), Vec::new());
            }
        };
        let mut entries = vec![(t, fds.len() as u32)];
        let mut all = fds;
        let c = &mut self.conns[i];
        c.sent.extend(first.shared.serials().iter().copied());
        c.held.insert(t, first.shared);
        for (m, u) in along {
            match u.shared.descriptors() {
                Ok(fds) => {
                    entries.push((m, fds.len() as u32));
                    all.extend(fds);
                    c.sent.extend(u.shared.serials().iter().copied());
                    c.held.insert(m, u.shared);
                }
                // Offered again: its own fetch meets the failure.
                Err(_) => lock(&self.inner.state).put_back(m, u),
            }
        }
        self.answer_pages(i, entries, all)
    }

    /// Sends an answer: the offers with their page counts, then their descriptors.
    fn answer_pages(&mut self, i: usize, entries: Vec<(Token, u32)>, fds: Vec<OwnedFd>) -> Result<()> {
        self.queue(i, Frame::Offered(entries), Vec::new())?;
        let mut rest = fds.into_iter().peekable();
        while rest.peek().is_some() {
            let part: Vec<OwnedFd> = rest.by_ref().take(FDS_PER_MESSAGE).collect();
            self.queue(i, Frame::Pages(part.len()), part)?;
        }
        Ok(())
    }

    /// Queues a message (and sends what it can now).
    fn queue(&mut self, i: usize, frame: Frame, fds: Vec<OwnedFd>) -> Result<()> {
        let c = &mut self.conns[i];
        if c.ended() {
            return Ok(()); // asked nothing more, told nothing more
        }
        if c.out.len() >= QUEUED_MOST {
            return Err(Error::Protocol(format!("the receiving process {} stopped reading", c.peer.pid)));
        }
        c.out.push_back((frame.encode()?, fds));
        self.flush(i);
        Ok(())
    }

    fn flush(&mut self, i: usize) {
        let c = &mut self.conns[i];
        while let (Some(sock), Some((bytes, fds))) = (&c.sock, c.out.front()) {
            let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
            match link::send(sock.as_fd(), bytes, &raw) {
                Ok(true) => {
                    c.out.pop_front(); // the kernel holds copies of its descriptors now
                }
                Ok(false) => return,
                Err(_) => c.end(),
            }
        }
    }

    /// Makes the page descriptors of offers just made, while their tickets travel: the
    /// allocator keeps each page's first export, so the fetch that follows only duplicates them.
    /// Pages already sent to a receiver have theirs.
    fn make_ahead(&mut self) {
        let fresh: Vec<Arc<dyn Shared>> = {
            let mut s = lock(&self.inner.state);
            let tokens = std::mem::take(&mut s.fresh);
            tokens.iter().filter_map(|t| s.offers.get(t).map(|u| u.shared.clone())).collect()
        };
        for shared in fresh {
            let known = shared.serials().iter().all(|p| self.conns.iter().any(|c| c.sent.contains(p)));
            if !known {
                // A failure is met again, and answered, by the fetch.
                drop(shared.descriptors());
            }
        }
    }

    /// Tells the receivers that mirror a device's pages where pages were mapped and unmapped, in
    /// the order it happened.
    fn place(&mut self) {
        let events = std::mem::take(&mut lock(&self.inner.state).placements);
        if events.is_empty() {
            return;
        }
        let mut batches: Vec<Vec<Batch>> = (0..self.conns.len()).map(|_| Vec::new()).collect();
        for e in events {
            let device = match &e {
                Event::Placed { device, .. } | Event::Unplaced { device, .. } => *device,
            };
            let to: Vec<usize> = (0..self.conns.len())
                .filter(|&i| !self.conns[i].ended() && self.conns[i].mirror == Some(device))
                .collect();
            match e {
                Event::Placed { serial, addr, size, fd, .. } => {
                    let p = Placement { serial, addr, size };
                    // Duplicates of the event's descriptor for all but the last connection, which
                    // is given the descriptor itself.
                    let Some((&last, rest)) = to.split_last() else { continue };
                    for &i in rest {
                        // Without a descriptor to spare the page is not placed there.
                        if let Ok(dup) = fd.try_clone() {
                            placed_in(&mut self.conns[i], &mut batches[i], p, dup);
                        }
                    }
                    placed_in(&mut self.conns[last], &mut batches[last], p, fd);
                }
                Event::Unplaced { addr, .. } => {
                    for i in to {
                        if self.conns[i].placed.remove(&addr).is_none() {
                            continue;
                        }
                        match batches[i].last_mut() {
                            Some(Batch::Unplaced(a)) if a.len() < SERIALS_PER_MESSAGE => a.push(addr),
                            _ => batches[i].push(Batch::Unplaced(vec![addr])),
                        }
                    }
                }
            }
        }
        for (i, out) in batches.into_iter().enumerate() {
            for b in out {
                let sent = match b {
                    Batch::Placed(ps, fds) => self.queue(i, Frame::Placed(ps), fds),
                    Batch::Unplaced(a) => self.queue(i, Frame::Unplaced(a), Vec::new()),
                };
                if sent.is_err() {
                    self.conns[i].end();
                    break;
                }
            }
        }
    }

    /// Asks each receiver that was given pages now released here to unmap them.
    fn revoke(&mut self) {
        let released = std::mem::take(&mut lock(&self.inner.state).released);
        if released.is_empty() {
            return;
        }
        let mut sent = 0u64;
        for i in 0..self.conns.len() {
            let c = &mut self.conns[i];
            if c.ended() {
                continue;
            }
            let hit: Vec<u64> = released.iter().copied().filter(|s| c.sent.remove(s)).collect();
            for part in hit.chunks(SERIALS_PER_MESSAGE) {
                sent += part.len() as u64;
                if self.queue(i, Frame::Revoke(part.to_vec()), Vec::new()).is_err() {
                    self.conns[i].end();
                    break;
                }
            }
        }
        lock(&self.inner.state).stats.revocations += sent;
    }

    fn next_expiry(&self) -> Option<Duration> {
        let s = lock(&self.inner.state);
        let ttl = s.ttl?;
        let oldest = s.offers.values().map(|u| u.made).min()?;
        Some((oldest + ttl).saturating_duration_since(Instant::now()))
    }

    /// Lets go of offers nobody took within their time to live.
    fn expire(&mut self) {
        let gone: Vec<Untaken> = {
            let mut s = lock(&self.inner.state);
            let Some(ttl) = s.ttl else { return };
            let now = Instant::now();
            let old: Vec<Token> =
                s.offers.iter().filter(|(_, u)| now >= u.made + ttl).map(|(t, _)| *t).collect();
            let gone: Vec<Untaken> = old.iter().filter_map(|t| s.take(t)).collect();
            for t in old {
                s.forget(t);
            }
            s.stats.held -= gone.len();
            s.stats.expired += gone.len() as u64;
            gone
        };
        drop(gone); // let go without the lock
    }
}
