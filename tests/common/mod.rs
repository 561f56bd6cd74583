//! Helpers shared by the integration tests.
#![allow(dead_code)]

#[path = "fake.rs"]
mod fake;
#[allow(unused_imports)]
pub use fake::{fake_driver, scratch};

/// One message from `sock` (a share, for `SharedMemory::import`): the peer closing the socket
/// first fails the test.
pub fn recv(
    sock: std::os::fd::BorrowedFd<'_>,
    policy: cuvmm::ipc::PeerPolicy,
) -> cuvmm::Result<cuvmm::ipc::Incoming> {
    cuvmm::ipc::recv_message(sock, policy).map(|m| m.expect("a message before the end of the stream"))
}

/// The first two GPUs, or `None` on a machine with one (where `CUVMM_REQUIRE_GPUS` set makes
/// that a failure: the two-GPU machine must not skip the checks).
pub fn two_gpus() -> Option<(cuvmm::Device, cuvmm::Device)> {
    let devices = cuvmm::Device::all().unwrap();
    if devices.len() < 2 {
        assert!(
            std::env::var_os("CUVMM_REQUIRE_GPUS").is_none(),
            "this machine was expected to have two GPUs"
        );
        eprintln!("one GPU: the two-GPU checks run on the two-GPU machine (CUVMM_REQUIRE_GPUS=2)");
        return None;
    }
    Some((devices[0], devices[1]))
}

/// `n` u32 words of device memory at `ptr`, for a kernel to write. The GPU tests pass a live
/// mapping of at least `n` words and order the work on it themselves (what they check).
pub fn words_mut(ptr: u64, n: usize) -> cuvmm::DeviceSliceMut<'static, u32> {
    // SAFETY: the callers' contract above.
    unsafe { cuvmm::DeviceSliceMut::from_raw_parts(ptr, n) }
}

/// The `n` u32 words at `ptr` (as for [`words_mut`]), copied to the host.
pub fn read(ctx: &cuvmm::Context, ptr: u64, n: usize) -> Vec<u32> {
    let mut out = vec![0u32; n];
    // SAFETY: as for `words_mut`.
    let v = unsafe { cuvmm::DeviceSlice::<u32>::from_raw_parts(ptr, n) };
    cuvmm::stream::copy::to_host(ctx, &mut out, &v).unwrap();
    out
}

/// Tests of one binary that use the fake driver take turns: the driver, its counters and its
/// settings belong to the whole process.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn, the fake driver's FAKE_VMM device (loaded for the whole process) and its
/// context.
pub fn fake_device() -> (std::sync::MutexGuard<'static, ()>, std::path::PathBuf, cuvmm::Context) {
    let turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lib = fake_driver("FAKE_VMM");
    std::env::set_var(cuvmm::driver::LIBRARY_ENV, &lib);
    cuvmm::driver::driver().expect("the fake driver loads");
    (turn, lib, cuvmm::Context::for_ordinal(0).unwrap())
}

/// The address of `name` in the loaded fake driver.
pub fn fake_symbol(lib: &std::path::Path, name: &str) -> *mut libc::c_void {
    let path = std::ffi::CString::new(lib.as_os_str().as_encoded_bytes()).unwrap();
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: the fake driver is loaded (RTLD_NOLOAD only finds it); the handle is not closed, so
    // the symbol stays valid.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null());
        let f = libc::dlsym(h, name.as_ptr());
        assert!(!f.is_null(), "the fake driver lacks {name:?}");
        f
    }
}

/// The fake's counter of `name`'s calls.
pub fn count(lib: &std::path::Path, name: &str) -> i64 {
    counter(lib, "fake_count", name)
}

/// The fake's counter of `name`'s calls made by this thread.
pub fn thread_count(lib: &std::path::Path, name: &str) -> i64 {
    counter(lib, "fake_thread_count", name)
}

fn counter(lib: &std::path::Path, which: &str, name: &str) -> i64 {
    let f = fake_symbol(lib, which);
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: `which` is `long (const char *)` in the fake driver; its counters are atomics or
    // the calling thread's.
    unsafe {
        std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*const std::ffi::c_char) -> i64>(f)(
            name.as_ptr(),
        )
    }
}

/// This test executable again, running only the calling test, its output shown: the copy, told
/// by an environment variable the caller sets, does the other side's part of that same test, so
/// no helper process shows as a test that passes doing nothing. Call it on the test's own thread,
/// which the harness names after the test.
pub fn rerun_this_test() -> std::process::Command {
    let test = std::thread::current().name().expect("called on the test's thread").to_owned();
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", &test, "--include-ignored", "--nocapture", "--test-threads=1"]);
    c
}
