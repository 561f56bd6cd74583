//! Size arithmetic and the chunk policy: pure code, property-tested on the CPU.

use crate::error::{Error, Result};

/// `size` rounded up to a multiple of `granularity` (a power of two or any non-zero value).
/// Zero sizes, a zero granularity and overflow are errors, never silent wrap-around.
pub fn round_up(size: usize, granularity: usize) -> Result<usize> {
    if granularity == 0 {
        return Err(Error::invalid("granularity must not be zero"));
    }
    if size == 0 {
        return Err(Error::invalid("size must not be zero"));
    }
    size.div_ceil(granularity)
        .checked_mul(granularity)
        .ok_or_else(|| Error::invalid(format!("{size} bytes rounded up to {granularity} overflows usize")))
}

/// Checks that `size` is a non-zero multiple of `granularity`.
pub fn check_aligned(what: &str, size: usize, granularity: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid(format!("{what} must not be zero")));
    }
    if granularity == 0 || size % granularity != 0 {
        return Err(Error::invalid(format!(
            "{what} ({size} bytes) is not a multiple of the allocation granularity ({granularity} bytes)"
        )));
    }
    Ok(())
}

/// `count` elements of `elem` bytes, or an error on overflow.
pub fn bytes_for(count: usize, elem: usize) -> Result<usize> {
    count
        .checked_mul(elem)
        .ok_or_else(|| Error::invalid(format!("{count} elements of {elem} bytes overflow usize")))
}

/// How a growable range picks the sizes of the physical chunks it maps.
///
/// Every chunk costs about the same fixed number of driver calls (`cuMemCreate`, `cuMemMap`,
/// `cuMemSetAccess`, later `cuMemUnmap` and `cuMemRelease`), so large chunks are cheap per byte,
/// while small ones waste less memory past the end and can be returned by `shrink_to_fit`. The
/// policy grows chunks geometrically with what is already mapped (`growth_percent` of it), bounded
/// by `min_chunk` and `max_chunk`: few driver calls for large vectors, little waste for small ones,
/// and never more than one `max_chunk` mapped past what was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPolicy {
    /// The smallest chunk (rounded up to the granularity).
    pub min_chunk: usize,
    /// The largest chunk (rounded up to the granularity); a larger request maps several.
    pub max_chunk: usize,
    /// A new chunk is at least this share of what is already mapped.
    pub growth_percent: u32,
}

impl Default for ChunkPolicy {
    /// 2 MiB to 1 GiB, each new chunk as large as what is already mapped (capacity doubles, like
    /// `Vec`'s, until chunks reach 1 GiB): a chunk's driver calls cost about the same whatever its
    /// size, so large chunks are cheaper per byte, and waste past the end stays under one 1 GiB
    /// chunk. docs/PERFORMANCE.md ("Figures behind the defaults") has the measurements.
    fn default() -> Self {
        ChunkPolicy { min_chunk: 2 << 20, max_chunk: 1 << 30, growth_percent: 100 }
    }
}

impl ChunkPolicy {
    /// The chunk sizes to map so that `mapped` bytes grow to at least `need` bytes, each a multiple
    /// of `granularity`. Empty when `need <= mapped`. A growth that would take more than 2^20
    /// chunks is refused (no device holds that much).
    pub fn plan(&self, mapped: usize, need: usize, granularity: usize) -> Result<Vec<usize>> {
        self.plan_within(mapped, need, granularity, usize::MAX)
    }

    /// As [`plan`](Self::plan), but the policy's growth beyond what is needed stops at `room`
    /// bytes (what is left of a reservation): only the bytes `need` asks for may go past it.
    pub(crate) fn plan_within(
        &self,
        mapped: usize,
        need: usize,
        granularity: usize,
        room: usize,
    ) -> Result<Vec<usize>> {
        if need <= mapped {
            return Ok(Vec::new());
        }
        if self.min_chunk == 0 || self.max_chunk < self.min_chunk {
            return Err(Error::invalid(format!("chunk policy {self:?} needs 0 < min_chunk <= max_chunk")));
        }
        let min = round_up(self.min_chunk, granularity)?;
        let max = round_up(self.max_chunk, granularity)?;
        let deficit = round_up(need - mapped, granularity)?;
        let growth = (mapped / 100).saturating_mul(self.growth_percent as usize);
        let target = round_up(growth.max(1), granularity)?.clamp(min, max);
        let total = deficit.max(target.min(room));
        // `total` fits in usize; the mapped range must too.
        mapped
            .checked_add(total)
            .ok_or_else(|| Error::invalid(format!("growing {mapped} bytes by {total} overflows usize")))?;
        let count = total / max + usize::from(total % max > 0);
        if count > MAX_CHUNKS {
            return Err(Error::invalid(format!(
                "growing {mapped} bytes by {total} would take {count} chunks of {max} bytes (at most \
                 {MAX_CHUNKS} a growth)"
            )));
        }
        let mut chunks = vec![max; total / max];
        let rest = total % max;
        if rest > 0 {
            chunks.push(rest);
        }
        Ok(chunks)
    }
}

