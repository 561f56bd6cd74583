//! Device-side ordering of memory accesses across streams.
//!
//! Work queued on one stream runs in order; work on two streams does not. A kernel that writes a
//! buffer on stream A and a copy that reads it on stream B race unless B waits for A. cuvmm
//! inserts those waits itself: every allocation keeps a record of the streams that used it since
//! the last point where all of that use was known to be finished, and each operation that reaches
//! memory through a cuvmm view first makes its stream wait for the earlier conflicting uses on
//! other streams (a read waits for writes, a write for reads and writes), then adds itself to the
//! record. Synchronous copies wait on the host for the conflicting streams instead.
//!
//! The record is kept per stream, with the range of addresses it read and the range it wrote
//! (each as one covering interval), so streams that work on disjoint parts of one allocation (a
//! pipeline over chunks) never wait for each other. No event is recorded while a stream is the
//! only user: only when another stream needs to wait is an event recorded on the earlier stream,
//! at the end of its queue, which covers all of that stream's uses. Work on a single stream
//! therefore costs one uncontended lock per operation and no driver call.
//!
//! When stream B waits for stream A, B takes over A's ranges: whoever later conflicts with them
//! waits for B, which is after A. Views made with [`DeviceSlice::from_raw_parts`] carry no record;
//! their users order their streams themselves.
//!
//! Your own kernels take part through [`DeviceSlice::prepare_read`] and
//! [`DeviceSliceMut::prepare_write`], called on the views just before the launch; each returns a
//! [`Turn`] to keep until the launch is queued (another thread's operation on the same memory
//! waits for it meanwhile). A launch over several allocations from several threads should prepare
//! them in one order, as with locks:
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::module::{LaunchConfig, Module};
//! use cuvmm::{Context, Stream, VmmVec};
//! # let ptx = "";
//! let ctx = Context::for_ordinal(0)?;
//! let a = Stream::non_blocking(&ctx)?;
//! let module = Module::from_ptx(&ctx, ptx)?;
//! let scale = module.function("scale")?;
//! let mut v = VmmVec::<f32>::new(&ctx)?;
//! v.resize(1 << 20, 1.0)?;
//! let mut view = v.as_mut_slice();
//! let turn = view.prepare_write(&a)?; // `a` now waits for earlier uses of `v` on other streams
//! let (mut p, mut n) = (view.ptr(), view.len() as u64);
//! let mut params = [(&mut p as *mut u64).cast(), (&mut n as *mut u64).cast()];
//! // SAFETY: `scale(float *p, uint64_t n)` stays within the n elements it is given.
//! unsafe { scale.launch(LaunchConfig::grid_stride(n, 256, 1024), &a, &mut params)? };
//! drop(turn); // queued: the record may be read by other threads again
//! // A synchronous copy waits for the kernel on `a` by itself.
//! let host = v.to_vec()?;
//! # let _ = host;
//! # Ok(()) }
//! ```
//!
//! [`DeviceSlice::from_raw_parts`]: crate::DeviceSlice::from_raw_parts
//! [`DeviceSlice::prepare_read`]: crate::DeviceSlice::prepare_read
//! [`DeviceSliceMut::prepare_write`]: crate::DeviceSliceMut::prepare_write

use crate::driver::{driver, result, sys::CU_EVENT_DISABLE_TIMING};
use crate::error::Result;
use crate::stream::Event;
use crate::stream::{Stream, StreamInner};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// How an operation uses memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// It only reads.
    Read,
    /// It writes (and may read).
    Write,
}

/// A half-open address interval `[start, end)`.
type Span = (u64, u64);

fn overlaps(a: Option<Span>, b: Span) -> bool {
    a.is_some_and(|a| a.0 < b.1 && b.0 < a.1)
}

fn union(a: Option<Span>, b: Option<Span>) -> Option<Span> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a.0.min(b.0), a.1.max(b.1))),
        (a, None) => a,
        (None, b) => b,
    }
}

/// Whether an `access` to `span` must wait for a stream that read `read` and wrote `write`.
fn conflicts(read: Option<Span>, write: Option<Span>, span: Span, access: Use) -> bool {
    overlaps(write, span) || (access == Use::Write && overlaps(read, span))
}

