//! The library on the CPU, against the fake driver's FAKE_VMM device (VMM calls succeed and are
//! counted): where a `VmmVec` growth goes, what it refuses, that nothing outlives a dropped
//! vector, how growth reaches importers, a `CachingAllocator` sharing over a slow socket, and what
//! `Module::from_ptx` refuses. The driver, its counters and its settings belong to the whole
//! process, so the tests take turns.

mod common;

use common::{count, fake_device, thread_count};

use cuvmm::driver::driver;
use cuvmm::vmm::HandleTypes;
use cuvmm::VmmVec;
use std::os::unix::net::UnixStream;

const MIB: usize = 1 << 20;

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
    assert!(e.contains("more than the device's"), "{e}");
    drop(v);

    // The chunks made ahead are all released, and their thread gone, when the vector is dropped,
    // also while the driver is slow to make them; and they are unmapped on the dropping thread
    // (which knows whether it is inside a host function, where an unmap must be deferred), not on
    // the thread that made them.
    std::env::set_var("FAKE_CREATE_SLEEP_US", "100000");
    let (created, released) = (count(&lib, "cuMemCreate"), count(&lib, "cuMemRelease"));
    let unmapped = (count(&lib, "cuMemUnmap"), thread_count(&lib, "cuMemUnmap"));
    let v = VmmVec::<f32>::builder(&ctx).create_ahead(true).reserve_address_space(8 << 30).build().unwrap();
    assert!(v.raw().ahead_bytes() > 0);
    // Drop while a chunk is being made: wait until its (slow) create has been called.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while count(&lib, "cuMemCreate") - created < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(v);
    std::env::remove_var("FAKE_CREATE_SLEEP_US");
    let made = count(&lib, "cuMemCreate") - created;
    assert!(made >= 2, "{made}");
    assert_eq!(count(&lib, "cuMemRelease") - released, made, "chunks left after the drop");
    let unmaps = count(&lib, "cuMemUnmap") - unmapped.0;
    assert_eq!(unmaps, made, "every chunk made was mapped once and unmapped once");
    assert_eq!(
        thread_count(&lib, "cuMemUnmap") - unmapped.1,
        unmaps,
        "a chunk was unmapped on another thread"
    );
    assert_eq!(ahead_threads(), 0);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(count(&lib, "cuMemCreate") - created, made, "chunks made after the drop");
}

