//! What an importer of a growing region checks each message against: the region's layout as the
//! messages so far describe it. Pure code, no driver: [`GrowableImport`](super::GrowableImport)
//! applies what it allows, and the fuzz targets and a peer's own importer can use it alone.

use super::wire::{Grow, Message, Region};
use crate::error::{Error, Result};

/// What a message asks of the importer, once [`RegionLayout::check`] has allowed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Reserve `capacity` bytes of address space for the region (the connection's first message).
    Open(Region),
    /// Import the chunk and map it, whole, at its offset: the end of what is mapped.
    Map(Grow),
    /// Unmap every chunk from the `keep`th on: the region keeps `length` bytes.
    Unmap {
        /// Chunks that stay mapped, the first ones.
        keep: usize,
        /// Bytes that stay mapped: where chunk `keep` started, or the end of the region.
        length: u64,
    },
    /// Nothing to map: the sender's note, received after everything sent before it.
    Note(u64),
}

/// A growing region as the messages on one connection have laid it out: its capacity, and the
/// chunks mapped, each starting where the one before it ended, from offset 0.
///
/// [`check`](Self::check) says whether a message fits, and what it asks for, without changing
/// anything; [`apply`](Self::apply) checks again and records it. An importer checks, does what the
/// step asks (importing and mapping a chunk may fail), and applies only once that has worked, so
/// the layout always says what is really mapped. The rules, which `docs/WIRE.md` lists too:
///
/// * the first message is a region, and there is only one; a share never comes on such a
///   connection;
/// * the region's capacity is at most the importer's own limit and a multiple of the importer's
///   granularity;
/// * a chunk has the region's handle type, granularity and device UUID, starts exactly where the
///   mapped part ends (no gap, no overlap), ends within the capacity, and its size is a multiple of
///   the importer's granularity;
/// * a shrink keeps at most what is mapped, and ends on a chunk boundary.
///
/// ```
/// use cuvmm::ipc::wire::{Grow, HandleType, Message, Region, WireHandle};
/// use cuvmm::ipc::{RegionLayout, Step};
/// const MIB: u64 = 1 << 20;
/// let mut layout = RegionLayout::new(1 << 30, 2 * MIB)?;
/// let region = Region::new(HandleType::PosixFd, 64 * MIB, 2 * MIB, [0; 16], 1)?;
/// layout.apply(&Message::Region(region))?;
/// let chunk = |offset| Grow::new(WireHandle::PosixFd, 4 * MIB, 2 * MIB, offset, [0; 16], 0);
/// layout.apply(&Message::Grow(chunk(0)?))?;
/// // A chunk over the one mapped, or leaving a gap after it, is refused.
/// assert!(layout.check(&Message::Grow(chunk(2 * MIB)?)).is_err());
/// assert!(layout.check(&Message::Grow(chunk(6 * MIB)?)).is_err());
/// assert_eq!(layout.apply(&Message::Grow(chunk(4 * MIB)?))?, Step::Map(chunk(4 * MIB)?));
/// assert_eq!(layout.mapped(), 8 * MIB);
/// // Shrinking keeps the first chunk.
/// assert_eq!(layout.apply(&Message::Shrink { length: 4 * MIB, tag: 0 })?, Step::Unmap { keep: 1, length: 4 * MIB });
/// # Ok::<(), cuvmm::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionLayout {
    max_capacity: u64,
    granularity: u64,
    region: Option<Region>,
    /// `(offset, size)` of each mapped chunk, in order; each starts where the previous ends.
    chunks: Vec<(u64, u64)>,
}

pub use crate::error::values::RegionRefusal;

fn refuse<T>(why: RegionRefusal) -> Result<T> {
    Err(Error::RegionRefused(why))
}

