//! The hooks on the fake driver's device, each in a child process of its own (the library's
//! allocators and the fake's settings belong to the whole process), with host functions on a
//! thread of their own so that work queued on a stream is really pending until they return.

use super::*;
use crate::tests::{fake_vmm, in_child_with, last_error};
use crate::{allocator, cuvmm_free, cuvmm_get_stats, cuvmm_malloc, CuvmmStats};
use cuvmm_lib::{Context, Stream};
use std::sync::mpsc;
use std::time::Duration;

/// The fake driver loaded, host functions on their own thread, and its device's context.
fn fake_device() -> Context {
    cuvmm_lib::driver::driver().expect("the fake driver loads");
    let lib = std::env::var_os(cuvmm_lib::driver::LIBRARY_ENV).expect("the parent names the fake driver");
    let path = std::ffi::CString::new(lib.as_encoded_bytes()).unwrap();
    // SAFETY: the fake driver is loaded (RTLD_NOLOAD only finds it) and exports
    // `void fake_host_thread(int)`; the handle is not closed.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null());
        let f = libc::dlsym(h, c"fake_host_thread".as_ptr());
        assert!(!f.is_null());
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(f)(1);
    }
    Context::for_ordinal(0).unwrap()
}

/// Work queued on `stream` that runs until the returned sender says go (or 10 s pass).
fn busy(stream: &Stream) -> mpsc::Sender<()> {
    let (go, wait) = mpsc::channel::<()>();
    stream
        .launch_host_fn(move || {
            let _ = wait.recv_timeout(Duration::from_secs(10));
        })
        .unwrap();
    go
}

fn stats() -> CuvmmStats {
    let mut s = CuvmmStats::default();
    // SAFETY: a writable struct.
    assert_eq!(unsafe { cuvmm_get_stats(0, &mut s) }, 0, "{}", last_error());
    s
}

/// Frees of device 0 waiting for other streams' work.
fn deferred() -> usize {
    allocator(0).unwrap().deferred_frees()
}

const SIZE: isize = 4 << 20;