/// Built with the defaults, an appending vector's growths make no chunk themselves once it holds
/// 64 MiB: a thread of its own makes the next ones ahead (a `cuMemCreate` of a large chunk has taken
/// tens of milliseconds on the growth's path). What it holds ahead stays within what it has mapped,
/// growth within the reservation never reserves or maps anything twice, and a small vector starts
/// no thread and holds nothing ahead.
#[test]
fn the_default_vector_makes_its_chunks_ahead_within_bounds_and_never_remaps() {
    let (_turn, lib, ctx) = fake_device();
    let (reserved, created, mapped) =
        (count(&lib, "cuMemAddressReserve"), count(&lib, "cuMemCreate"), count(&lib, "cuMemMap"));
    let here = thread_count(&lib, "cuMemCreate");

    // A small vector: no thread, nothing ahead.
    let mut small = VmmVec::<u32>::builder(&ctx).reserve_address_space(1 << 30).build().unwrap();
    small.reserve(3).unwrap();
    small.reserve(8 << 20).unwrap();
    assert_eq!(small.raw().ahead_bytes(), 0);
    assert_eq!(ahead_threads(), 0);
    drop(small);

    let mut v = VmmVec::<u8>::builder(&ctx).reserve_address_space(80 << 30).build().unwrap();
    let base = v.device_ptr();
    assert_eq!((v.mapped_bytes(), v.raw().ahead_bytes()), (0, 0), "build maps nothing");
    let step = 64 * MIB;
    for i in 1..=256 {
        // As appends of 64 MiB would grow it (reserve counts from the length, which stays 0).
        v.reserve(i * step).unwrap();
        let ahead = v.raw().ahead_bytes();
        assert!(ahead > 0, "step {i}: nothing is being made ahead");
        assert!(ahead <= v.mapped_bytes(), "step {i}: {ahead} bytes ahead of {} mapped", v.mapped_bytes());
        assert!(ahead <= 1 << 30, "step {i}: {ahead} bytes ahead");
    }
    assert_eq!(ahead_threads(), 1);
    // The first growth made its chunk (nothing was mapped to start from); none after it did.
    assert_eq!(thread_count(&lib, "cuMemCreate") - here, 3, "the small vector's two and the first growth's");
    assert_eq!(v.device_ptr(), base);
    assert_eq!(v.raw().reserved(), 80 << 30);
    // One reservation per vector; every chunk made was mapped once.
    assert_eq!(count(&lib, "cuMemAddressReserve") - reserved, 2);
    assert_eq!(count(&lib, "cuMemMap") - mapped, count(&lib, "cuMemCreate") - created);

    // A shrink gives back the chunks made ahead too.
    v.shrink_to_fit().unwrap();
    assert_eq!((v.mapped_bytes(), v.raw().ahead_bytes()), (0, 0));
    drop(v);
    // The drop joined the thread; the kernel drops it from /proc/self/task just after.
    let gone = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while ahead_threads() > 0 && std::time::Instant::now() < gone {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(ahead_threads(), 0);
}

/// Growth followed through a socket an event loop made non-blocking (a message that arrives in
/// parts included), and an importer that stops reading: neither stalls nor breaks the other side.
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
    // Part of a frame: "try again" at once, the part kept; the rest completes it. A receive that
    // waits for the rest instead would wait for ever: the watchdog ends the run then.
    let (done, watch) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            watch.recv_timeout(std::time::Duration::from_secs(30))
        {
            eprintln!("an import waited for the rest of a frame on a non-blocking socket");
            std::process::exit(1);
        }
    });
    (&a).write_all(&note[..1]).unwrap();
    let t = std::time::Instant::now();
    assert!(import.next_update().unwrap_err().is_would_block());
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "{:?}", t.elapsed());
    (&a).write_all(&note[1..100]).unwrap();
    // A deadline bounds the wait as well, and keeps the part too.
    let r = import.next_update_until(std::time::Instant::now() + std::time::Duration::from_millis(50));
    assert!(matches!(r, Err(cuvmm::Error::Timeout { received: 100, .. })), "{r:?}");
    (&a).write_all(&note[100..]).unwrap();
    assert_eq!(import.next_update().unwrap(), Update::Note { tag: 5 });
    drop(done);
    drop(a);
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

/// An importer reserves aligned to the granularity a message announces, which may be coarser than
/// its own (2 MiB on the fake), so that every chunk or range starts where the allocation maps.
#[test]
fn imports_reserve_aligned_to_the_announced_granularity() {
    let (_turn, _, ctx) = fake_device();
    use cuvmm::ipc::wire::{HandleType, Header, Message, Region, WireHandle};
    use cuvmm::ipc::{send_message, GrowableImport, PeerPolicy, SharedMemory};
    use cuvmm::vmm::Reservation;
    use std::os::fd::AsFd;
    const GIB: u64 = 1 << 30;
    // Reservations so far leave the next address off any 1 GiB boundary.
    let _odd = Reservation::new(&ctx, 2 * MIB).unwrap();
    let uuid = ctx.device().uuid().unwrap().0;
    let (a, b) = UnixStream::pair().unwrap();
    let region = Region::new(HandleType::PosixFd, 2 * GIB, GIB, uuid, 1).unwrap();
    send_message(a.as_fd(), &Message::Region(region), None).unwrap();
    let import = GrowableImport::accept(&ctx, b, PeerPolicy::SameUid, 4 << 30, &[]).unwrap();
    assert_eq!(import.ptr() % GIB, 0, "{:#x}", import.ptr());
    let _odd = Reservation::new(&ctx, 2 * MIB).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let fd = std::fs::File::open("/dev/null").unwrap();
    let h = Header::new(WireHandle::PosixFd, GIB, GIB, 0, GIB, uuid, 1).unwrap();
    send_message(a.as_fd(), &Message::Share(h), Some(fd.as_fd())).unwrap();
    let shared =
        SharedMemory::import(&ctx, common::recv(b.as_fd(), PeerPolicy::SameUid).unwrap(), &[]).unwrap();
    assert_eq!(shared.ptr() % GIB, 0, "{:#x}", shared.ptr());
}

