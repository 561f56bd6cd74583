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
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Below this, the ordinary copy: the fence and the alignment head cost more than they save.
    const SMALL: usize = 4096;

    pub(super) fn copy(dst: &mut [u8], src: &[u8]) {
        let len = dst.len();
        if len < SMALL {
            dst.copy_from_slice(src);
            return;
        }
        // Non-temporal stores need 16-byte aligned destinations: copy up to the first such
        // address the ordinary way.
        let head = dst.as_ptr().align_offset(16).min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (len - head) & !63;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        let mut i = 0;
        while i < body {
            // SAFETY: `i + 64 <= body <= len - head`, so both 64-byte ranges lie inside the
            // slices after `head`; `d + i` is 16-byte aligned (`head` aligned `d`, `i` is a
            // multiple of 64); loads are unaligned loads; SSE2 is part of x86-64.
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
        // Non-temporal stores are weakly ordered: fence them before the caller publishes the
        // bytes (to another thread, or to the DMA engine through a driver call).
        // SAFETY: SSE2 is part of x86-64; a fence has no memory-safety preconditions.
        unsafe { _mm_sfence() };
        let tail = head + body;
        dst[tail..].copy_from_slice(&src[tail..]);
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

    #[test]
    fn copies_every_byte_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8 | 1).collect();
        for len in [0, 1, 15, 63, 4095, 4096, 4097, 8191, 12_345, 19_000] {
            for (so, doff) in [(0, 0), (1, 0), (0, 1), (3, 7), (15, 9), (16, 16), (5, 48)] {
                let mut dst = vec![0u8; len + doff + 8];
                copy_streaming(&mut dst[doff..doff + len], &src[so..so + len]);
                assert_eq!(&dst[doff..doff + len], &src[so..so + len], "len {len}, offsets {so}/{doff}");
                assert!(dst[..doff].iter().chain(&dst[doff + len..]).all(|&b| b == 0), "wrote outside");
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn refuses_different_lengths() {
        copy_streaming(&mut [0u8; 8], &[1u8; 9]);
    }
}
