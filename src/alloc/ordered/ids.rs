//! The numbers the stream-ordered allocator must never mix up, each a type of its own: a
//! stream's identity, the handle a call passes for it, the pair of them a call carries, the
//! numbers of a stream's events that stamp its frees, and a heap's place among the core's
//! heaps. An identity passed where a handle is wanted, the two swapped, or a stamp or a heap
//! passed for either, does not compile. Each is an integer underneath (`#[repr(transparent)]`),
//! hashed and compared as that integer is.

use std::fmt;

/// A stream's identity: the driver's stream id (unique for the life of the process), or one the
/// allocator made up, from [`SYNTHETIC`] up. Everything the allocator remembers about a stream is
/// keyed by it, never by a [`Handle`].
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct StreamId(pub(crate) u64);

/// Stream identities from this number up are the allocator's own, never the driver's: the legacy
/// default stream's, and those made up for a stream the driver could not name.
pub(crate) const SYNTHETIC: StreamId = StreamId(1 << 62);

/// The identity of the legacy default stream (the null handle and `CU_STREAM_LEGACY`), which is
/// never destroyed.
pub(crate) const LEGACY: StreamId = SYNTHETIC;

/// The owner key of a heap's blocks any stream may take (the work that used them has completed):
/// an identity no stream has.
pub(crate) const IDLE: StreamId = StreamId(u64::MAX);

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            IDLE => write!(f, "StreamId(idle)"),
            LEGACY => write!(f, "StreamId(legacy)"),
            StreamId(n) if n > LEGACY.0 => write!(f, "StreamId(made up #{})", n - LEGACY.0),
            StreamId(n) => write!(f, "StreamId({n})"),
        }
    }
}

/// The handle a call passes for its stream (a `CUstream`; the null handle and `CU_STREAM_LEGACY`
/// are one). It names the stream for that call only: once the stream is destroyed the driver may
/// hand the same handle to a new stream, so a handle remembered past its call is only compared,
/// never passed to the driver.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Handle(pub(crate) u64);

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Handle({:#x})", self.0)
    }
}

/// The stream a call passes: an identity no other stream ever has, which keys everything the
/// allocator remembers about the stream, and the handle, which the allocator passes to the
/// driver during this call only. A handle remembered past its call could name a destroyed
/// stream, or a new stream the driver handed the same handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Caller {
    pub id: StreamId,
    pub raw: Handle,
}

/// In the model tests a stream numbered `s` has handle `s` unless a test says otherwise.
#[cfg(test)]
impl From<u64> for Caller {
    fn from(s: u64) -> Caller {
        Caller { id: StreamId(s), raw: Handle(s) }
    }
}

/// A number in one stream's sequence of events (a front's `next`, from [`Epoch::FIRST`] up). A
/// free stamped `e` happened before the event numbered `e` was recorded on its stream (or before
/// the stream was found idle, or a wait for the whole device began, under that number): once
/// that event has completed, the work queued on the stream before the free has run, and so have
/// the frees of every lower number. [`Epoch::NONE`] stands for no free, or no event completed.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Epoch(pub(crate) u64);

impl Epoch {
    pub(crate) const NONE: Epoch = Epoch(0);
    /// A stream's first event number.
    pub(crate) const FIRST: Epoch = Epoch(1);

    /// Takes this number for an event (or a wait) and moves on to the next one; returns the one
    /// taken.
    pub(crate) fn take(&mut self) -> Epoch {
        let n = *self;
        self.0 += 1;
        n
    }
}

impl fmt::Debug for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Epoch::NONE => write!(f, "Epoch(none)"),
            Epoch(n) => write!(f, "Epoch({n})"),
        }
    }
}

/// A heap's place in the core's table of heaps, which only grows: the same heap for as long as
/// the allocator lives. A `u32`, so that a stream front's entry for each block stays small; the
/// core refuses a heap past `u32::MAX` of them (see [`SlotId::of`]).
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SlotId(u32);

impl SlotId {
    /// The most heaps a core holds.
    pub(crate) const MAX: usize = u32::MAX as usize;

    /// The slot at `i` in the core's table, which holds at most [`SlotId::MAX`] heaps.
    pub(crate) fn of(i: usize) -> SlotId {
        debug_assert!(i < Self::MAX, "the core holds at most SlotId::MAX heaps");
        SlotId(i as u32)
    }

    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Debug for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SlotId({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_number_says_what_it_is_when_printed() {
        assert_eq!(format!("{:?}", StreamId(7)), "StreamId(7)");
        assert_eq!(format!("{LEGACY:?}"), "StreamId(legacy)");
        assert_eq!(format!("{:?}", StreamId(LEGACY.0 + 3)), "StreamId(made up #3)");
        assert_eq!(format!("{IDLE:?}"), "StreamId(idle)");
        assert_eq!(format!("{:?}", Handle(0x7f00)), "Handle(0x7f00)");
        assert_eq!(format!("{:?}", (Epoch::NONE, Epoch(4))), "(Epoch(none), Epoch(4))");
        let mut next = Epoch::FIRST;
        assert_eq!((next.take(), next), (Epoch(1), Epoch(2)));
        assert_eq!(format!("{:?}", SlotId::of(3)), "SlotId(3)");
        assert_eq!(SlotId::of(3).index(), 3);
        assert_eq!(format!("{:?}", Caller::from(2)), "Caller { id: StreamId(2), raw: Handle(0x2) }");
    }
}
