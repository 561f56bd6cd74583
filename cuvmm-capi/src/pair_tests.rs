//! The cached pair through the C ABI on the fake driver's device, in a child process (the
//! library's allocators belong to the whole process): what it asks the driver, and the way its
//! device's allocator is found.

use super::*;
use crate::tests::{fake_vmm, in_child_with, last_error};

/// The calls a request or a free could make: about the stream, its events, the context, and
/// the pages under blocks.
const CALLS: &[&str] = &[
    "cuStreamIsCapturing",
    "cuStreamGetId",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuThreadExchangeStreamCaptureMode",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemAddressReserve",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
];

/// This thread's calls to each counted entry point so far, by name.
fn calls() -> Vec<(&'static str, i64)> {
    let lib = std::env::var_os(cuvmm_lib::driver::LIBRARY_ENV).expect("the parent names the fake driver");
    let path = CString::new(lib.as_encoded_bytes()).unwrap();
    // SAFETY: the fake driver is loaded (RTLD_NOLOAD only finds it) and exports
    // `long fake_thread_count(const char *)`; the handle is not closed.
    let count = unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null());
        let f = libc::dlsym(h, c"fake_thread_count".as_ptr());
        assert!(!f.is_null());
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_char) -> i64>(f)
    };
    CALLS
        .iter()
        .map(|&name| {
            let c = CString::new(name).unwrap();
            // SAFETY: a NUL-terminated name; the fake reads this thread's counter.
            let n = unsafe { count(c.as_ptr()) };
            assert!(n >= 0, "the fake driver does not count {name}");
            (name, n)
        })
        .collect()
}

/// The calls made between two readings of [`calls`], those not made left out.
fn made(before: &[(&'static str, i64)], after: &[(&'static str, i64)]) -> Vec<(&'static str, i64)> {
    before.iter().zip(after).map(|(&(name, b), &(_, a))| (name, a - b)).filter(|&(_, n)| n != 0).collect()
}

#[test]
fn the_cached_pair_asks_the_driver_only_what_the_module_docs_say() {
    in_child_with(
        "pair_tests::the_cached_pair_asks_the_driver_only_what_the_module_docs_say",
        Some(fake_vmm),
        cached_pair,
    );
}

/// The child of the test above.
fn cached_pair() {
    const PAIRS: i64 = 50;
    let ctx = cuvmm_lib::Context::for_ordinal(0).unwrap();
    let created = cuvmm_lib::Stream::non_blocking(&ctx).unwrap();
    for (stream, per_pair) in [
        // The legacy stream: nothing at all.
        (std::ptr::null_mut(), &[][..]),
        // A created stream: whether it is being captured and its id, once per request; the free
        // asks nothing.
        (created.raw(), &[("cuStreamIsCapturing", 1), ("cuStreamGetId", 1)][..]),
    ] {
        let first = cuvmm_malloc(4096, 0, stream);
        assert!(!first.is_null(), "{}", last_error());
        cuvmm_free(first, 4096, 0, stream);
        let before = calls();
        for _ in 0..PAIRS {
            let p = cuvmm_malloc(4096, 0, stream);
            assert_eq!(p, first, "the stream's cached block comes back");
            cuvmm_free(p, 4096, 0, stream);
        }
        let want: Vec<_> = per_pair.iter().map(|&(name, n)| (name, n * PAIRS)).collect();
        assert_eq!(made(&before, &calls()), want);
    }
    // The per-thread default stream names another stream on each thread: refused, not keyed.
    let per_thread = cuvmm_lib::driver::sys::CU_STREAM_PER_THREAD as CUstream;
    assert!(cuvmm_malloc(4096, 0, per_thread).is_null());
    assert!(last_error().contains("per-thread default stream"), "{}", last_error());
    // Found without the set-up's checks once made, and only for devices that have one.
    let a = allocator(0).unwrap();
    assert!(PROCESS.ready.get(0).is_some_and(|r| std::ptr::eq(r, a)));
    for d in [-1, 1, 63, 64, c_int::MAX] {
        assert!(PROCESS.ready.get(d).is_none());
        assert!(cuvmm_malloc(4096, d, std::ptr::null_mut()).is_null());
        assert!(last_error().contains(&format!("no device {d}")), "{}", last_error());
    }
}
