//! What PyTorch's memory snapshots need from cuvmm: every block of a device as it is now
//! (`cuvmm_snapshot_json`), and a function told of each allocation and free while history is
//! recorded (`cuvmm_set_alloc_observer`), through which the Python package keeps the stack that
//! allocated each block.

use crate::{allocator, allocators, guard, write_text, PROCESS};
use cuvmm_lib::alloc::{BlockState, SegmentSnapshot};
use cuvmm_lib::driver::sys::CUstream;
use std::ffi::{c_char, c_int};
use std::fmt::Write;
use std::sync::atomic::Ordering;

/// Told of an allocation (`kind` 'a') or a free ('f'): device, address, size and stream handle.
pub type Observer =
    Option<extern "C" fn(kind: c_int, device: c_int, ptr: u64, size: isize, stream: CUstream)>;

/// Tells the observer, if any, of an allocation or free.
#[inline(always)]
pub(crate) fn observe(kind: u8, device: c_int, ptr: u64, size: isize, stream: CUstream) {
    let f = PROCESS.observer.load(Ordering::Acquire);
    if f != 0 && ptr != 0 {
        observe_now(f, kind, device, ptr, size, stream);
    }
}

#[cold]
fn observe_now(f: usize, kind: u8, device: c_int, ptr: u64, size: isize, stream: CUstream) {
    // SAFETY: `f` was stored from an `Observer` by `cuvmm_set_alloc_observer`, whose contract
    // keeps it callable until it is replaced.
    let f = unsafe { std::mem::transmute::<usize, extern "C" fn(c_int, c_int, u64, isize, CUstream)>(f) };
    f(c_int::from(kind), device, ptr, size, stream);
}

/// Calls `observer` after every allocation that succeeds and before every free, on the calling
/// thread, with no lock of cuvmm held; NULL stops. Returns 0.
///
/// # Safety
/// `observer` must stay callable, from any thread, until it is replaced; it must not unwind.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_set_alloc_observer(observer: Observer) -> c_int {
    PROCESS.observer.store(observer.map_or(0, |f| f as usize), Ordering::Release);
    0
}

fn state(s: BlockState) -> &'static str {
    match s {
        BlockState::Live => "live",
        BlockState::Free => "free",
        BlockState::FreedShared => "freed_shared",
    }
}

fn quoted(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One device's segments as a JSON array.
pub(crate) fn segments_json(out: &mut String, segments: &[SegmentSnapshot]) {
    out.push('[');
    for (i, s) in segments.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{{\"address\":{},\"small\":{},\"tag\":", s.address, s.small);
        match &s.tag {
            Some(t) => quoted(out, t),
            None => out.push_str("null"),
        }
        let _ = write!(out, ",\"asleep\":{},\"page\":{},\"blocks\":[", s.asleep, s.page);
        for (j, b) in s.blocks.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                "{{\"address\":{},\"size\":{},\"requested\":{},\"graph_pool\":{},\"stream\":{},\"state\":\"{}\"}}",
                b.address,
                b.size,
                b.requested,
                b.graph_pool,
                b.stream,
                state(b.state)
            );
        }
        out.push_str("]}");
    }
    out.push(']');
}

/// Writes every heap and block of `device` (-1: every device used so far) as JSON into `buf`
/// (NUL-terminated when it fits): `{"<device>": [segment, ...], ...}`, each segment
/// `{"address", "small", "tag" (name or null), "asleep", "page", "blocks": [{"address", "size",
/// "requested", "graph_pool", "stream", "state": "live" | "free" | "freed_shared"}]}`. Returns
/// the length the JSON needs (without the NUL), or -1.
///
/// # Safety
/// `buf` must be valid for writing `len` bytes (or null with `len` 0, to ask the length).
#[no_mangle]
pub unsafe extern "C" fn cuvmm_snapshot_json(device: c_int, buf: *mut c_char, len: usize) -> isize {
    guard("cuvmm_snapshot_json", -1, || {
        let devices = if device == -1 {
            allocators().into_iter().map(|(d, a)| (d as c_int, a)).collect()
        } else {
            vec![(device, allocator(device)?)]
        };
        let mut json = String::from("{");
        for (i, (d, a)) in devices.into_iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            let _ = write!(json, "\"{d}\":");
            segments_json(&mut json, &a.snapshot());
        }
        json.push('}');
        // SAFETY: the caller's contract on `buf` and `len` is this function's.
        Ok(unsafe { write_text(buf, len, &json) })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuvmm_lib::alloc::BlockSnapshot;

    #[test]
    fn segments_are_written_as_json_with_every_field_escaped() {
        let segments = vec![SegmentSnapshot {
            address: 4096,
            small: true,
            tag: Some("we\"ights\\".into()),
            asleep: true,
            page: 1 << 22,
            blocks: vec![
                BlockSnapshot {
                    address: 4096,
                    size: 1024,
                    requested: 1000,
                    graph_pool: 2,
                    stream: 7,
                    state: BlockState::Live,
                },
                BlockSnapshot {
                    address: 5120,
                    size: 512,
                    requested: 0,
                    graph_pool: 0,
                    stream: 0,
                    state: BlockState::FreedShared,
                },
            ],
        }];
        let mut s = String::new();
        segments_json(&mut s, &segments);
        assert_eq!(
            s,
            "[{\"address\":4096,\"small\":true,\"tag\":\"we\\\"ights\\\\\",\"asleep\":true,\"page\":4194304,\
             \"blocks\":[{\"address\":4096,\"size\":1024,\"requested\":1000,\"graph_pool\":2,\"stream\":7,\
             \"state\":\"live\"},{\"address\":5120,\"size\":512,\"requested\":0,\"graph_pool\":0,\"stream\":0,\
             \"state\":\"freed_shared\"}]}]"
        );
    }

    static SEEN: std::sync::Mutex<Vec<(c_int, c_int, u64, isize)>> = std::sync::Mutex::new(Vec::new());

    extern "C" fn note(kind: c_int, device: c_int, ptr: u64, size: isize, _stream: CUstream) {
        SEEN.lock().unwrap().push((kind, device, ptr, size));
    }

    #[test]
    fn the_observer_is_told_of_what_happens_while_set_and_of_nothing_after() {
        // SAFETY: `note` is a plain function that does not unwind.
        assert_eq!(unsafe { cuvmm_set_alloc_observer(Some(note)) }, 0);
        observe(b'a', 0, 0x1000, 512, std::ptr::null_mut());
        observe(b'f', 0, 0, 512, std::ptr::null_mut());
        // SAFETY: NULL stops the calls.
        assert_eq!(unsafe { cuvmm_set_alloc_observer(None) }, 0);
        observe(b'f', 0, 0x1000, 512, std::ptr::null_mut());
        // Other tests allocate meanwhile, on threads of their own: only this test's calls count.
        let mine: Vec<_> =
            SEEN.lock().unwrap().iter().copied().filter(|c| c.2 == 0x1000 || c.2 == 0).collect();
        assert_eq!(mine, vec![(c_int::from(b'a'), 0, 0x1000, 512)], "a NULL is no block");
    }
}
