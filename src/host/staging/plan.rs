//! How a transfer is cut into chunks and pieces.

/// How a transfer of `bytes` is cut: chunks of `chunk` bytes (the last one shorter), each in
/// pieces of `piece` bytes (the last one of a chunk shorter), numbered in address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) bytes: usize,
    pub(super) chunk: usize,
    pub(super) piece: usize,
    /// Pieces in a full chunk.
    pub(super) per_chunk: usize,
    /// Chunks.
    pub(super) chunks: usize,
    /// Pieces in all.
    pub(super) pieces: usize,
}

impl Plan {
    /// `bytes`, `chunk` and `piece` must be non-zero, `piece <= chunk`.
    pub(super) fn new(bytes: usize, chunk: usize, piece: usize) -> Plan {
        let per_chunk = chunk.div_ceil(piece);
        let chunks = bytes.div_ceil(chunk);
        let last = (bytes - (chunks - 1) * chunk).div_ceil(piece);
        Plan { bytes, chunk, piece, per_chunk, chunks, pieces: (chunks - 1) * per_chunk + last }
    }

    pub(super) fn chunk_len(&self, j: usize) -> usize {
        self.chunk.min(self.bytes - j * self.chunk)
    }

    pub(super) fn pieces_in(&self, j: usize) -> usize {
        self.chunk_len(j).div_ceil(self.piece)
    }

    /// Piece `p`: its chunk, its offset in the chunk, its length.
    pub(super) fn piece(&self, p: usize) -> (usize, usize, usize) {
        let (j, q) = (p / self.per_chunk, p % self.per_chunk);
        let at = q * self.piece;
        (j, at, self.piece.min(self.chunk_len(j) - at))
    }

    /// Whether the bytes at `offset` of the transfer are copied into the ring with non-temporal
    /// stores: those of the last [`STREAMED_TAIL`] bytes.
    pub(super) fn streamed(&self, offset: usize) -> bool {
        offset >= self.bytes.saturating_sub(STREAMED_TAIL)
    }
}

/// Host to device, the last bytes of a transfer go into the ring with non-temporal stores.
///
/// The DMA engine reads a slot shortly after the threads filled it. While they go on copying,
/// the lines they wrote earlier leave their cores' private caches for the shared cache, from
/// which the DMA reads them quickly; the lines of the last chunks stay in the private caches,
/// where every DMA read is a snoop into a core (an idle one at that, once the threads are done),
/// and those DMAs are slow. Sixteen MiB is about what the copying threads' cores hold in their
/// private caches; streaming every byte makes the DMA read all of them from memory, which is
/// slower (see `stream_copy`). docs/PERFORMANCE.md ("Figures behind the defaults") has the
/// measurements.
pub(super) const STREAMED_TAIL: usize = 16 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_last_bytes_are_streamed() {
        let streamed = |plan: &Plan| -> Vec<usize> {
            (0..plan.pieces)
                .filter(|&p| {
                    let (j, at, _) = plan.piece(p);
                    plan.streamed(j * plan.chunk + at)
                })
                .collect()
        };
        let plan = Plan::new(64 << 20, 4 << 20, 256 << 10);
        // The last 16 MiB: the last four chunks' 64 pieces.
        assert_eq!(streamed(&plan), (plan.pieces - 64..plan.pieces).collect::<Vec<_>>());
        // A transfer no longer than the tail is streamed whole.
        let small = Plan::new(13 << 20, 4 << 20, 256 << 10);
        assert_eq!(streamed(&small).len(), small.pieces);
    }
    #[test]
    fn a_plan_covers_every_byte_once_in_order() {
        for (bytes, chunk, piece) in [
            (1, 8, 8),
            (8, 8, 8),
            (9, 8, 3),
            (100, 16, 5),
            (64 << 20, 2 << 20, 512 << 10),
            (5 << 20 | 3, 1 << 20, 256 << 10),
        ] {
            let plan = Plan::new(bytes, chunk, piece);
            let mut at = 0;
            let mut done = vec![0; plan.chunks];
            for p in 0..plan.pieces {
                let (j, off, len) = plan.piece(p);
                assert_eq!(j * chunk + off, at, "{bytes} {chunk} {piece}: piece {p}");
                assert!(len > 0 && len <= piece && off + len <= plan.chunk_len(j));
                done[j] += 1;
                at += len;
            }
            assert_eq!(at, bytes);
            assert!((0..plan.chunks).all(|j| done[j] == plan.pieces_in(j)));
            assert_eq!((0..plan.chunks).map(|j| plan.chunk_len(j)).sum::<usize>(), bytes);
        }
    }
}