/// The most chunks one growth maps: 2 TiB in the smallest chunks (2 MiB), more than any device
/// holds, and a bound on the plan's own size before anything checks the request.
pub(crate) const MAX_CHUNKS: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn round_up_examples() {
        assert_eq!(round_up(1, 2 * MIB).unwrap(), 2 * MIB);
        assert_eq!(round_up(2 * MIB, 2 * MIB).unwrap(), 2 * MIB);
        assert_eq!(round_up(2 * MIB + 1, 2 * MIB).unwrap(), 4 * MIB);
        assert!(round_up(0, 2 * MIB).is_err());
        assert!(round_up(5, 0).is_err());
        assert!(round_up(usize::MAX, 2 * MIB).is_err());
        assert!(round_up(usize::MAX - MIB, 2 * MIB).is_err());
    }

    #[test]
    fn default_plan_grows_geometrically_and_caps() {
        let p = ChunkPolicy::default();
        assert_eq!(p.plan(0, 1, 2 * MIB).unwrap(), vec![2 * MIB]);
        assert_eq!(p.plan(0, 64 * MIB, 2 * MIB).unwrap(), vec![64 * MIB]);
        // Doubling: 64 MiB mapped, one byte more wanted, 64 MiB more mapped.
        assert_eq!(p.plan(64 * MIB, 64 * MIB + 1, 2 * MIB).unwrap(), vec![64 * MIB]);
        // 100% of 2 GiB is over the cap: one 1 GiB chunk.
        assert_eq!(p.plan(2048 * MIB, 2048 * MIB + 1, 2 * MIB).unwrap(), vec![1024 * MIB]);
        // A large request maps several capped chunks and a remainder.
        assert_eq!(p.plan(0, 2600 * MIB, 2 * MIB).unwrap(), vec![1024 * MIB, 1024 * MIB, 552 * MIB]);
        assert!(p.plan(100, 50, 2 * MIB).unwrap().is_empty());
    }

    #[test]
    fn bad_policies_and_overflow_are_errors() {
        let bad = ChunkPolicy { min_chunk: 0, ..Default::default() };
        assert!(bad.plan(0, 1, 2 * MIB).is_err());
        let bad = ChunkPolicy { min_chunk: 8 * MIB, max_chunk: 4 * MIB, growth_percent: 10 };
        assert!(bad.plan(0, 1, 2 * MIB).is_err());
        let p = ChunkPolicy::default();
        assert!(p.plan(usize::MAX - 4 * MIB, usize::MAX, 2 * MIB).is_err());
        assert!(p.plan(0, usize::MAX, 2 * MIB).is_err());
        assert!(bytes_for(usize::MAX / 2, 4).is_err());
        assert_eq!(bytes_for(3, 4).unwrap(), 12);
    }

    #[test]
    fn alignment_checks() {
        assert!(check_aligned("size", 4 * MIB, 2 * MIB).is_ok());
        assert!(check_aligned("size", 0, 2 * MIB).is_err());
        assert!(check_aligned("size", 3 * MIB, 2 * MIB).is_err());
    }

    proptest! {
        #[test]
        fn plans_cover_the_need_in_aligned_bounded_chunks(
            gran_shift in 12u32..31,
            mapped_units in 0usize..100_000,
            extra in 1usize..(1 << 40),
            min_mul in 1usize..64,
            max_extra in 0usize..512,
            growth in 0u32..400,
        ) {
            let g = 1usize << gran_shift;
            let policy = ChunkPolicy { min_chunk: min_mul * g, max_chunk: (min_mul + max_extra) * g, growth_percent: growth };
            let mapped = mapped_units * g;
            let need = mapped + extra;
            let max = round_up(policy.max_chunk, g).unwrap();
            let plan = match policy.plan(mapped, need, g) {
                Ok(plan) => plan,
                Err(_) => {
                    // Refused only for a growth of more than MAX_CHUNKS chunks.
                    prop_assert!(round_up(extra, g).unwrap() > MAX_CHUNKS * max);
                    return Ok(());
                }
            };
            prop_assert!(plan.len() <= MAX_CHUNKS);
            let total: usize = plan.iter().sum();
            prop_assert!(mapped + total >= need);
            for &c in &plan {
                prop_assert!(c > 0 && c % g == 0 && c <= max);
            }
            // Waste is bounded by one capped chunk (or the minimum, if that is larger).
            let waste = mapped + total - need;
            prop_assert!(waste < max.max(round_up(policy.min_chunk, g).unwrap()) + g);
            // Only the last chunk may be smaller than the cap.
            for &c in plan.iter().rev().skip(1) {
                prop_assert_eq!(c, max);
            }
        }

        #[test]
        fn growth_past_the_need_stops_at_the_room_left_where_the_need_fits(
            mapped_units in 0usize..10_000,
            extra in 1usize..(1 << 34),
            room_units in 0usize..100_000,
            growth in 0u32..400,
        ) {
            let g = 2 * MIB;
            let policy = ChunkPolicy { growth_percent: growth, ..ChunkPolicy::default() };
            let (mapped, room) = (mapped_units * g, room_units * g);
            let need = mapped + extra;
            let plan = policy.plan_within(mapped, need, g, room).unwrap();
            let total: usize = plan.iter().sum();
            prop_assert!(mapped + total >= need);
            let deficit = round_up(extra, g).unwrap();
            if deficit <= room {
                prop_assert!(total <= room, "{total} > room {room}");
            } else {
                prop_assert_eq!(total, deficit);
            }
        }

        #[test]
        fn round_up_never_wraps(size in any::<usize>(), shift in 0u32..40) {
            let g = 1usize << shift;
            match round_up(size, g) {
                Ok(r) => { prop_assert!(r >= size && r % g == 0 && r - size < g); }
                Err(_) => prop_assert!(size == 0 || size.checked_add(g - 1).is_none()),
            }
        }
    }
}