/// What one stream did to the memory since the record was last cleared. `S` is the stream,
/// `E` an event (the driver's in the crate, simulated ones in the model test).
struct Entry<S, E> {
    stream: S,
    read: Option<Span>,
    write: Option<Span>,
    /// Recorded on `stream` after every access above when `recorded` is true.
    event: Option<E>,
    recorded: bool,
}

impl<S, E> Entry<S, E> {
    fn conflicts(&self, span: Span, access: Use) -> bool {
        conflicts(self.read, self.write, span, access)
    }

    fn add(&mut self, span: Span, access: Use) {
        match access {
            Use::Read => self.read = union(self.read, Some(span)),
            Use::Write => self.write = union(self.write, Some(span)),
        }
        self.recorded = false;
    }
}

/// The driver operations the record needs.
trait Effects<S, E> {
    /// A number naming the stream for the life of the process.
    fn id(&self, stream: &S) -> u64;
    /// An event usable on `stream`, taken from `spare` where one fits.
    fn event_for(&mut self, stream: &S, spare: &mut Vec<E>) -> Result<E>;
    /// Records `event` at the current end of `stream`'s queue.
    fn record(&mut self, event: &E, stream: &S) -> Result<()>;
    /// Makes work queued on `stream` from now on wait for `event`.
    fn wait(&mut self, stream: &S, event: &E) -> Result<()>;
    /// Blocks until `stream`'s queue (up to `event`, when it is recorded at its end) is done.
    fn wait_on_host(&mut self, stream: &S, recorded: Option<&E>) -> Result<()>;
    /// Whether that work is done already, without blocking.
    fn is_done(&mut self, stream: &S, recorded: Option<&E>) -> Result<bool>;
}

/// Past this many streams in a record, streams that only read and are done are dropped from it:
/// reads never make each other wait, so without this a record read by many short-lived streams
/// would keep them all (and their `CUstream`s) until the next write.
const PRUNE_ABOVE: usize = 8;

struct State<S, E> {
    entries: Vec<Entry<S, E>>,
    /// Events of removed entries, for reuse.
    spare: Vec<E>,
}

impl<S, E> Default for State<S, E> {
    fn default() -> Self {
        State { entries: Vec::new(), spare: Vec::new() }
    }
}

impl<S: Clone, E> State<S, E> {
    /// Makes sure entry `i`'s event marks the current end of its stream's queue.
    fn record(&mut self, fx: &mut impl Effects<S, E>, i: usize) -> Result<()> {
        if self.entries[i].recorded {
            return Ok(());
        }
        if self.entries[i].event.is_none() {
            let event = fx.event_for(&self.entries[i].stream, &mut self.spare)?;
            self.entries[i].event = Some(event);
        }
        let e = &mut self.entries[i];
        fx.record(e.event.as_ref().expect("created above"), &e.stream)?;
        e.recorded = true;
        Ok(())
    }

    fn remove(&mut self, i: usize) -> Entry<S, E> {
        let mut e = self.entries.swap_remove(i);
        if let Some(ev) = e.event.take() {
            self.spare.push(ev);
        }
        e
    }

