//! A host copy with non-temporal stores, for the staging ring's device-to-host side.
//!
//! An ordinary copy first reads every destination cache line it writes (to own the line), then
//! writes it back when the line leaves the cache: for a destination larger than the caches that
//! is three memory passes per byte copied, where the copy itself needs two. Non-temporal stores
//! write whole lines straight to memory. Draining the ring into the caller's pageable buffer is
//! that case. Filling the ring is not, but for its last few MiB: its slots stay in cache for the
//! DMA engine to read, and the same stores on every byte made the host-to-device side slower;
//! the staging module says why the last bytes are streamed. docs/PERFORMANCE.md has the figures
//! ("Figures behind the defaults").
//!
//! On x86-64 the body goes in whole 64-byte lines from the destination's first line boundary,
//! with AVX's 32-byte stores where the processor has them (found at run time), else SSE2's
//! 16-byte ones; the unaligned head and the tail are copied the ordinary way. Elsewhere the copy
//! is the ordinary one.

/// Copies `src` into `dst` (equal lengths) with non-temporal stores where the platform has them,
/// and returns once those stores are ordered before any later store of this thread (so a release
/// store or an unlock afterwards publishes them).
///
/// # Panics
/// If the lengths differ.
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    imp::copy(dst, src);
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
mod imp {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_loadu_si128, _mm_sfence,
        _mm_stream_si128,
    };

    /// Below this, the ordinary copy: the fence and the alignment head cost more than they save.
    const SMALL: usize = 4096;

    /// The vector stores the body is written with.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Isa {
        /// 16-byte stores: every x86-64 processor has them.
        Sse2,
        /// 32-byte stores, half the instructions, where the processor has AVX.
        Avx,
    }

    /// The widest stores this processor has (the detection is cached after the first call).
    pub(super) fn best() -> Isa {
        if std::arch::is_x86_feature_detected!("avx") {
            Isa::Avx
        } else {
            Isa::Sse2
        }
    }

    pub(super) fn copy(dst: &mut [u8], src: &[u8]) {
        copy_with(best(), dst, src);
    }

    /// The copy with `isa`'s stores, which the caller has checked this processor has.
    pub(super) fn copy_with(isa: Isa, dst: &mut [u8], src: &[u8]) {
        let len = dst.len();
        if len < SMALL {
            dst.copy_from_slice(src);
            return;
        }
        // Whole lines from the first line boundary on: a non-temporal store needs an aligned
        // destination, and a line written whole leaves the write-combining buffer in one burst.
        let head = dst.as_ptr().align_offset(64).min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (len - head) & !63;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        match isa {
            // SAFETY: `body` bytes from `d` and `s` lie inside the slices after `head`, `d` is
            // 64-byte aligned, and `best` found AVX on this processor.
            Isa::Avx => unsafe { lines_avx(d, s, body) },
            // SAFETY: as above; SSE2 is part of x86-64.
            Isa::Sse2 => unsafe { lines_sse2(d, s, body) },
        }
        // Non-temporal stores are weakly ordered: fence them before the caller publishes the
        // bytes (to another thread, or to the DMA engine through a driver call).
        // SAFETY: SSE2 is part of x86-64; a fence has no memory-safety preconditions.
        unsafe { _mm_sfence() };
        let tail = head + body;
        dst[tail..].copy_from_slice(&src[tail..]);
    }

    /// Copies `n` bytes (a multiple of 64) from `s` to `d` in 64-byte lines of 16-byte
    /// non-temporal stores.
    ///
    /// # Safety
    /// `d` is 64-byte aligned, writable for `n` bytes and not read meanwhile; `s` is readable
    /// for `n` bytes; the two do not overlap.
    unsafe fn lines_sse2(d: *mut u8, s: *const u8, n: usize) {
        let mut i = 0;
        while i < n {
            // SAFETY: `i + 64 <= n`, so the line lies inside both ranges; `d + i` is 64-byte
            // aligned; the loads are unaligned loads.
            unsafe {
                let s = s.add(i).cast::<__m128i>();
                let d = d.add(i).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            i += 64;
        }
    }

    /// [`lines_sse2`] with 32-byte stores.
    ///
    /// # Safety
    /// As [`lines_sse2`], and the processor has AVX.
    #[target_feature(enable = "avx")]
    unsafe fn lines_avx(d: *mut u8, s: *const u8, n: usize) {
        let mut i = 0;
        while i < n {
            // SAFETY: as in `lines_sse2`; AVX is there (the caller's promise).
            unsafe {
                let s = s.add(i).cast::<__m256i>();
                let d = d.add(i).cast::<__m256i>();
                let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
                _mm256_stream_si256(d, a);
                _mm256_stream_si256(d.add(1), b);
            }
            i += 64;
        }
    }
}

/// Elsewhere, and under Miri (which does not run the streaming-store intrinsics), the ordinary
/// copy.
#[cfg(not(all(target_arch = "x86_64", not(miri))))]
mod imp {
    pub(super) fn copy(dst: &mut [u8], src: &[u8]) {
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;
    use proptest::prelude::*;

    /// Copies `len` bytes from offset `so` of a patterned source into offset `doff` of a
    /// zeroed destination with `copy`, and checks every byte, and that none outside was written.
    fn check(copy: impl Fn(&mut [u8], &[u8]), len: usize, so: usize, doff: usize) {
        let src: Vec<u8> =
            (0..(len + so) as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8 | 1).collect();
        let mut dst = vec![0u8; len + doff + 80];
        copy(&mut dst[doff..doff + len], &src[so..so + len]);
        assert_eq!(&dst[doff..doff + len], &src[so..so + len], "len {len}, offsets {so}/{doff}");
        assert!(dst[..doff].iter().chain(&dst[doff + len..]).all(|&b| b == 0), "wrote outside");
    }

    #[test]
    fn copies_every_byte_at_every_alignment_and_length() {
        for len in [0, 1, 15, 63, 4095, 4096, 4097, 8191, 12_345, 19_000] {
            for (so, doff) in [(0, 0), (1, 0), (0, 1), (3, 7), (15, 9), (16, 16), (5, 48), (0, 63)] {
                check(copy_streaming, len, so, doff);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Any length, short ones included, from any source alignment into any destination
        /// alignment within a line, with each kind of store this processor has.
        #[test]
        fn the_copy_is_exact_for_any_alignment_and_length(
            len in prop_oneof![0usize..200, 4000usize..4200, 0usize..70_000],
            so in 0usize..64,
            doff in 0usize..64,
        ) {
            check(copy_streaming, len, so, doff);
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            {
                use super::imp::{best, copy_with, Isa};
                check(|d, s| copy_with(Isa::Sse2, d, s), len, so, doff);
                if best() == Isa::Avx {
                    check(|d, s| copy_with(Isa::Avx, d, s), len, so, doff);
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn refuses_different_lengths() {
        copy_streaming(&mut [0u8; 8], &[1u8; 9]);
    }
}