/// `SharedMemory::import` takes any received message and refuses all but a share, naming its
/// kind and closing its fd, before anything reaches the driver.
#[test]
fn an_import_of_a_message_other_than_a_share_is_refused_and_closes_its_fd() {
    let (_turn, lib, ctx) = fake_device();
    use cuvmm::ipc::wire::{Grow, Message, WireHandle};
    use cuvmm::ipc::{send_message, PeerPolicy, SharedMemory};
    use std::os::fd::AsFd;
    let uuid = ctx.device().uuid().unwrap().0;
    let (a, b) = UnixStream::pair().unwrap();
    let fd = std::fs::File::open("/dev/null").unwrap();
    let grow = Grow::new(WireHandle::PosixFd, 2 * MIB as u64, 2 * MIB as u64, 0, uuid, 1).unwrap();
    send_message(a.as_fd(), &Message::Grow(grow), Some(fd.as_fd())).unwrap();
    let open_fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let msg = common::recv(b.as_fd(), PeerPolicy::SameUid).unwrap();
    let (before, imports) = (open_fds(), count(&lib, "cuMemImportFromShareableHandle"));
    match SharedMemory::import(&ctx, msg, &[]) {
        Err(cuvmm::Error::UnexpectedMessage { got: cuvmm::ipc::wire::Kind::Grow, .. }) => {}
        Err(e) => panic!("a grow was refused for another reason: {e}"),
        Ok(_) => panic!("a grow was imported as a share"),
    }
    assert_eq!(open_fds(), before - 1, "the grow's fd was closed");
    assert_eq!(count(&lib, "cuMemImportFromShareableHandle"), imports, "nothing reached the driver");
}

#[test]
fn sharing_a_block_over_a_slow_socket_holds_up_no_other_allocation() {
    use cuvmm::alloc::{CachingAllocator, ExportMode, PeerAllocator};
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::time::Duration;
    let (_turn, _, ctx) = fake_device();
    let cache =
        CachingAllocator::new(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap(), 2 * MIB).unwrap();
    // A peer that does not read yet: the share's send waits until it does.
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    while (&a).write(&[0u8; 4096]).is_ok() {}
    a.set_nonblocking(false).unwrap();
    let block = cache.allocate_shareable(1).unwrap();
    let sharing = std::thread::spawn(move || block.share(a.as_fd(), 7).map(|_| ()));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!sharing.is_finished(), "the send did not wait for the peer");
    // Meanwhile every other use of the cache goes on.
    let (tx, rx) = std::sync::mpsc::channel();
    let other = cache.clone();
    std::thread::spawn(move || {
        let small = other.allocate(512).map(|b| b.len());
        let _ = tx.send((small, other.stats().in_use));
    });
    let (small, in_use) = rx.recv_timeout(Duration::from_secs(10)).expect("the cache is held by a send");
    assert_eq!(small.unwrap(), 512);
    assert!(in_use >= 2 * MIB);
    drop(b); // the peer goes: the send fails, and the block is released as shared memory is
    assert!(sharing.join().unwrap().is_err());
    cache.trim();
    assert_eq!(cache.stats().in_use, 0);
}

#[test]
fn a_module_is_loaded_from_ptx_text_only() {
    let (_turn, lib, ctx) = fake_device();
    let loads = || count(&lib, "cuModuleLoadData");
    let before = loads();
    // Text that starts as an ELF image is not PTX: refused before the driver parses it as one.
    for text in ["\x7fELF", "\x7fELF\x02\x01\x01 whatever follows"] {
        let e = cuvmm::module::Module::from_ptx(&ctx, text).err().expect("refused");
        assert!(e.to_string().contains("ELF"), "{e}");
    }
    assert!(cuvmm::module::Module::from_ptx(&ctx, "a\0b").is_err());
    assert_eq!(loads(), before);
    let m = cuvmm::module::Module::from_ptx(&ctx, ".version 8.0\n.target sm_90\n.address_size 64\n");
    assert!(m.is_ok());
    assert_eq!(loads(), before + 1);
}