    fn device_access(&mut self, fx: &mut impl Effects<S, E>, me: &S, span: Span, access: Use) -> Result<()> {
        let my_id = fx.id(me);
        let mut waited = Vec::new();
        for i in 0..self.entries.len() {
            let e = &self.entries[i];
            if fx.id(&e.stream) == my_id || !e.conflicts(span, access) {
                continue;
            }
            self.record(fx, i)?;
            fx.wait(me, self.entries[i].event.as_ref().expect("recorded"))?;
            waited.push(i);
        }
        // Every wait was queued: this stream now stands after the streams it waited for, and takes
        // over their ranges. Remove from the back so indices stay valid.
        let (mut read, mut write) = (None, None);
        for &i in waited.iter().rev() {
            let e = self.remove(i);
            read = union(read, e.read);
            write = union(write, e.write);
        }
        let mine = match self.entries.iter().position(|e| fx.id(&e.stream) == my_id) {
            Some(i) => i,
            None => {
                let fresh =
                    Entry { stream: me.clone(), read: None, write: None, event: None, recorded: false };
                self.entries.push(fresh);
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[mine];
        e.read = union(e.read, read);
        e.write = union(e.write, write);
        e.add(span, access);
        if self.entries.len() > PRUNE_ABOVE {
            let mut i = 0;
            while i < self.entries.len() {
                let e = &self.entries[i];
                let idle = fx.id(&e.stream) != my_id
                    && e.write.is_none()
                    && fx.is_done(&e.stream, e.event.as_ref().filter(|_| e.recorded))?;
                if idle {
                    self.remove(i);
                } else {
                    i += 1;
                }
            }
        }
        Ok(())
    }

    /// Puts back entries taken out whose work was not seen done, merged into any entry their
    /// stream has gained meanwhile (which then records afresh: it covers both).
    fn give_back(&mut self, fx: &impl Effects<S, E>, back: impl Iterator<Item = Entry<S, E>>) {
        for mut e in back {
            match self.entries.iter().position(|x| fx.id(&x.stream) == fx.id(&e.stream)) {
                Some(i) => {
                    let x = &mut self.entries[i];
                    x.read = union(x.read, e.read);
                    x.write = union(x.write, e.write);
                    x.recorded = false;
                    if let Some(ev) = e.event.take() {
                        self.spare.push(ev);
                    }
                }
                None => self.entries.push(e),
            }
        }
    }

    /// Takes out the entries a host-synchronous `access` to `span` must wait for; the caller waits
    /// for them (outside any lock: see [`Tracker::host_access`]).
    fn take_conflicting(&mut self, span: Span, access: Use) -> Vec<Entry<S, E>> {
        let mut taken = Vec::new();
        let mut i = 0;
        while i < self.entries.len() {
            if self.entries[i].conflicts(span, access) {
                taken.push(self.entries.swap_remove(i));
            } else {
                i += 1;
            }
        }
        taken
    }
}

/// Blocks until the work of every entry in `taken` is done.
fn wait_all<S, E>(fx: &mut impl Effects<S, E>, taken: &[Entry<S, E>]) -> Result<()> {
    for e in taken {
        fx.wait_on_host(&e.stream, e.event.as_ref().filter(|_| e.recorded))?;
    }
    Ok(())
}

/// Waits for `taken`'s work as [`wait_all`] does; when a wait fails, the entries not seen done
/// (that one and those after it) go back into `state`, so that later accesses still wait for
/// them. `state` is locked only to give them back.
fn wait_or_give_back<S: Clone, E>(
    fx: &mut impl Effects<S, E>,
    state: &Mutex<State<S, E>>,
    taken: Vec<Entry<S, E>>,
) -> Result<()> {
    let mut rest = taken.into_iter();
    while let Some(e) = rest.next() {
        if let Err(err) = fx.wait_on_host(&e.stream, e.event.as_ref().filter(|_| e.recorded)) {
            let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
            st.give_back(fx, std::iter::once(e).chain(rest));
            return Err(err);
        }
    }
    Ok(())
}

/// The driver itself.
struct Cuda;

impl Effects<Arc<StreamInner>, Event> for Cuda {
    fn id(&self, stream: &Arc<StreamInner>) -> u64 {
        stream.id
    }

    fn event_for(&mut self, stream: &Arc<StreamInner>, spare: &mut Vec<Event>) -> Result<Event> {
        match spare.iter().position(|e| e.context().same_as(&stream.ctx)) {
            Some(j) => Ok(spare.swap_remove(j)),
            None => Event::create(&stream.ctx, CU_EVENT_DISABLE_TIMING),
        }
    }

    fn record(&mut self, event: &Event, stream: &Arc<StreamInner>) -> Result<()> {
        event.record_on(stream)
    }

    fn wait(&mut self, stream: &Arc<StreamInner>, event: &Event) -> Result<()> {
        stream.ctx.bind()?;
        // SAFETY: both handles are alive (the record holds its streams and events). Waiting on an
        // event of another context is allowed.
        unsafe { result::stream::wait_event(driver()?.api(), stream.raw, event.raw()) }
    }

    fn wait_on_host(&mut self, stream: &Arc<StreamInner>, recorded: Option<&Event>) -> Result<()> {
        stream.ctx.bind()?;
        match recorded {
            Some(e) => e.synchronize(),
            // SAFETY: the stream is alive while the record holds it.
            None => unsafe { result::stream::synchronize(driver()?.api(), stream.raw) },
        }
    }

    fn is_done(&mut self, stream: &Arc<StreamInner>, recorded: Option<&Event>) -> Result<bool> {
        stream.ctx.bind()?;
        match recorded {
            Some(e) => e.is_complete(),
            // SAFETY: the stream is alive while the record holds it.
            None => unsafe { result::stream::query(driver()?.api(), stream.raw) },
        }
    }
}

/// The record of which streams used one allocation (see the module documentation).
#[derive(Default)]
pub struct Tracker {
    state: Mutex<State<Arc<StreamInner>, Event>>,
    turn: TurnLock,
}

/// Which thread holds a record's turn, and how deeply. Taking and giving back an uncontended turn
/// costs a few atomic operations; only a thread that has to wait touches the mutex and condition
/// variable.
#[derive(Default)]
struct TurnLock {
    /// The holder's [`thread_number`], 0 for none.
    holder: AtomicU64,
    /// How many turns the holder took; only the holder changes it.
    depth: AtomicUsize,
    waiters: AtomicUsize,
    gate: Mutex<()>,
    free: std::sync::Condvar,
}

/// A number for the calling thread, never 0 (cheaper than `std::thread::current().id()`).
fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    NUMBER.with(|n| {
        if n.get() == 0 {
            n.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        n.get()
    })
}

impl TurnLock {
    fn take(&self) {
        let me = thread_number();
        if self.holder.load(Ordering::Acquire) == me {
            self.depth.fetch_add(1, Ordering::Relaxed);
            return;
        }
        loop {
            if self.holder.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                self.depth.store(1, Ordering::Relaxed);
                return;
            }
            // Announce the wait before looking again, so a release either sees the waiter or
            // is seen by it.
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
            while self.holder.load(Ordering::SeqCst) != 0 {
                gate = self.free.wait(gate).unwrap_or_else(|e| e.into_inner());
            }
            drop(gate);
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn give_back(&self) {
        if self.depth.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.holder.store(0, Ordering::SeqCst);
            if self.waiters.load(Ordering::SeqCst) > 0 {
                let _gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
                self.free.notify_all();
            }
        }
    }
}

/// A thread's turn at one allocation's record, from ordering an operation until it is queued.
///
/// The record lists an operation before the operation reaches its stream; another thread that read
/// the record in between would record an event that misses it. So each thread that orders an
/// operation holds the turn until the operation is queued, and other threads' operations on the
/// same memory wait for it. The turn is per thread and nests: one operation may order several
/// views of one allocation. Operations on several allocations take their turns in address order
/// (by address), so two threads never wait for each other.
///
/// A turn stays on the thread that took it:
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<cuvmm::stream::order::Turn<'static>>();
/// ```
#[must_use = "hold the turn until the operation it ordered is queued"]
pub struct Turn<'a> {
    tracker: Option<&'a Tracker>,
    /// Not `Send`: the turn belongs to the thread that took it (a thread nests its own turns
    /// without waiting), so a turn moved to another thread would let the first one in beside it.
    _thread: PhantomData<*const ()>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.tracker {
            t.turn.give_back();
        }
    }
}

