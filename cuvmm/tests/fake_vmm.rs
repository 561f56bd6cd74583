//! `VmmVec` growth on the CPU, against the fake driver's FAKE_VMM device (VMM calls succeed and are
//! counted): where a growth goes, what it refuses, that nothing outlives a dropped vector, and how
//! growth reaches importers. The driver, its counters and its settings belong to the whole
//! process, so the tests take turns.

mod common;

use cuvmm::driver::driver;
use cuvmm::vmm::HandleTypes;
use cuvmm::{Context, VmmVec};
use std::ffi::{c_char, CString};
use std::os::unix::net::UnixStream;

const MIB: usize = 1 << 20;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn, the fake driver (loaded for the whole process) and its device's context.
fn fake_device() -> (std::sync::MutexGuard<'static, ()>, std::path::PathBuf, Context) {
    let turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lib = common::fake_driver("FAKE_VMM");
    std::env::set_var(cuvmm::driver::LIBRARY_ENV, &lib);
    driver().expect("the fake driver loads");
    (turn, lib, Context::for_ordinal(0).unwrap())
}

/// The fake's counter of `name`'s calls.
fn count(lib: &std::path::Path, name: &str) -> i64 {
    let path = CString::new(lib.as_os_str().as_encoded_bytes()).unwrap();
    let name = CString::new(name).unwrap();
    // SAFETY: the fake driver is loaded (RTLD_NOLOAD only finds it) and defines
    // `long fake_count(const char *)`; the counters are atomics.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null());
        let f = libc::dlsym(h, c"fake_count".as_ptr());
        assert!(!f.is_null());
        let f = std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*const c_char) -> i64>(f);
        f(name.as_ptr())
    }
}

/// Threads of this process named like the vector's create-ahead thread.
fn ahead_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = t.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).is_ok_and(|c| c.trim() == "cuvmm-grow-ahea")
        })
        .count()
}

#[test]
fn growth_stays_in_place_when_it_fits_refuses_the_impossible_and_leaves_nothing_behind() {
    let (_turn, lib, ctx) = fake_device();

    // A growth whose bytes fit the reservation stays there, though the policy would grow past
    // its end: with an importer connected (which cannot follow a move) and without.
    for share in [true, false] {
        let mut v = VmmVec::<u8>::builder(&ctx)
            .handle_types(HandleTypes::POSIX_FD)
            .reserve_address_space(100 * MIB)
            .build()
            .unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        if share {
            v.share_growth(a, 0).unwrap();
        }
        v.reserve(64 * MIB).unwrap();
        let base = v.device_ptr();
        v.reserve(64 * MIB + 1).unwrap();
        assert_eq!(v.device_ptr(), base, "moved (importer: {share})");
        assert!(v.raw().mapped() <= 100 * MIB);
        // What does not fit still moves, or is refused with an importer.
        assert_eq!(v.reserve(200 * MIB).is_err(), share);
    }

    // A request no device could hold is an error, not an allocation of its plan's size.
    let mut v = VmmVec::<u8>::builder(&ctx).reserve_address_space(64 * MIB).build().unwrap();
    let e = v.reserve(1 << 62).unwrap_err().to_string();
    assert!(e.contains("chunks"), "{e}");
    drop(v);

    // The chunks made ahead are all released, and their thread gone, when the vector is dropped,
    // also while the driver is slow to make them.
    std::env::set_var("FAKE_CREATE_SLEEP_US", "100000");
    let (created, released) = (count(&lib, "cuMemCreate"), count(&lib, "cuMemRelease"));
    let v = VmmVec::<f32>::builder(&ctx).create_ahead(true).reserve_address_space(8 << 30).build().unwrap();
    assert!(v.raw().ahead_bytes() > 0);
    drop(v);
    std::env::remove_var("FAKE_CREATE_SLEEP_US");
    let made = count(&lib, "cuMemCreate") - created;
    assert!(made >= 1);
    assert_eq!(count(&lib, "cuMemRelease") - released, made, "chunks left after the drop");
    assert_eq!(ahead_threads(), 0);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(count(&lib, "cuMemCreate") - created, made, "chunks made after the drop");
}

/// Growth followed through a socket an event loop made non-blocking, and an importer that stops
/// reading: neither stalls nor breaks the other side.
#[test]
fn an_import_survives_a_non_blocking_socket_and_a_stalled_importer_is_let_go() {
    let (_turn, _, ctx) = fake_device();
    use cuvmm::ipc::wire::{HandleType, Message, Region};
    use cuvmm::ipc::{send_message, GrowableImport, PeerPolicy, Update};
    use std::io::Write;
    use std::os::fd::AsFd;

    let uuid = ctx.device().uuid().unwrap().0;
    let region =
        Message::Region(Region::new(HandleType::PosixFd, 64 * MIB as u64, 2 * MIB as u64, uuid, 1).unwrap());
    let note = Message::Note { tag: 5 }.encode().unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    send_message(a.as_fd(), &region, None).unwrap();
    b.set_nonblocking(true).unwrap();
    let mut import = GrowableImport::accept(&ctx, b, PeerPolicy::SameUid, 1 << 30, &[]).unwrap();
    // Nothing yet: "try again", and the import goes on.
    assert!(import.next_update().unwrap_err().is_would_block());
    (&a).write_all(&note).unwrap();
    assert_eq!(import.next_update().unwrap(), Update::Note { tag: 5 });
    // Part of a frame, then the rest a moment later: the call waits for it.
    (&a).write_all(&note[..100]).unwrap();
    let rest = note[100..].to_vec();
    let writer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        (&a).write_all(&rest).unwrap();
        a
    });
    assert_eq!(import.next_update().unwrap(), Update::Note { tag: 5 });
    drop(writer.join().unwrap());
    assert_eq!(import.next_update().unwrap(), Update::Closed);

    // An importer that never reads: the exporter's notes go on, and it is let go.
    let (a, _never_read) = UnixStream::pair().unwrap();
    let mut v = VmmVec::<u32>::builder(&ctx)
        .handle_types(HandleTypes::POSIX_FD)
        .reserve_address_space(1 << 30)
        .build()
        .unwrap();
    v.share_growth(a, 7).unwrap();
    let t = std::time::Instant::now();
    for i in 0..100_000u64 {
        v.notify_importers(i).unwrap();
    }
    assert_eq!(v.importer_count(), 0);
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "{:?}", t.elapsed());
}