/// A block of the legacy stream read by work on a side stream that still runs, recorded there
/// and freed (PyTorch's record_stream pattern): the side stream, the block, and what lets the
/// work finish.
fn freed_while_side_stream_reads() -> (Stream, *mut c_void, mpsc::Sender<()>) {
    let ctx = fake_device();
    let side = Stream::non_blocking(&ctx).unwrap();
    let p = cuvmm_malloc(SIZE, 0, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    let go = busy(&side);
    cuvmm_record_stream(p, side.raw());
    cuvmm_free(p, SIZE, 0, std::ptr::null_mut());
    assert_eq!(deferred(), 1);
    (side, p, go)
}

#[test]
fn a_block_recorded_on_a_busy_stream_is_not_handed_out_again_until_that_work_ran() {
    in_child_with(
        "hooks::tests::a_block_recorded_on_a_busy_stream_is_not_handed_out_again_until_that_work_ran",
        Some(fake_vmm),
        record_stream_child,
    );
}

/// The child of the test above: PyTorch's record_stream pattern, a tensor of the legacy stream
/// read by work on a side stream, recorded there and freed, and a request of the same size on
/// the legacy stream at once.
fn record_stream_child() {
    let (side, p, go) = freed_while_side_stream_reads();
    let null = std::ptr::null_mut();
    let q = cuvmm_malloc(SIZE, 0, null);
    assert!(!q.is_null(), "{}", last_error());
    assert_ne!(q, p, "the block went to a new request while the side stream's work could still read it");
    assert_eq!(stats().frees, 0, "the free waits for the side stream");
    // Once that work has run, the next request frees the block first.
    go.send(()).unwrap();
    side.synchronize().unwrap();
    let r = cuvmm_malloc(SIZE, 0, null);
    assert!(!r.is_null(), "{}", last_error());
    assert_eq!(deferred(), 0);
    assert_eq!(stats().frees, 1);
    assert_eq!(r, p, "freed on its own stream, the block serves that stream at once");
    for x in [q, r] {
        cuvmm_free(x, SIZE, 0, null);
    }
    // A use recorded on the block's own stream defers nothing.
    let s = cuvmm_malloc(SIZE, 0, null);
    cuvmm_record_stream(s, null);
    cuvmm_free(s, SIZE, 0, null);
    assert_eq!(deferred(), 0);
    assert_eq!(allocator(0).unwrap().recorded_streams(DevicePtr::new(s as u64)), 0);
}

#[test]
fn only_a_block_cuvmm_handed_out_is_recorded() {
    in_child_with("hooks::tests::only_a_block_cuvmm_handed_out_is_recorded", Some(fake_vmm), foreign_child);
}

/// The child of the test above: PyTorch forwards `record_stream` for every tensor, also those
/// whose memory cuvmm did not hand out (received from another process, or inside a block).
/// Nothing is recorded for them: no free then takes the slow path for them, and a later block at
/// that address is not held back by another memory's uses.
fn foreign_child() {
    let ctx = fake_device();
    let side = Stream::non_blocking(&ctx).unwrap();
    let null = std::ptr::null_mut();
    let p = cuvmm_malloc(SIZE, 0, null);
    assert!(!p.is_null(), "{}", last_error());
    let inside = p.wrapping_byte_add(4096);
    cuvmm_record_stream(inside, side.raw());
    let mut elsewhere = [0u8; 64];
    cuvmm_record_stream(elsewhere.as_mut_ptr().cast(), side.raw());
    assert_eq!(allocator(0).unwrap().recorded_streams(DevicePtr::new(inside as u64)), 0);
    assert_eq!(allocator(0).unwrap().recorded_streams(DevicePtr::new(elsewhere.as_ptr() as u64)), 0);
    cuvmm_free(p, SIZE, 0, null);
    // The freed block's address, recorded while no block is there; the next block lands on it.
    let _go = busy(&side);
    cuvmm_record_stream(p, side.raw());
    assert_eq!(allocator(0).unwrap().recorded_streams(DevicePtr::new(p as u64)), 0);
    let q = cuvmm_malloc(SIZE, 0, null);
    assert_eq!(q, p, "the cached block serves the same stream again");
    cuvmm_free(q, SIZE, 0, null);
    assert_eq!(deferred(), 0, "the new block's free waited for uses of the memory before it");
    assert_eq!(stats().frees, 2);
}

#[test]
fn an_empty_cache_waits_for_the_recorded_work_and_gives_the_block_back() {
    in_child_with(
        "hooks::tests::an_empty_cache_waits_for_the_recorded_work_and_gives_the_block_back",
        Some(fake_vmm),
        record_stream_empty_cache_child,
    );
}

/// The child of the test above: `torch.cuda.empty_cache()` with a free still waiting for a side
/// stream frees it once that work ran and releases its pages.
fn record_stream_empty_cache_child() {
    let (_side, _, go) = freed_while_side_stream_reads();
    let later = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        go.send(()).unwrap();
    });
    cuvmm_empty_cache_all();
    later.join().unwrap();
    assert_eq!(deferred(), 0);
    let s = stats();
    assert_eq!((s.live, s.frees), (0, 1));
    assert_eq!(s.mapped, 0, "the block's pages went back to the driver");
}

#[test]
fn the_memory_fraction_refuses_requests_past_it_as_out_of_memory() {
    in_child_with(
        "hooks::tests::the_memory_fraction_refuses_requests_past_it_as_out_of_memory",
        Some(fake_vmm),
        memory_fraction_child,
    );
}

/// The child of the test above, on the fake's 80 GiB device.
fn memory_fraction_child() {
    let _ctx = fake_device();
    let null = std::ptr::null_mut();
    cuvmm_set_memory_fraction(0.5, 0);
    let a = cuvmm_malloc(30 << 30, 0, null);
    assert!(!a.is_null(), "{}", last_error());
    assert!(cuvmm_malloc(11 << 30, 0, null).is_null(), "41 GiB live is past half of 80 GiB");
    let e = last_error();
    assert!(e.contains("out of memory") && e.contains("memory fraction"), "{e}");
    let b = cuvmm_malloc(9 << 30, 0, null);
    assert!(!b.is_null(), "{}", last_error());
    cuvmm_set_memory_fraction(2.0, 0);
    assert!(last_error().contains("not between 0 and 1"), "{}", last_error());
    assert!(cuvmm_malloc(2 << 30, 0, null).is_null(), "a refused fraction keeps the limit");
    cuvmm_set_memory_fraction(1.0, 0);
    let c = cuvmm_malloc(2 << 30, 0, null);
    assert!(!c.is_null(), "{}", last_error());
    for (x, n) in [(a, 30isize << 30), (b, 9 << 30), (c, 2 << 30)] {
        cuvmm_free(x, n, 0, null);
    }
    cuvmm_set_memory_fraction(0.5, 9);
    assert!(last_error().contains("no device 9"), "{}", last_error());
}