impl Turn<'_> {
    /// A turn at nothing: for views without a record.
    pub(crate) fn none() -> Turn<'static> {
        Turn { tracker: None, _thread: PhantomData }
    }
}

/// Takes the turns at every record in `trackers` in address order (each once), so that an
/// operation on several allocations cannot wait for a thread that waits for it.
pub(crate) fn turns<'a>(trackers: &[Option<&'a Tracker>]) -> Result<Vec<Turn<'a>>> {
    let mut ts: Vec<&Tracker> = trackers.iter().flatten().copied().collect();
    ts.sort_by_key(|t| *t as *const Tracker as usize);
    ts.dedup_by_key(|t| *t as *const Tracker as usize);
    ts.into_iter().map(Tracker::turn).collect()
}

impl Tracker {
    /// An empty record.
    pub fn new() -> Tracker {
        Tracker::default()
    }

    fn lock(&self) -> MutexGuard<'_, State<Arc<StreamInner>, Event>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until no other thread holds the turn, then takes (or, on this thread, deepens) it.
    /// Inside a host function it refuses: the thread holding the turn may be waiting for the very
    /// stream the host function holds.
    fn turn(&self) -> Result<Turn<'_>> {
        if crate::driver::callback::in_host_function() {
            return Err(crate::driver::callback::refuse("ordering device memory"));
        }
        self.turn.take();
        Ok(Turn { tracker: Some(self), _thread: PhantomData })
    }

    /// Makes `stream` wait for the earlier uses on other streams that conflict with `access` to
    /// `[start, end)`, then records the use. Hold the returned turn until the operation is queued.
    pub(crate) fn device_access(
        &self,
        stream: &Stream,
        start: u64,
        end: u64,
        access: Use,
    ) -> Result<Turn<'_>> {
        let turn = self.turn()?;
        if start < end {
            self.lock().device_access(&mut Cuda, stream.inner(), (start, end), access)?;
        }
        Ok(turn)
    }

    /// Blocks until the uses on any stream that conflict with a host-synchronous `access` to
    /// `[start, end)` have finished, and forgets them. Hold the returned turn until the
    /// synchronous operation is done.
    pub(crate) fn host_access(&self, start: u64, end: u64, access: Use) -> Result<Turn<'_>> {
        let turn = self.turn()?;
        if start < end {
            // Waited for outside the record's lock: a destructor running inside a host function
            // takes that lock, and may hold up the very stream being waited for. The turn keeps
            // other threads' operations on this memory out meanwhile.
            let taken = self.lock().take_conflicting((start, end), access);
            wait_or_give_back(&mut Cuda, &self.state, taken)?;
        }
        Ok(turn)
    }

    /// Takes the whole record, for an owner about to free its memory: see [`Pending::wait`].
    pub(crate) fn take(&self) -> Pending {
        Pending(std::mem::take(&mut self.lock().entries))
    }

    /// Forgets every use: for owners that just waited for all work on their memory by other means.
    pub(crate) fn clear(&self) {
        let mut st = self.lock();
        while !st.entries.is_empty() {
            st.remove(0);
        }
    }

    /// How many streams the record holds (for tests).
    pub fn streams(&self) -> usize {
        self.lock().entries.len()
    }
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("streams", &self.streams()).finish()
    }
}