impl RegionLayout {
    /// A layout for a connection whose region may reserve at most `max_capacity` bytes, mapped
    /// by an importer whose allocation granularity is `granularity` (a power of two).
    pub fn new(max_capacity: u64, granularity: u64) -> Result<RegionLayout> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(Error::invalid(format!("granularity {granularity} is not a power of two")));
        }
        Ok(RegionLayout { max_capacity, granularity, region: None, chunks: Vec::new() })
    }

    /// The region, once its message has been applied.
    pub fn region(&self) -> Option<&Region> {
        self.region.as_ref()
    }

    /// Bytes mapped: where the last chunk ends.
    pub fn mapped(&self) -> u64 {
        self.chunks.last().map_or(0, |&(o, s)| o + s)
    }

    /// `(offset, size)` of each mapped chunk, in address order.
    pub fn chunks(&self) -> &[(u64, u64)] {
        &self.chunks
    }

    /// Whether `message` fits the layout, and what it asks for: an [`Error::RegionRefused`] names
    /// the rule it breaks. Changes nothing.
    pub fn check(&self, message: &Message) -> Result<Step> {
        let Some(region) = &self.region else {
            return match message {
                Message::Region(r) => self.check_region(r),
                m => refuse(RegionRefusal::BeforeRegion(m.kind())),
            };
        };
        match *message {
            Message::Region(_) => refuse(RegionRefusal::SecondRegion),
            Message::Share(_) => refuse(RegionRefusal::ShareInRegion),
            Message::Grow(g) => self.check_grow(region, g),
            Message::Shrink { length, .. } => self.check_shrink(length),
            Message::Note { tag } => Ok(Step::Note(tag)),
        }
    }

    fn check_region(&self, r: &Region) -> Result<Step> {
        if r.capacity() > self.max_capacity {
            return refuse(RegionRefusal::OverLimit { capacity: r.capacity(), limit: self.max_capacity });
        }
        if r.capacity() % self.granularity != 0 {
            return refuse(RegionRefusal::CapacityOffGranularity {
                capacity: r.capacity(),
                granularity: self.granularity,
            });
        }
        Ok(Step::Open(*r))
    }

    fn check_grow(&self, region: &Region, g: Grow) -> Result<Step> {
        if g.handle().handle_type() != region.handle_type() {
            return refuse(RegionRefusal::HandleType {
                chunk: g.handle().handle_type(),
                region: region.handle_type(),
            });
        }
        if g.granularity() != region.granularity() || g.device_uuid() != region.device_uuid() {
            return refuse(RegionRefusal::ChunkOfAnotherRegion);
        }
        let end = self.mapped();
        if g.offset() != end {
            return refuse(RegionRefusal::NotAtTheEnd { offset: g.offset(), end });
        }
        // `end()` cannot overflow: `Grow` bounds it by MAX_CAPACITY.
        if g.end() > region.capacity() {
            return refuse(RegionRefusal::PastTheRegion {
                offset: g.offset(),
                size: g.size(),
                capacity: region.capacity(),
            });
        }
        if g.size() % self.granularity != 0 {
            return refuse(RegionRefusal::SizeOffGranularity {
                size: g.size(),
                granularity: self.granularity,
            });
        }
        Ok(Step::Map(g))
    }

    fn check_shrink(&self, length: u64) -> Result<Step> {
        let end = self.mapped();
        if length == end {
            return Ok(Step::Unmap { keep: self.chunks.len(), length });
        }
        if length > end {
            return refuse(RegionRefusal::ShrinkPastTheEnd { length, end });
        }
        match self.chunks.binary_search_by_key(&length, |&(offset, _)| offset) {
            Ok(keep) => Ok(Step::Unmap { keep, length }),
            Err(_) => refuse(RegionRefusal::ShrinkInsideAChunk { length }),
        }
    }

    /// Checks `message` as [`check`](Self::check) does and records what it asks for as done.
    pub fn apply(&mut self, message: &Message) -> Result<Step> {
        let step = self.check(message)?;
        match step {
            Step::Open(r) => self.region = Some(r),
            Step::Map(g) => self.chunks.push((g.offset(), g.size())),
            Step::Unmap { keep, .. } => self.chunks.truncate(keep),
            Step::Note(_) => {}
        }
        Ok(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::wire::{HandleType, Kind, WireHandle};
    use RegionRefusal as R;

    const MIB: u64 = 1 << 20;
    const UUID: [u8; 16] = [3; 16];

    fn region(capacity: u64) -> Message {
        Message::Region(Region::new(HandleType::PosixFd, capacity, 2 * MIB, UUID, 1).unwrap())
    }

    fn chunk(offset: u64, size: u64) -> Message {
        Message::Grow(Grow::new(WireHandle::PosixFd, size, 2 * MIB, offset, UUID, 0).unwrap())
    }

    fn opened() -> RegionLayout {
        let mut l = RegionLayout::new(1 << 30, 2 * MIB).unwrap();
        l.apply(&region(64 * MIB)).unwrap();
        l
    }

    /// `m` is refused for `why`, by `check` and `apply` alike, and changes nothing.
    fn refused(l: &mut RegionLayout, m: &Message, why: RegionRefusal) {
        let before = l.clone();
        assert!(matches!(l.check(m), Err(Error::RegionRefused(w)) if w == why), "{m:?}: {:?}", l.check(m));
        assert!(matches!(l.apply(m), Err(Error::RegionRefused(w)) if w == why), "{m:?} was applied");
        assert_eq!(*l, before, "{m:?} changed the layout");
    }

    #[test]
    fn chunks_follow_each_other_and_shrinks_end_on_their_boundaries() {
        let mut l = opened();
        assert_eq!(l.region().unwrap().capacity(), 64 * MIB);
        for (offset, size) in [(0, 2 * MIB), (2 * MIB, 4 * MIB), (6 * MIB, 8 * MIB)] {
            assert!(matches!(l.apply(&chunk(offset, size)).unwrap(), Step::Map(g) if g.offset() == offset));
        }
        assert_eq!(l.mapped(), 14 * MIB);
        assert_eq!(l.chunks(), &[(0, 2 * MIB), (2 * MIB, 4 * MIB), (6 * MIB, 8 * MIB)]);
        assert_eq!(l.apply(&Message::Note { tag: 9 }).unwrap(), Step::Note(9));
        // A shrink to the end unmaps nothing; to a boundary, what follows it.
        let shrink = |length| Message::Shrink { length, tag: 0 };
        assert_eq!(l.apply(&shrink(14 * MIB)).unwrap(), Step::Unmap { keep: 3, length: 14 * MIB });
        assert_eq!(l.apply(&shrink(2 * MIB)).unwrap(), Step::Unmap { keep: 1, length: 2 * MIB });
        assert_eq!(l.chunks(), &[(0, 2 * MIB)]);
        // Growth resumes where the region now ends, with chunks of any size.
        l.apply(&chunk(2 * MIB, 62 * MIB)).unwrap();
        assert_eq!(l.mapped(), 64 * MIB, "a chunk may end at the capacity");
        assert_eq!(l.apply(&shrink(0)).unwrap(), Step::Unmap { keep: 0, length: 0 });
        assert_eq!((l.mapped(), l.chunks().len()), (0, 0));
        l.apply(&chunk(0, 64 * MIB)).unwrap();
    }

    #[test]
    fn forged_offsets_overlaps_gaps_and_sizes_are_refused_and_change_nothing() {
        let mut l = opened();
        l.apply(&chunk(0, 4 * MIB)).unwrap();
        l.apply(&chunk(4 * MIB, 4 * MIB)).unwrap();
        refused(&mut l, &chunk(0, 2 * MIB), R::NotAtTheEnd { offset: 0, end: 8 * MIB });
        refused(&mut l, &chunk(6 * MIB, 4 * MIB), R::NotAtTheEnd { offset: 6 * MIB, end: 8 * MIB });
        refused(&mut l, &chunk(10 * MIB, 2 * MIB), R::NotAtTheEnd { offset: 10 * MIB, end: 8 * MIB });
        refused(
            &mut l,
            &chunk(8 * MIB, 58 * MIB),
            R::PastTheRegion { offset: 8 * MIB, size: 58 * MIB, capacity: 64 * MIB },
        );
        refused(
            &mut l,
            &chunk(8 * MIB, (1 << 40) - 2 * MIB),
            R::PastTheRegion { offset: 8 * MIB, size: (1 << 40) - 2 * MIB, capacity: 64 * MIB },
        );
        let other = |g: Grow| Message::Grow(g);
        let base = Grow::new(WireHandle::PosixFd, 2 * MIB, 2 * MIB, 8 * MIB, UUID, 0).unwrap();
        refused(
            &mut l,
            &other(Grow::new(WireHandle::Fabric([1; 64]), 2 * MIB, 2 * MIB, 8 * MIB, UUID, 0).unwrap()),
            R::HandleType { chunk: HandleType::Fabric, region: HandleType::PosixFd },
        );
        refused(
            &mut l,
            &other(Grow::new(WireHandle::PosixFd, 4 * MIB, 4 * MIB, 8 * MIB, UUID, 0).unwrap()),
            R::ChunkOfAnotherRegion,
        );
        refused(
            &mut l,
            &other(Grow::new(WireHandle::PosixFd, 2 * MIB, 2 * MIB, 8 * MIB, [4; 16], 0).unwrap()),
            R::ChunkOfAnotherRegion,
        );
        refused(&mut l, &region(64 * MIB), R::SecondRegion);
        let share =
            crate::ipc::Header::new(WireHandle::PosixFd, 2 * MIB, 2 * MIB, 0, 2 * MIB, UUID, 0).unwrap();
        refused(&mut l, &Message::Share(share), R::ShareInRegion);
        refused(
            &mut l,
            &Message::Shrink { length: 10 * MIB, tag: 0 },
            R::ShrinkPastTheEnd { length: 10 * MIB, end: 8 * MIB },
        );
        refused(
            &mut l,
            &Message::Shrink { length: 2 * MIB, tag: 0 },
            R::ShrinkInsideAChunk { length: 2 * MIB },
        );
        refused(&mut l, &Message::Shrink { length: 1, tag: 0 }, R::ShrinkInsideAChunk { length: 1 });
        assert!(l.apply(&other(base)).is_ok(), "the right chunk still fits");
    }

    #[test]
    fn the_region_comes_first_within_the_importers_limits() {
        let mut l = RegionLayout::new(64 * MIB, 2 * MIB).unwrap();
        refused(&mut l, &chunk(0, 2 * MIB), R::BeforeRegion(Kind::Grow));
        refused(&mut l, &Message::Note { tag: 0 }, R::BeforeRegion(Kind::Note));
        refused(&mut l, &Message::Shrink { length: 0, tag: 0 }, R::BeforeRegion(Kind::Shrink));
        refused(&mut l, &region(66 * MIB), R::OverLimit { capacity: 66 * MIB, limit: 64 * MIB });
        // The exporter's granularity is 2 MiB; an importer whose own is 4 MiB cannot map its
        // 2 MiB pieces.
        let mut coarse = RegionLayout::new(1 << 30, 4 * MIB).unwrap();
        refused(
            &mut coarse,
            &region(6 * MIB),
            R::CapacityOffGranularity { capacity: 6 * MIB, granularity: 4 * MIB },
        );
        coarse.apply(&region(8 * MIB)).unwrap();
        refused(
            &mut coarse,
            &chunk(0, 2 * MIB),
            R::SizeOffGranularity { size: 2 * MIB, granularity: 4 * MIB },
        );
        assert!(l.apply(&region(64 * MIB)).is_ok());
        assert!(RegionLayout::new(1 << 30, 3).is_err());
        assert!(RegionLayout::new(1 << 30, 0).is_err());
    }

    #[test]
    fn a_refusal_reads_as_the_protocol_error_it_is() {
        let e = Error::RegionRefused(R::NotAtTheEnd { offset: 0, end: 8 * MIB });
        assert!(e.is_protocol());
        assert_eq!(
            e.to_string(),
            "protocol error: a chunk at 0 where the mapped part ends at 8388608 (chunks follow each other, \
             with no gap or overlap)"
        );
    }
}
