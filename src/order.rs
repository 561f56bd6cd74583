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
//! [`DeviceSlice::from_raw_parts`]: crate::DeviceSlice::from_raw_parts

use crate::driver::{driver, sys::CU_EVENT_DISABLE_TIMING};
use crate::error::Result;
use crate::event::Event;
use crate::stream::{Stream, StreamInner};
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

/// What one stream did to the memory since the record was last cleared.
struct Entry {
    stream: Arc<StreamInner>,
    read: Option<Span>,
    write: Option<Span>,
    /// Recorded on `stream` after every access above when `recorded` is true.
    event: Option<Event>,
    recorded: bool,
}

/// Whether an `access` to `span` must wait for a stream that read `read` and wrote `write`.
fn conflicts(read: Option<Span>, write: Option<Span>, span: Span, access: Use) -> bool {
    overlaps(write, span) || (access == Use::Write && overlaps(read, span))
}

impl Entry {
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

    /// Blocks until everything this stream did so far has finished.
    fn wait_on_host(&self) -> Result<()> {
        self.stream.ctx.bind()?;
        match (&self.event, self.recorded) {
            (Some(e), true) => e.synchronize(),
            // SAFETY: the stream is alive while the entry holds it.
            _ => unsafe { driver()?.api().cuStreamSynchronize(self.stream.raw) },
        }
    }
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    /// Events of removed entries, for reuse.
    spare: Vec<Event>,
}

impl State {
    /// Makes sure entry `i`'s event marks the current end of its stream's queue.
    fn record(&mut self, i: usize) -> Result<()> {
        if self.entries[i].recorded {
            return Ok(());
        }
        let ctx = self.entries[i].stream.ctx.clone();
        if self.entries[i].event.is_none() {
            let event = match self.spare.iter().position(|e| e.context().same_as(&ctx)) {
                Some(j) => self.spare.swap_remove(j),
                None => Event::create(&ctx, CU_EVENT_DISABLE_TIMING)?,
            };
            self.entries[i].event = Some(event);
        }
        let e = &mut self.entries[i];
        let event = e.event.as_ref().expect("created above");
        event.record_on(&e.stream)?;
        e.recorded = true;
        Ok(())
    }

    fn remove(&mut self, i: usize) -> Entry {
        let mut e = self.entries.swap_remove(i);
        if let Some(ev) = e.event.take() {
            self.spare.push(ev);
        }
        e
    }
}

/// The record of which streams used one allocation (see the module documentation).
#[derive(Default)]
pub struct Tracker {
    state: Mutex<State>,
}

impl Tracker {
    /// An empty record.
    pub fn new() -> Tracker {
        Tracker::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes `stream` wait for the earlier uses on other streams that conflict with `access` to
    /// `[start, end)`, then records the use. Call it just before queuing the operation.
    pub(crate) fn device_access(&self, stream: &Stream, start: u64, end: u64, access: Use) -> Result<()> {
        if start >= end {
            return Ok(());
        }
        let span = (start, end);
        let me = stream.inner();
        let mut st = self.lock();
        let mut waited = Vec::new();
        for i in 0..st.entries.len() {
            let e = &st.entries[i];
            if e.stream.id == me.id || !e.conflicts(span, access) {
                continue;
            }
            st.record(i)?;
            let event = st.entries[i].event.as_ref().expect("recorded");
            me.ctx.bind()?;
            // SAFETY: both handles are alive (the entry holds its stream and event); flags are 0.
            // Waiting on an event of another context is allowed.
            unsafe { driver()?.api().cuStreamWaitEvent(me.raw, event.raw(), 0) }?;
            waited.push(i);
        }
        // Every wait was queued: this stream now stands after the streams it waited for, and takes
        // over their ranges. Remove from the back so indices stay valid.
        let (mut read, mut write) = (None, None);
        for &i in waited.iter().rev() {
            let e = st.remove(i);
            read = union(read, e.read);
            write = union(write, e.write);
        }
        let mine = match st.entries.iter().position(|e| e.stream.id == me.id) {
            Some(i) => i,
            None => {
                st.entries.push(Entry {
                    stream: Arc::clone(me),
                    read: None,
                    write: None,
                    event: None,
                    recorded: false,
                });
                st.entries.len() - 1
            }
        };
        let e = &mut st.entries[mine];
        e.read = union(e.read, read);
        e.write = union(e.write, write);
        e.add(span, access);
        Ok(())
    }

    /// Blocks until the uses on any stream that conflict with a host-synchronous `access` to
    /// `[start, end)` have finished, and forgets them. Call it before a synchronous copy.
    pub(crate) fn host_access(&self, start: u64, end: u64, access: Use) -> Result<()> {
        if start >= end {
            return Ok(());
        }
        let mut st = self.lock();
        let mut i = 0;
        while i < st.entries.len() {
            if st.entries[i].conflicts((start, end), access) {
                st.entries[i].wait_on_host()?;
                st.remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
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
pub(crate) struct Pending(Vec<Entry>);

impl Pending {
    /// Blocks until every recorded use has finished (errors are ignored: this runs in destructors,
    /// which then wait for the whole context as well).
    pub(crate) fn wait(self) {
        for e in &self.0 {
            let _ = e.wait_on_host();
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
}
