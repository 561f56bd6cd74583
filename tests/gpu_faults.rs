//! A driver call failing part-way through a VmmVec growth leaves the vector as it was and leaks
//! nothing. Needs `--features fault-injection` and a GPU.

mod common;

use cuvmm::driver::sys::CUresult;
use cuvmm::faults;
use cuvmm::vmm::ChunkPolicy;
use cuvmm::{Context, Error, ErrorKind, VmmVec};

const MIB: usize = 1 << 20;

fn used(ctx: &Context) -> usize {
    ctx.memory_info().unwrap().used()
}

/// Grows by three 2 MiB chunks with the `skip`-th call to `call` failing, checks nothing changed.
fn fail_growth(ctx: &Context, reserve: usize, call: &str, skip: usize) {
    let policy = ChunkPolicy { min_chunk: 2 * MIB, max_chunk: 2 * MIB, growth_percent: 0 };
    let mut v =
        VmmVec::<u32>::builder(ctx).chunk_policy(policy).reserve_address_space(reserve).build().unwrap();
    let data: Vec<u32> = (0..(MIB as u32)).map(|i| i ^ 0xa5a5_a5a5).collect(); // 4 MiB: two chunks
    v.extend_from_slice(&data).unwrap();
    let before = (v.device_ptr(), v.len(), v.mapped_bytes(), v.raw().chunk_count(), v.raw().reserved());
    faults::inject(call, skip, CUresult::ERROR_OUT_OF_MEMORY);
    let err = v.reserve(3 * MIB / 2).unwrap_err(); // 6 MiB more: three chunks
    assert_eq!(faults::clear(), 0, "the fault in {call} was not reached");
    assert!(err.is_out_of_memory(), "{call}: {err}");
    assert!(matches!(&err, Error::Driver { call: c, .. } if *c == call), "{err}");
    let after = (v.device_ptr(), v.len(), v.mapped_bytes(), v.raw().chunk_count(), v.raw().reserved());
    assert_eq!(before, after, "{call} #{skip}");
    assert_eq!(v.to_vec().unwrap(), data);
    // And the vector still grows.
    v.reserve(3 * MIB / 2).unwrap();
    v.push(7).unwrap();
    assert_eq!(v.get(data.len()).unwrap(), Some(7));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_failing_driver_call_in_a_growth_leaves_the_vector_intact() {
    let ctx = Context::for_ordinal(0).unwrap();
    fail_growth(&ctx, 64 * MIB, "cuMemCreate", 0); // warm-up, and a first check
    let baseline = used(&ctx);
    for call in ["cuMemCreate", "cuMemMap", "cuMemSetAccess"] {
        for skip in 0..3 {
            // Inside the reservation.
            fail_growth(&ctx, 64 * MIB, call, skip);
            // Past it: the relocation path (the existing two chunks are re-mapped first).
            fail_growth(&ctx, 4 * MIB, call, skip);
        }
    }
    fail_growth(&ctx, 4 * MIB, "cuMemAddressReserve", 0);
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

use cuvmm::alloc::{CachingAllocator, ExportMode, PeerAllocator};
use cuvmm::host::Staging;
use cuvmm::host::{RegisterFlags, Registered};
use cuvmm::ipc::{GrowableImport, PeerPolicy, SharedMemory, Update};
use cuvmm::vmm::{Access, HandleTypes, PhysicalMemory, Reservation, Striped};
use cuvmm::{DeviceBuffer, PinnedBuffer, Stream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Injects a failure into the `skip`-th call to `call`, runs `op`, and checks that it failed with
/// exactly that error and that the fault was reached.
fn failing<T>(call: &str, skip: usize, op: impl FnOnce() -> cuvmm::Result<T>) {
    faults::inject(call, skip, CUresult::ERROR_OUT_OF_MEMORY);
    let r = op();
    let left = faults::clear();
    match r {
        Err(e) => {
            assert_eq!(left, 0, "{call} #{skip}: failed, but not through the injected fault: {e}");
            assert!(e.is_out_of_memory(), "{call} #{skip}: {e}");
        }
        Ok(_) => assert_eq!(left, 1, "{call} #{skip}: the fault was consumed yet the operation succeeded"),
    }
}

/// A shared vector whose new chunk cannot be exported does not grow, and its importer never hears
/// of the chunk; an importer that fails to import, map or grant a chunk keeps what it mapped and
/// stops there.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failing_export_or_import_of_a_shared_chunk_leaves_both_sides_as_they_were() {
    let ctx = Context::for_ordinal(0).unwrap();
    let policy = ChunkPolicy { min_chunk: 2 * MIB, max_chunk: 2 * MIB, growth_percent: 0 };
    let mut v = VmmVec::<u32>::builder(&ctx)
        .handle_types(HandleTypes::POSIX_FD)
        .chunk_policy(policy)
        .reserve_address_space(64 * MIB)
        .build()
        .unwrap();
    let (x, y) = UnixStream::pair().unwrap();
    // A message that never comes fails the test instead of hanging it.
    y.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
    v.share_growth(x, 0).unwrap();
    let mut imp = GrowableImport::accept(&ctx, y, PeerPolicy::SameUid, 1 << 30, &[]).unwrap();
    let data: Vec<u32> = (0..(MIB as u32)).collect(); // 4 MiB: two chunks
    v.extend_from_slice(&data).unwrap();
    for _ in 0..2 {
        assert!(matches!(imp.next_update().unwrap(), Update::Grew { .. }));
    }
    for skip in 0..2 {
        let before = (v.len(), v.mapped_bytes(), v.raw().chunk_count());
        faults::inject("cuMemExportToShareableHandle", skip, CUresult::ERROR_OUT_OF_MEMORY);
        let err = v.reserve(3 * MIB / 2).unwrap_err(); // 6 MiB more: three chunks
        assert_eq!(faults::clear(), 0, "export #{skip} was not reached");
        assert!(err.is_out_of_memory(), "export #{skip}: {err}");
        assert_eq!((v.len(), v.mapped_bytes(), v.raw().chunk_count()), before, "export #{skip}");
        assert_eq!(v.importer_count(), 1);
    }
    // The importer heard of none of it: the next thing it receives is the next note, and then
    // the next growth that works.
    v.notify_importers(1).unwrap();
    assert_eq!(imp.next_update().unwrap(), Update::Note { tag: 1 });
    v.push(7).unwrap();
    assert_eq!(imp.next_update().unwrap(), Update::Grew { offset: 4 * MIB, size: 2 * MIB, tag: 0 });
    assert_eq!(v.to_vec().unwrap()[..MIB], data[..]);

    // A late importer receives the region and three chunks; its second chunk fails.
    for call in ["cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess"] {
        let (x, y) = UnixStream::pair().unwrap();
        y.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
        v.share_growth(x, 0).unwrap();
        let mut late = GrowableImport::accept(&ctx, y, PeerPolicy::SameUid, 1 << 30, &[]).unwrap();
        assert!(matches!(late.next_update().unwrap(), Update::Grew { offset: 0, .. }));
        let fds = open_fds();
        faults::inject(call, 0, CUresult::ERROR_OUT_OF_MEMORY);
        let err = late.next_update().unwrap_err();
        assert_eq!(faults::clear(), 0, "{call} was not reached");
        assert!(err.is_out_of_memory(), "{call}: {err}");
        assert!(late.next_update().unwrap_err().is_out_of_memory(), "{call}: the error stays");
        assert_eq!((late.mapped(), late.chunks().len()), (2 * MIB, 1), "{call}");
        let mut first = [0u32; 4];
        late.copy_to_host(0, &mut first).unwrap();
        assert_eq!(first, [0, 1, 2, 3], "{call}");
        assert_eq!(open_fds(), fds, "{call}: the chunk's fd leaked");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_vmm_type_stays_consistent_and_leaks_nothing_when_a_driver_call_fails() {
    let ctx = Context::for_ordinal(0).unwrap();
    // Warm-up: every path once.
    drop(Striped::new(std::slice::from_ref(&ctx), 8 * MIB, 2 * MIB).unwrap());
    drop(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap().allocate(2 * MIB).unwrap());
    let baseline = used(&ctx);
    let fds = open_fds();

    // Physical memory and reservations.
    let b = PhysicalMemory::builder(&ctx);
    failing("cuMemCreate", 0, || b.create(2 * MIB));
    failing("cuMemAddressReserve", 0, || Reservation::new(&ctx, 4 * MIB));
    let va = Reservation::new(&ctx, 4 * MIB).unwrap();
    let phys = b.create(2 * MIB).unwrap();
    failing("cuMemMap", 0, || va.map(0, &phys, 0, 2 * MIB));
    assert!(!va.is_mapped(0, 2 * MIB), "a failed map must not be recorded");
    let m = va.map(0, &phys, 0, 2 * MIB).unwrap();
    failing("cuMemSetAccess", 0, || m.set_access(&[(ctx.device(), Access::ReadWrite)]));
    m.set_access(&[(ctx.device(), Access::ReadWrite)]).unwrap();
    assert_eq!(m.access(ctx.device()).unwrap(), Access::ReadWrite);
    drop((m, phys, va));

    // Striping: a failure at any chunk releases the chunks made before it.
    for (call, n) in [("cuMemCreate", 4), ("cuMemMap", 4), ("cuMemSetAccess", 1), ("cuMemAddressReserve", 1)]
    {
        for skip in 0..n {
            failing(call, skip, || Striped::new(std::slice::from_ref(&ctx), 8 * MIB, 2 * MIB));
        }
    }

    // The peer allocator and the cache.
    let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
    for call in ["cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"] {
        failing(call, 0, || alloc.allocate(4 * MIB));
    }
    let cache =
        CachingAllocator::new(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap(), 2 * MIB).unwrap();
    let kept = cache.allocate(4096).unwrap();
    let stats = cache.stats();
    failing("cuMemCreate", 0, || cache.allocate(8192)); // a new class needs a new chunk
    failing("cuMemMap", 0, || cache.allocate(5 * MIB)); // so does a large request
    assert_eq!(cache.stats(), stats, "a failed allocation changed the cache");
    let more = cache.allocate(8192).unwrap();
    drop((kept, more));
    cache.trim();

    // Out of memory for real, not injected: the allocator and the cache refuse and stay usable.
    let total = ctx.device().total_memory().unwrap();
    assert!(alloc.allocate(total).unwrap_err().is_out_of_memory());
    assert!(cache.allocate(total).unwrap_err().is_out_of_memory());
    assert_eq!(cache.allocate(512).unwrap().len(), 512);
    cache.trim();
    drop(cache);

    // Import: each step of it.
    let src = alloc.allocate(2 * MIB).unwrap();
    for (call, skip) in [
        ("cuMemImportFromShareableHandle", 0),
        ("cuMemAddressReserve", 0),
        ("cuMemMap", 0),
        ("cuMemSetAccess", 0),
    ] {
        let (x, y) = UnixStream::pair().unwrap();
        src.share(x.as_fd(), 0, src.len(), 1).unwrap();
        let msg = common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap();
        failing(call, skip, || SharedMemory::import(&ctx, msg, &[]));
    }
    drop(src);

    // Host memory.
    failing("cuMemHostAlloc", 0, || PinnedBuffer::<u8>::new(&ctx, MIB));
    let mut legacy = vec![7u8; MIB];
    failing("cuMemHostRegister", 0, || Registered::with(&ctx, &mut legacy, RegisterFlags::default(), |_| ()));
    assert!(legacy.iter().all(|&b| b == 7), "the caller's memory is untouched");
    Registered::with(&ctx, &mut legacy, RegisterFlags::default(), |_| ()).unwrap();

    // Staging: a DMA failing part-way returns the error, leaves no thread hanging, and the ring
    // still works afterwards.
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut staging = Staging::new(&ctx, MIB, 3, 4).unwrap();
    let data: Vec<u32> = (0..(5 * MIB / 4) as u32).collect();
    let mut dev = DeviceBuffer::<u32>::new(&ctx, data.len()).unwrap();
    for skip in [0, 2, 4] {
        failing("cuMemcpyHtoDAsync", skip, || staging.to_device(&st, &data, dev.as_mut_slice()));
        let mut back = vec![0u32; data.len()];
        failing("cuMemcpyDtoHAsync", skip, || staging.to_host(&st, dev.as_slice(), &mut back));
    }
    // Three slots for five chunks: the first two slots are handed on after a query.
    for skip in [0, 1] {
        failing("cuEventQuery", skip, || staging.to_device(&st, &data, dev.as_mut_slice()));
    }
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    assert_eq!(dev.to_vec().unwrap(), data);

    // A scoped copy failing: the scope reports it and synchronises the rest.
    let host = vec![3u32; 1024];
    let mut small = DeviceBuffer::<u32>::new(&ctx, 1024).unwrap();
    failing("cuMemcpyHtoDAsync", 0, || cuvmm::scope(|s| s.copy_to_device(&st, &host, small.as_mut_slice())));
    cuvmm::scope(|s| s.copy_to_device(&st, &host, small.as_mut_slice())).unwrap();
    assert_eq!(small.to_vec().unwrap(), host);

    // VmmVec: growth succeeds but the fill fails: the length stays, the contents too.
    let mut v = cuvmm::VmmVec::<u32>::new(&ctx).unwrap();
    v.extend_from_slice(&[1, 2, 3]).unwrap();
    failing("cuMemsetD32Async", 0, || v.resize(1 << 20, 9));
    assert_eq!(v.to_vec().unwrap(), [1, 2, 3]);
    failing("cuMemcpyHtoD", 0, || v.push(4));
    assert_eq!(v.to_vec().unwrap(), [1, 2, 3]);
    drop(v);
    drop((dev, small, staging, st, alloc));

    ctx.synchronize().unwrap();
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "memory: baseline {baseline}, after {after}");
    assert_eq!(open_fds(), fds, "an fd leaked");
}

const CHILD: &str = "CUVMM_FAULTS_CHILD";

/// The child of the scope test, in the copy of it the test started: a scope whose final
/// synchronisation fails. Must not return.
fn scope_child() -> ! {
    let ctx = Context::for_ordinal(0).unwrap();
    let st = cuvmm::Stream::non_blocking(&ctx).unwrap();
    let dev = cuvmm::DeviceBuffer::<u32>::from_slice(&ctx, &vec![7u32; 1 << 20]).unwrap();
    let mut host = vec![0u32; 1 << 20];
    let r = cuvmm::scope(|s| {
        let _landing = s.copy_to_host(&st, dev.as_slice(), &mut host)?;
        faults::inject("cuStreamSynchronize", 0, CUresult::ERROR_ILLEGAL_ADDRESS);
        Ok(())
    });
    // Reaching this line means the borrow of `host` ended without confirmed completion.
    println!("scope returned {r:?}; host[0] = {}", host[0]);
    std::process::exit(0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn scope_aborts_when_completion_cannot_be_confirmed() {
    use std::os::unix::process::ExitStatusExt;
    if std::env::var_os(CHILD).is_some() {
        scope_child();
    }
    let out = common::rerun_this_test().env(CHILD, "1").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(SIGABRT), "status {:?}, stderr: {stderr}", out.status);
    assert!(stderr.contains("cuvmm: cannot confirm that asynchronous copies"), "{stderr}");
    assert!(stderr.contains("cuStreamSynchronize failed"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("scope returned"));
}

/// POSIX's number for SIGABRT on Linux.
const SIGABRT: i32 = 6;

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_host_function_that_cannot_be_queued_is_dropped_once_and_never_run() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let ctx = Context::for_ordinal(0).unwrap();
    let st = cuvmm::Stream::non_blocking(&ctx).unwrap();
    let (drops, runs) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, r) = (Counted(Arc::clone(&drops)), Arc::clone(&runs));
    faults::inject("cuLaunchHostFunc", 0, CUresult::ERROR_INVALID_VALUE);
    let err = st
        .launch_host_fn(move || {
            let _c = c;
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Driver(CUresult::ERROR_INVALID_VALUE), "{err}");
    assert!(matches!(&err, Error::Driver { call: "cuLaunchHostFunc", .. }), "{err}");
    st.synchronize().unwrap();
    assert_eq!((drops.load(Ordering::SeqCst), runs.load(Ordering::SeqCst)), (1, 0));
    // And one that is queued runs once and is dropped once.
    let (c, r) = (Counted(Arc::clone(&drops)), Arc::clone(&runs));
    st.launch_host_fn(move || {
        let _c = c;
        r.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    st.synchronize().unwrap();
    assert_eq!((drops.load(Ordering::SeqCst), runs.load(Ordering::SeqCst)), (2, 1));
}
