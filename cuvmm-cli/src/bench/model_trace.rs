//! A trace in the compact form the stream-ordered allocator's model tests replay
//! (`src/alloc/ordered/core/testdata/*.bin`): one LEB128 number per event of the trace, the
//! allocations that returned null left out and the blocks never freed left unfreed.
//!
//! * [`Form::Sizes`] (`train_start.bin`): `2 * size` for an allocation, `2 * k + 1` for the free of
//!   the allocation made `k` allocations earlier.
//! * [`Form::Streams`] (`three_streams.bin`): `8 * size + 2 * stream` for an allocation,
//!   `8 * k + 2 * stream + 1` for a free, streams numbered from 1 in the order the trace first
//!   names them (at most three).
//!
//! `cuvmm trace-events` writes them; the files' own README says with which arguments.

use super::trace::{Op, Trace};
use cuvmm::error::Result;

/// Which of the two encodings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Sizes and frees only.
    Sizes,
    /// Sizes, frees and streams.
    Streams,
}

/// The events of `trace` (its own, not the frees [`super::trace::parse`] adds for blocks never
/// freed) in `form`.
pub fn encode(trace: &Trace, form: Form) -> Result<Vec<u8>> {
    let own = &trace.ops[..trace.ops.len() - trace.unfreed];
    let mut out = Vec::new();
    let mut made = 0u64;
    for op in own {
        let (value, alloc, stream) = match *op {
            Op::Alloc { stream, size, .. } => {
                made += 1;
                (size, true, stream)
            }
            Op::Free { id, stream, .. } => (made - u64::from(id), false, stream),
        };
        let v = match form {
            Form::Sizes => value.checked_mul(2).map(|v| v + u64::from(!alloc)),
            Form::Streams => {
                if stream > 2 {
                    return Err(super::invalid("the stream form holds at most three streams"));
                }
                value.checked_mul(8).map(|v| v + 2 * (u64::from(stream) + 1) + u64::from(!alloc))
            }
        };
        leb128(&mut out, v.ok_or_else(|| super::invalid(format!("{value} does not fit the encoding")))?);
    }
    Ok(out)
}

fn leb128(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The first `records` records of a trace's text (all with `None`), the header kept: what a
/// model test replays of a long recording.
pub fn first_records(text: &str, records: Option<usize>) -> &str {
    let Some(n) = records else { return text };
    // The header, then `n` lines.
    match text.match_indices('\n').nth(n) {
        Some((end, _)) => &text[..=end],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::super::trace::{parse, synthetic};
    use super::*;

    #[test]
    fn the_synthetic_trace_makes_three_streams_bin() {
        let made = encode(&synthetic().unwrap(), Form::Streams).unwrap();
        let kept: &[u8] = include_bytes!("../../../src/alloc/ordered/core/testdata/three_streams.bin");
        assert!(made == kept, "cuvmm trace-events --streams no longer makes three_streams.bin");
    }

    #[test]
    fn both_forms_number_frees_back_from_the_last_allocation() {
        let text = "# cuvmm trace v1: op t_ns device stream size ptr\n\
                    a 1 0 0x0 100 0x10\n\
                    a 2 0 0x7 0 0x0\n\
                    a 3 0 0x7 200 0x20\n\
                    f 4 0 0x0 100 0x10\n\
                    a 5 0 0x0 300 0x30\n\
                    f 6 0 0x7 300 0x30\n";
        let t = parse(text.as_bytes(), 0).unwrap();
        // 100 on stream 1; (null skipped); 200 on stream 2; free of the allocation two back on
        // stream 1; 300 on stream 1; its free, one back, on stream 2; 200 left unfreed.
        let mut sizes = Vec::new();
        for v in [200, 400, 2 * 2 + 1, 600, 2 + 1] {
            leb128(&mut sizes, v);
        }
        assert_eq!(encode(&t, Form::Sizes).unwrap(), sizes);
        let mut streams = Vec::new();
        for v in [800 + 2, 1600 + 4, 16 + 2 + 1, 2400 + 2, 8 + 4 + 1] {
            leb128(&mut streams, v);
        }
        assert_eq!(encode(&t, Form::Streams).unwrap(), streams);
        // The first three records: the null allocation counts as one.
        let t3 = parse(first_records(text, Some(3)).as_bytes(), 0).unwrap();
        assert_eq!(encode(&t3, Form::Sizes).unwrap(), [200, 1, 144, 3]);
        assert_eq!(first_records(text, None), text);
        assert_eq!(first_records(text, Some(99)), text);
    }

    #[test]
    fn more_than_three_streams_do_not_fit_the_stream_form() {
        let mut text = String::from("# cuvmm trace v1: op t_ns device stream size ptr\n");
        for s in 1..=4 {
            text.push_str(&format!("a {s} 0 {s:#x} 8 {:#x}\n", s * 16));
        }
        let t = parse(text.as_bytes(), 0).unwrap();
        assert!(encode(&t, Form::Streams).is_err());
        assert!(encode(&t, Form::Sizes).is_ok());
    }
}