/// The uses of memory that is about to be freed.
pub(crate) struct Pending(Vec<Entry<Arc<StreamInner>, Event>>);

impl Pending {
    /// The streams that used the memory.
    pub(crate) fn streams(&self) -> impl Iterator<Item = &Arc<StreamInner>> {
        self.0.iter().map(|e| &e.stream)
    }

    /// Blocks until every recorded use has finished (errors are ignored: this runs in destructors,
    /// which then wait for the whole context as well).
    pub(crate) fn wait(self) {
        for e in &self.0 {
            let _ = wait_all(&mut Cuda, std::slice::from_ref(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_follow_read_write_rules() {
        let reader = |span, access| conflicts(Some((0, 100)), None, span, access);
        assert!(!reader((50, 60), Use::Read), "reads never wait for reads");
        assert!(reader((50, 60), Use::Write), "a write waits for reads");
        assert!(!reader((100, 200), Use::Write), "disjoint ranges never wait");
        let writer = |span, access| conflicts(None, Some((10, 20)), span, access);
        assert!(writer((0, 11), Use::Read));
        assert!(writer((19, 30), Use::Write));
        assert!(!writer((20, 30), Use::Read), "half-open: 20 is outside");
        assert!(!writer((0, 10), Use::Write));
        assert_eq!(union(Some((5, 9)), Some((1, 3))), Some((1, 9)));
        assert_eq!(union(None, Some((1, 3))), Some((1, 3)));
        assert_eq!(union(None, None), None);
    }

    /// A model of streams and events with vector clocks: streams are 0..STREAMS, the host is
    /// STREAMS. Event `i` holds the clock its stream had when it was last recorded.
    struct Sim {
        clocks: Vec<Vec<u64>>,
        events: Vec<Vec<u64>>,
        driver_calls: usize,
        /// Makes the next `wait_on_host` fail, as a context in a sticky error does.
        fail_next_wait: bool,
    }

    fn sim() -> Sim {
        Sim {
            clocks: vec![vec![0; STREAMS + 1]; STREAMS + 1],
            events: Vec::new(),
            driver_calls: 0,
            fail_next_wait: false,
        }
    }

    const STREAMS: usize = 3;
    const HOST: usize = STREAMS;

    fn join(a: &mut [u64], b: &[u64]) {
        a.iter_mut().zip(b).for_each(|(x, y)| *x = (*x).max(*y));
    }

    impl Effects<usize, usize> for Sim {
        fn id(&self, stream: &usize) -> u64 {
            *stream as u64
        }
        fn event_for(&mut self, _stream: &usize, spare: &mut Vec<usize>) -> Result<usize> {
            Ok(spare.pop().unwrap_or_else(|| {
                self.events.push(vec![0; STREAMS + 1]);
                self.events.len() - 1
            }))
        }
        fn record(&mut self, event: &usize, stream: &usize) -> Result<()> {
            self.driver_calls += 1;
            self.events[*event] = self.clocks[*stream].clone();
            Ok(())
        }
        fn wait(&mut self, stream: &usize, event: &usize) -> Result<()> {
            self.driver_calls += 1;
            let e = self.events[*event].clone();
            join(&mut self.clocks[*stream], &e);
            Ok(())
        }
        fn is_done(&mut self, _stream: &usize, _recorded: Option<&usize>) -> Result<bool> {
            // The model knows no completion: nothing is pruned, every wait stays explicit.
            Ok(false)
        }
        fn wait_on_host(&mut self, stream: &usize, recorded: Option<&usize>) -> Result<()> {
            self.driver_calls += 1;
            if std::mem::take(&mut self.fail_next_wait) {
                return Err(crate::error::Error::invalid("the stream's context is in an error state"));
            }
            let c = match recorded {
                Some(e) => self.events[*e].clone(),
                None => self.clocks[*stream].clone(),
            };
            join(&mut self.clocks[HOST], &c);
            Ok(())
        }
    }

    /// Runs `ops` (who, start, len, write) through the record and the model; returns each op's
    /// clock at completion and the driver calls made.
    fn simulate(ops: &[(usize, u64, u64, bool)]) -> (Vec<Vec<u64>>, usize) {
        let mut sim = sim();
        let mut st = State::<usize, usize>::default();
        let mut stamps = Vec::new();
        for &(who, start, len, write) in ops {
            let (span, access) = ((start, start + len), if write { Use::Write } else { Use::Read });
            if who == HOST {
                let taken = st.take_conflicting(span, access);
                wait_all(&mut sim, &taken).unwrap();
            } else {
                // Work queued after a synchronous host operation runs after it.
                let host = sim.clocks[HOST].clone();
                join(&mut sim.clocks[who], &host);
                st.device_access(&mut sim, &who, span, access).unwrap();
            }
            sim.clocks[who][who] += 1;
            stamps.push(sim.clocks[who].clone());
        }
        (stamps, sim.driver_calls)
    }

    #[test]
    fn a_host_wait_that_fails_keeps_every_use_it_did_not_see_done() {
        let mut sim = sim();
        let state = Mutex::new(State::<usize, usize>::default());
        // Streams 0 and 1 write disjoint halves; a host read of both must wait for both.
        state.lock().unwrap().device_access(&mut sim, &0, (0, 10), Use::Write).unwrap();
        state.lock().unwrap().device_access(&mut sim, &1, (10, 20), Use::Write).unwrap();
        sim.clocks[0][0] += 1;
        sim.clocks[1][1] += 1;
        let taken = state.lock().unwrap().take_conflicting((0, 20), Use::Read);
        assert_eq!(taken.len(), 2);
        sim.fail_next_wait = true;
        assert!(wait_or_give_back(&mut sim, &state, taken).is_err());
        // Neither was seen done: both are still recorded, and the next host access waits for both.
        assert_eq!(state.lock().unwrap().entries.len(), 2);
        let taken = state.lock().unwrap().take_conflicting((0, 20), Use::Read);
        wait_or_give_back(&mut sim, &state, taken).unwrap();
        assert!(sim.clocks[HOST][0] >= 1 && sim.clocks[HOST][1] >= 1, "{:?}", sim.clocks[HOST]);
        assert!(state.lock().unwrap().entries.is_empty());
    }

    #[test]
    fn entries_given_back_merge_into_their_streams_later_use() {
        let mut sim = sim();
        let state = Mutex::new(State::<usize, usize>::default());
        state.lock().unwrap().device_access(&mut sim, &0, (0, 10), Use::Write).unwrap();
        let taken = state.lock().unwrap().take_conflicting((0, 10), Use::Read);
        // Meanwhile stream 0 was used again elsewhere.
        state.lock().unwrap().device_access(&mut sim, &0, (50, 60), Use::Read).unwrap();
        sim.fail_next_wait = true;
        assert!(wait_or_give_back(&mut sim, &state, taken).is_err());
        let st = state.lock().unwrap();
        assert_eq!(st.entries.len(), 1);
        assert_eq!((st.entries[0].write, st.entries[0].read), (Some((0, 10)), Some((50, 60))));
        assert!(!st.entries[0].recorded);
    }

    proptest::proptest! {
        #[test]
        fn every_conflicting_pair_of_uses_is_ordered(
            ops in proptest::collection::vec((0..=STREAMS, 0u64..16, 1u64..6, proptest::bool::ANY), 1..40)
        ) {
            let (stamps, _) = simulate(&ops);
            for j in 0..ops.len() {
                for i in 0..j {
                    let ((wi, si, li, xi), (wj, sj, lj, xj)) = (ops[i], ops[j]);
                    let overlap = si < sj + lj && sj < si + li;
                    if wi == wj || !overlap || !(xi || xj) {
                        continue;
                    }
                    // Op i happened before op j: j's clock has seen i's step on i's queue.
                    proptest::prop_assert!(
                        stamps[j][wi] >= stamps[i][wi],
                        "op {i} {:?} and op {j} {:?} race", ops[i], ops[j]
                    );
                }
            }
        }
    }

    #[test]
    fn a_turn_keeps_other_threads_out_until_it_is_dropped_and_nests_on_its_own_thread() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let t = Tracker::new();
        let taken = AtomicBool::new(false);
        let first = t.turn().unwrap();
        let nested = t.turn().unwrap(); // the same thread again: no wait
        std::thread::scope(|s| {
            let other = s.spawn(|| {
                let _turn = t.turn().unwrap();
                taken.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!taken.load(Ordering::SeqCst), "another thread took the turn while it was held");
            drop(nested);
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(!taken.load(Ordering::SeqCst), "the outer turn still holds it");
            drop(first);
            other.join().unwrap();
        });
        assert!(taken.load(Ordering::SeqCst));
        // Several records are taken in address order, each once.
        let u = Tracker::new();
        assert_eq!(turns(&[Some(&u), None, Some(&t), Some(&u)]).unwrap().len(), 2);
        // Inside a host function the turn is refused rather than waited for.
        let _g = crate::driver::callback::HostFnGuard::enter();
        assert!(matches!(t.turn(), Err(crate::Error::InHostFunction { .. })));
    }

    #[test]
    fn turns_exclude_each_other_under_contention() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let t = Tracker::new();
        let inside = AtomicBool::new(false);
        let rounds = if cfg!(miri) { 20 } else { 2000 };
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..rounds {
                        let _turn = t.turn().unwrap();
                        assert!(!inside.swap(true, Ordering::SeqCst), "two threads held the turn");
                        std::thread::yield_now();
                        inside.store(false, Ordering::SeqCst);
                    }
                });
            }
        });
    }

    #[test]
    fn one_stream_alone_makes_no_driver_call_and_disjoint_streams_none_either() {
        let one: Vec<_> = (0..50).map(|i| (0, i % 16, 3, i % 3 == 0)).collect();
        assert_eq!(simulate(&one).1, 0);
        // Three streams, each on its own part of the memory, writing and reading it.
        let disjoint: Vec<_> = (0..60).map(|i| (i % 3, (i % 3) as u64 * 5, 5, i % 2 == 0)).collect();
        assert_eq!(simulate(&disjoint).1, 0);
        // Two streams writing the same range take turns: one record and one wait each time.
        let pingpong: Vec<_> = (0..10).map(|i| (i % 2, 0, 4, true)).collect();
        assert_eq!(simulate(&pingpong).1, 2 * 9);
    }
}