#[test]
fn inside_a_host_function_the_driver_is_neither_loaded_nor_asked_for_error_text() {
    use cuvmm::driver::sys::CUresult;
    let (_turn, _, ctx) = fake_device();
    let d = driver().unwrap();
    let no_device = CUresult(100);
    let outside = d.api().check("cuTest", no_device).unwrap_err().to_string();
    assert!(outside.contains("no CUDA-capable device is detected"), "{outside}");
    let stream = cuvmm::Stream::new(&ctx).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // The fake driver runs a host function at once, on this thread.
    stream
        .launch_host_fn(move || {
            let load = cuvmm::driver::Driver::load_default();
            let checked = d.api().check("cuTest", no_device);
            let _ = tx.send((load.err().map(|e| e.kind()), checked.unwrap_err().to_string()));
        })
        .unwrap();
    let (load, inside) = rx.recv().unwrap();
    let load = load.expect("loading the driver is refused");
    assert_eq!(load, cuvmm::ErrorKind::InHostFunction);
    assert!(
        inside.contains("CUDA_ERROR_NO_DEVICE") && !inside.contains("no CUDA-capable device"),
        "{inside}"
    );
}

#[test]
fn requests_larger_than_the_device_are_refused_before_anything_is_built() {
    use cuvmm::alloc::{GraphMemory, StreamAllocator};
    let (_turn, lib, ctx) = fake_device();
    let memory = ctx.device().total_memory().unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let stream = cuvmm::Stream::new(&ctx).unwrap();
    let mut v = VmmVec::<u8>::builder(&ctx).reserve_address_space(1 << 30).build().unwrap();
    let reserved = count(&lib, "cuMemAddressReserve");
    let larger = |e: cuvmm::Error| e.kind() == cuvmm::ErrorKind::Refused(cuvmm::Refusal::LargerThanDevice);
    // isize::MAX once aborted the process: a page table of 2^41 entries was allocated first.
    for size in [memory + 1, 1 << 50, isize::MAX as usize - 4095, isize::MAX as usize, usize::MAX] {
        // SAFETY: the legacy stream (null) is always alive; nothing is allocated.
        let raw = unsafe { alloc.allocate_raw(size, std::ptr::null_mut(), GraphMemory::Keep) };
        assert!(raw.is_err_and(larger), "{size}");
        assert!(alloc.allocate(size, &stream).err().is_some_and(larger), "{size}");
        assert!(v.reserve(size).err().is_some_and(larger), "{size}");
    }
    assert_eq!(count(&lib, "cuMemAddressReserve"), reserved, "nothing was reserved for them");
    assert_eq!(alloc.stats().reserved, 0);
    assert_eq!(v.capacity(), 0);
}

/// `CUDA_ERROR_NOT_READY` from a stream or event query is a "no", not an error, in every query a
/// safe type makes; any other code stays an error that names the call.
#[cfg(feature = "fault-injection")]
#[test]
fn a_query_that_is_not_ready_answers_no_and_other_codes_name_the_call() {
    use cuvmm::driver::sys::CUresult;
    use cuvmm::{faults, Event, Stream};
    let (_turn, _lib, ctx) = fake_device();
    let stream = Stream::new(&ctx).unwrap();
    let event = Event::new(&ctx).unwrap();
    event.record(&stream).unwrap();

    faults::inject("cuStreamQuery", 0, CUresult::ERROR_NOT_READY);
    assert!(!stream.is_idle().unwrap(), "a stream with work queued is not idle");
    assert!(stream.is_idle().unwrap(), "the fake's streams are idle otherwise");
    faults::inject("cuEventQuery", 0, CUresult::ERROR_NOT_READY);
    assert!(!event.is_complete().unwrap(), "an event whose work is queued is not complete");
    assert!(event.is_complete().unwrap());

    faults::inject("cuStreamQuery", 0, CUresult::ERROR_ILLEGAL_ADDRESS);
    let err = stream.is_idle().unwrap_err();
    assert!(
        matches!(
            err,
            cuvmm::Error::Driver { call: "cuStreamQuery", code: CUresult::ERROR_ILLEGAL_ADDRESS, .. }
        ),
        "{err}"
    );
    faults::inject("cuEventQuery", 0, CUresult::ERROR_ILLEGAL_ADDRESS);
    let err = event.is_complete().unwrap_err();
    assert!(
        matches!(
            err,
            cuvmm::Error::Driver { call: "cuEventQuery", code: CUresult::ERROR_ILLEGAL_ADDRESS, .. }
        ),
        "{err}"
    );
    assert_eq!(faults::clear(), 0);
}

/// A failing call costs its code until the error is read: a polling query's NOT_READY asks the
/// driver for no name or text, and a displayed error asks once for each.
#[cfg(feature = "fault-injection")]
#[test]
fn a_driver_error_asks_for_its_name_and_text_only_when_displayed() {
    use cuvmm::driver::sys::CUresult;
    use cuvmm::{faults, Stream};
    let (_turn, lib, ctx) = fake_device();
    let stream = Stream::new(&ctx).unwrap();
    let asked = || thread_count(&lib, "cuGetErrorName") + thread_count(&lib, "cuGetErrorString");
    let before = asked();
    for _ in 0..100 {
        faults::inject("cuStreamQuery", 0, CUresult::ERROR_NOT_READY);
        assert!(!stream.is_idle().unwrap());
    }
    faults::inject("cuStreamQuery", 0, CUresult::ERROR_NO_DEVICE);
    let err = stream.is_idle().unwrap_err();
    let moved = err.clone();
    assert_eq!(asked(), before, "neither the polls nor making and moving an error asked the driver");
    assert_eq!(moved.driver_name().as_deref(), Some("CUDA_ERROR_NO_DEVICE"));
    assert_eq!(
        err.to_string(),
        "cuStreamQuery failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"
    );
    assert_eq!(asked(), before + 3, "the name (twice) and the text, when read");
    assert_eq!(faults::clear(), 0);
}

/// A destructor cannot return its driver call's failure: it is kept for the caller to read.
#[cfg(feature = "fault-injection")]
#[test]
fn a_destructors_failure_is_kept_for_the_caller() {
    use cuvmm::driver::sys::CUresult;
    use cuvmm::vmm::PhysicalMemory;
    use cuvmm::{faults, take_drop_error};
    let (_turn, _lib, ctx) = fake_device();
    let phys = PhysicalMemory::builder(&ctx).create(2 << 20).unwrap();
    let _ = take_drop_error();
    let count = cuvmm::drop_error_count();
    faults::inject("cuMemRelease", 0, CUresult::ERROR_INVALID_VALUE);
    drop(phys);
    cuvmm::driver::callback::flush_deferred_releases().unwrap();
    let err = take_drop_error().expect("the failed release was recorded");
    assert!(matches!(err, cuvmm::Error::Driver { call: "cuMemRelease", .. }), "{err}");
    assert_eq!(cuvmm::drop_error_count(), count + 1);
    assert!(take_drop_error().is_none(), "taking it clears it");
    assert_eq!(faults::clear(), 0);
}

/// A mapping whose users' work could not be waited for stays mapped: unmapping it under work that
/// may still run would fault that work (or let the addresses be mapped again under it).
#[cfg(feature = "fault-injection")]
#[test]
fn a_mapping_whose_device_wait_failed_is_never_unmapped() {
    use cuvmm::driver::sys::CUresult;
    use cuvmm::vmm::{PhysicalMemory, Reservation};
    use cuvmm::{faults, take_drop_error};
    let (_turn, lib, ctx) = fake_device();
    let phys = PhysicalMemory::builder(&ctx).create(2 << 20).unwrap();
    let res = Reservation::new(&ctx, 2 << 20).unwrap();
    let mapping = res.map_all(0, &phys).unwrap();
    let unmaps = count(&lib, "cuMemUnmap");
    faults::inject("cuCtxSynchronize", 0, CUresult::ERROR_ILLEGAL_ADDRESS);
    drop(mapping);
    cuvmm::driver::callback::flush_deferred_releases().unwrap();
    assert_eq!(count(&lib, "cuMemUnmap"), unmaps, "unmapped although its work may still run");
    let err = take_drop_error().expect("the failed wait was recorded");
    assert!(matches!(err, cuvmm::Error::Driver { call: "cuCtxSynchronize", .. }), "{err}");
    assert_eq!(faults::clear(), 0);
    // Without the failure, the next mapping's drop unmaps as ever.
    let mapping = Reservation::new(&ctx, 2 << 20).unwrap().map_all(0, &phys).unwrap();
    drop(mapping);
    cuvmm::driver::callback::flush_deferred_releases().unwrap();
    assert_eq!(count(&lib, "cuMemUnmap"), unmaps + 1);
}
