//! Sharing across processes on a GPU. A multi-process test re-executes itself for the other side
//! (`common::rerun_this_test`), which `ipc_child` plays when the environment names its role.

mod common;

use cuvmm::alloc::{CachingAllocator, ExportMode, PeerAllocator};
use cuvmm::ipc::wire::{Header, WireHandle};
use cuvmm::ipc::{PeerPolicy, SharedMemory};
use cuvmm::kernels::Kernels;
use cuvmm::vmm::{Access, HandleTypes, PhysicalMemory};
use cuvmm::{Context, Device, Error, Stream};
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Child;
use std::sync::Mutex;

const MIB: usize = 1 << 20;
const ROLE: &str = "CUVMM_IPC_ROLE";
const SOCK: &str = "CUVMM_IPC_SOCKET";
/// fd counts and device memory are per process: these tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn used(ctx: &Context) -> usize {
    ctx.memory_info().unwrap().used()
}

fn listener() -> (UnixListener, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!(
        "cuvmm-ipc-{}-{:?}.sock",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_file(&path);
    (UnixListener::bind(&path).unwrap(), path)
}

fn spawn(role: &str, path: &std::path::Path) -> Child {
    common::rerun_this_test().env(ROLE, role).env(SOCK, path).spawn().unwrap()
}

/// Starts this binary as the other side in `role` and returns it with its connection; the socket
/// file is gone once connected.
fn child_on_socket(role: &str) -> (Child, UnixStream) {
    let (l, path) = listener();
    let child = spawn(role, &path);
    let (s, _) = l.accept().unwrap();
    let _ = std::fs::remove_file(path);
    (child, s)
}

fn byte(s: &mut UnixStream) -> u8 {
    let mut b = [0u8];
    s.read_exact(&mut b).unwrap();
    b[0]
}

/// The other side of a multi-process test, in the copy of it that `spawn` started: plays the role
/// the environment names and returns true, or returns false at once in the test itself.
fn ipc_child() -> bool {
    let Some(role) = std::env::var_os(ROLE) else { return false };
    let mut s = UnixStream::connect(std::env::var_os(SOCK).unwrap()).unwrap();
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    match role.to_str().unwrap() {
        "importer" | "crasher" => {
            let msg = common::recv(s.as_fd(), PeerPolicy::SameUid).unwrap();
            let seed = msg.message().tag() as u32;
            let mut shm = SharedMemory::import(&ctx, msg, &[]).unwrap();
            let n = shm.len() / 4;
            assert_eq!(
                k.count_pattern_mismatches(&st, &shm.as_slice::<u32>(), 0, seed).unwrap(),
                0,
                "exporter's pattern"
            );
            if role == "crasher" {
                s.write_all(&[1]).unwrap();
                std::process::abort();
            }
            k.pattern_u32(&st, &mut shm.as_mut_slice::<u32>(), 0, seed + 1).unwrap();
            st.synchronize().unwrap();
            assert_eq!(shm.as_slice::<u32>().len(), n);
            s.write_all(&[1]).unwrap();
            assert_eq!(byte(&mut s), 2); // the exporter has read our answer
        }
        "exporter" => {
            let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
            let mut a = alloc.allocate(8 * MIB).unwrap();
            k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 4242).unwrap();
            st.synchronize().unwrap();
            a.share(s.as_fd(), 0, a.len(), 4242).unwrap();
            assert_eq!(byte(&mut s), 1); // imported
            s.write_all(&[1]).unwrap();
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1)); // until SIGKILLed
            }
        }
        r if r.starts_with("exporter-dies-at-") => {
            let step: u32 = r["exporter-dies-at-".len()..].parse().unwrap();
            let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
            let mut a = alloc.allocate(4 * MIB).unwrap();
            k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 606).unwrap();
            st.synchronize().unwrap();
            match step {
                0 => {}
                1 => {
                    s.write_all(&posix_header(4 * MIB).encode().unwrap()[..70]).unwrap();
                }
                _ => {
                    a.share(s.as_fd(), 0, a.len(), 606).unwrap();
                }
            }
            std::process::abort();
        }
        r if r.starts_with("importer-dies-at-") => {
            let step: u32 = r["importer-dies-at-".len()..].parse().unwrap();
            if step >= 1 {
                let msg = common::recv(s.as_fd(), PeerPolicy::SameUid).unwrap();
                if step >= 2 {
                    let _shm = SharedMemory::import(&ctx, msg, &[]).unwrap();
                    std::process::abort();
                }
            }
            std::process::abort();
        }
        other => panic!("unknown role {other}"),
    }
    true
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pattern_crosses_processes_both_ways() {
    if ipc_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
    let mut a = alloc.allocate(6 * MIB).unwrap();
    let seed = 0x5eed_u32 ^ std::process::id();
    k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, seed).unwrap();
    st.synchronize().unwrap();
    let (mut child, mut s) = child_on_socket("importer");
    assert_eq!(a.share(s.as_fd(), 0, a.len(), seed as u64).unwrap(), WireHandle::PosixFd);
    assert_eq!(byte(&mut s), 1);
    assert_eq!(
        k.count_pattern_mismatches(&st, &a.as_slice::<u32>(), 0, seed + 1).unwrap(),
        0,
        "importer's answer"
    );
    s.write_all(&[2]).unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_importer_keeps_the_data_after_the_exporter_is_killed() {
    if ipc_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let (mut child, mut s) = child_on_socket("exporter");
    let shm = SharedMemory::import(&ctx, common::recv(s.as_fd(), PeerPolicy::SameUid).unwrap(), &[]).unwrap();
    s.write_all(&[1]).unwrap();
    assert_eq!(byte(&mut s), 1);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    for _ in 0..3 {
        assert_eq!(k.count_pattern_mismatches(&st, &shm.as_slice::<u32>(), 0, 4242).unwrap(), 0);
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let mut host = vec![0u32; 16];
    shm.copy_to_host(4 * MIB, &mut host).unwrap();
    assert_eq!(host[0], cuvmm::kernels::pattern_value((MIB) as u64, 4242));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_crashing_importer_leaves_the_exporter_unharmed_and_memory_comes_back() {
    if ipc_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let baseline = used(&ctx);
    {
        let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
        let mut a = alloc.allocate(64 * MIB).unwrap();
        k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 77).unwrap();
        st.synchronize().unwrap();
        let (mut child, mut s) = child_on_socket("crasher");
        a.share(s.as_fd(), 0, a.len(), 77).unwrap();
        assert_eq!(byte(&mut s), 1);
        assert!(!child.wait().unwrap().success(), "the importer aborted");
        // Still ours, still writable.
        k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 78).unwrap();
        assert_eq!(k.count_pattern_mismatches(&st, &a.as_slice::<u32>(), 0, 78).unwrap(), 0);
    }
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_exporter_killed_at_each_protocol_step_leaves_the_importer_working() {
    if ipc_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let fds = open_fds();
    for step in 0..3 {
        let (mut child, s) = child_on_socket(&format!("exporter-dies-at-{step}"));
        let r = cuvmm::ipc::recv_message(s.as_fd(), PeerPolicy::SameUid);
        assert!(!child.wait().unwrap().success());
        match (step, r) {
            // Nothing arrived: the end of the stream.
            (0, Ok(None)) => {}
            // Half a header arrived: a typed error.
            (1, Err(Error::PeerClosed { received, expected })) => {
                assert!(received > 0 && received < expected, "step {step}: {received} of {expected}")
            }
            // The whole message arrived before the exporter died: the memory is still there.
            (2, Ok(Some(msg))) => {
                let shm = SharedMemory::import(&ctx, msg, &[]).unwrap();
                assert_eq!(k.count_pattern_mismatches(&st, &shm.as_slice::<u32>(), 0, 606).unwrap(), 0);
            }
            (_, other) => panic!("step {step}: unexpected {:?}", other.map(|m| m.map(|m| *m.message()))),
        }
        drop(s);
        // This side still works.
        let mut b = cuvmm::DeviceBuffer::<u32>::new(&ctx, 1 << 20).unwrap();
        k.pattern_u32(&st, &mut b.as_mut_slice(), 0, step).unwrap();
        assert_eq!(k.count_pattern_mismatches(&st, &b.as_slice(), 0, step).unwrap(), 0);
    }
    assert_eq!(open_fds(), fds, "an fd leaked");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_importer_killed_at_each_protocol_step_leaves_the_exporter_working() {
    if ipc_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let baseline = used(&ctx);
    {
        let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
        let mut a = alloc.allocate(8 * MIB).unwrap();
        for step in 0..3u32 {
            k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 700 + step).unwrap();
            st.synchronize().unwrap();
            let (mut child, mut s) = child_on_socket(&format!("importer-dies-at-{step}"));
            // The importer may already be gone: sending then fails with a typed error, no signal.
            match a.share(s.as_fd(), 0, a.len(), 1) {
                Ok(_) | Err(Error::Os { .. }) => {}
                Err(e) => panic!("step {step}: unexpected {e}"),
            }
            let mut ack = [0u8];
            assert!(s.read_exact(&mut ack).is_err(), "a dead importer cannot acknowledge");
            assert!(!child.wait().unwrap().success());
            // Our allocation is untouched and still ours.
            assert_eq!(k.count_pattern_mismatches(&st, &a.as_slice::<u32>(), 0, 700 + step).unwrap(), 0);
        }
    }
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

fn posix_header(size: usize) -> Header {
    Header::new(WireHandle::PosixFd, size as u64, 2 * MIB as u64, 0, size as u64, [0; 16], 1).unwrap()
}

/// `header` and `fd` as `recv_message` hands them over, through a socket pair: receiving is the
/// only way to an `Incoming`. The caller keeps (and closes) its `fd`; the message carries a
/// duplicate.
fn delivered(header: &Header, fd: Option<BorrowedFd<'_>>) -> cuvmm::ipc::Incoming {
    let (a, b) = UnixStream::pair().unwrap();
    cuvmm::ipc::send_message(a.as_fd(), &cuvmm::ipc::Message::Share(*header), fd).unwrap();
    common::recv(b.as_fd(), PeerPolicy::SameUid).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn foreign_fds_oversized_headers_and_garbage_handles_are_typed_errors_without_leaks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let before = open_fds();
    let (r, w) = nix::unistd::pipe().unwrap();
    let memfd: OwnedFd =
        nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MemFdCreateFlag::empty()).unwrap();
    let devnull: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    for (name, fd) in [("/dev/null", devnull), ("memfd", memfd), ("pipe", r)] {
        let msg = delivered(&posix_header(2 * MIB), Some(fd.as_fd()));
        drop(fd);
        match SharedMemory::import(&ctx, msg, &[]) {
            Err(Error::Driver { call, .. }) => assert_eq!(call, "cuMemImportFromShareableHandle", "{name}"),
            Err(e) => panic!("{name}: unexpected error {e}"),
            Ok(_) => panic!("{name} was imported"),
        }
    }
    drop(w);
    assert_eq!(open_fds(), before, "an fd leaked");
    // A header announcing more than was exported, with the range inside what it announces (a
    // range outside it cannot be built: `Header::new` refuses it, and `recv` with it).
    let phys = PhysicalMemory::builder(&ctx).handle_types(HandleTypes::POSIX_FD).create(2 * MIB).unwrap();
    let fd = phys.export_fd().unwrap();
    for (offset, length) in [(0, 8 * MIB), (6 * MIB, 2 * MIB)] {
        let big = Header::new(
            WireHandle::PosixFd,
            8 * MIB as u64,
            2 * MIB as u64,
            offset as u64,
            length as u64,
            [0; 16],
            1,
        )
        .unwrap();
        match SharedMemory::import(&ctx, delivered(&big, Some(fd.as_fd())), &[]) {
            Err(e) if e.kind() == cuvmm::ErrorKind::Refused(cuvmm::Refusal::BeyondTheExport) => {}
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("an oversized header was accepted"),
        }
    }
    drop(fd);
    // The right size works.
    let fd = phys.export_fd().unwrap();
    assert_eq!(
        SharedMemory::import(&ctx, delivered(&posix_header(2 * MIB), Some(fd.as_fd())), &[]).unwrap().len(),
        2 * MIB
    );
    drop(fd);
    // Garbage fabric handles.
    for garbage in [[0u8; 64], [0xa5; 64]] {
        let h = Header::new(
            WireHandle::Fabric(garbage),
            2 * MIB as u64,
            2 * MIB as u64,
            0,
            2 * MIB as u64,
            [0; 16],
            1,
        )
        .unwrap();
        assert!(matches!(
            SharedMemory::import(&ctx, delivered(&h, None), &[]),
            Err(Error::Driver { .. }) | Err(Error::Unsupported { .. })
        ));
    }
    // A message whose fds do not match its handle type cannot reach `import`: `recv_message`
    // refuses it (tests/ipc_socket.rs) and no other code can make an `Incoming`.
    assert_eq!(open_fds(), before, "an fd leaked");
}

/// The aliasing model of `SharedMemory` in practice: a process that imports what it exported holds
/// two writable views of one memory, at two addresses. Writes through either are seen through
/// the other once ordered by the stream.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_allocation_imported_by_its_own_exporter_is_one_memory_under_two_writable_views() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let before = open_fds();
    let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
    let mut a = alloc.allocate(4 * MIB).unwrap();
    let (x, y) = UnixStream::pair().unwrap();
    a.share(x.as_fd(), MIB, 2 * MIB, 5).unwrap();
    let mut shm =
        SharedMemory::import(&ctx, common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap(), &[]).unwrap();
    drop((x, y));
    assert_eq!(shm.len(), 2 * MIB);
    assert_ne!(shm.ptr(), a.ptr() + MIB as u64, "a second mapping, not the exporter's");
    let words = (MIB / 4)..(3 * MIB / 4); // the shared range in the exporter's view, as u32s
    {
        // Both writable views alive at once.
        let mut mine = a.as_mut_slice::<u32>();
        let mut theirs = shm.as_mut_slice::<u32>();
        // The importer's side writes; the exporter's side sees it.
        k.pattern_u32(&st, &mut theirs, 0, 51).unwrap();
        assert_eq!(
            k.count_pattern_mismatches(&st, &mine.as_slice().slice(words.clone()).unwrap(), 0, 51).unwrap(),
            0
        );
        // The exporter's side writes; the importer's side sees it.
        let mut shared = mine.reborrow().slice_mut(words.clone()).unwrap();
        k.pattern_u32(&st, &mut shared, 0, 52).unwrap();
        assert_eq!(k.count_pattern_mismatches(&st, &theirs.as_slice(), 0, 52).unwrap(), 0);
    }
    st.synchronize().unwrap();
    // Host copies through the import read and write the same bytes.
    let mut host = vec![0u32; 4];
    shm.copy_to_host(8, &mut host).unwrap();
    assert_eq!(host[0], cuvmm::kernels::pattern_value(2, 52));
    shm.copy_from_host(0, &[7u32, 8, 9]).unwrap();
    let mut back = vec![0u32; 3];
    // SAFETY: the first three words of the shared range, inside the exporter's live allocation.
    let view = unsafe { cuvmm::DeviceSlice::<u32>::from_raw_parts(a.ptr() + MIB as u64, 3) };
    cuvmm::stream::copy::to_host(&ctx, &mut back, &view).unwrap();
    assert_eq!(back, [7, 8, 9]);
    drop(shm);
    // The exporter's memory outlives the import.
    assert_eq!(
        k.count_pattern_mismatches(
            &st,
            &a.as_slice::<u32>().slice(words.start + 3..words.end).unwrap(),
            3,
            52
        )
        .unwrap(),
        0
    );
    drop(a);
    assert_eq!(open_fds(), before, "an fd leaked");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fabric_is_refused_naming_imex_and_auto_falls_back_to_posix_fds() {
    let ctx = ctx();
    let imex = cuvmm::caps::ImexStatus::probe();
    match PeerAllocator::new(&ctx, &[], ExportMode::Fabric) {
        Err(Error::Unsupported { why, .. }) => {
            assert!(!imex.usable());
            assert!(why.contains("imex") || why.contains("IMEX") || why.contains("channel"), "{why}");
            eprintln!("fabric: {why}");
        }
        Ok(a) => assert_eq!(a.handle_types(), HandleTypes::FABRIC),
        Err(e) => panic!("unexpected {e}"),
    }
    let auto = PeerAllocator::new(&ctx, &[], ExportMode::Auto).unwrap();
    let expect = if imex.usable() { HandleTypes::FABRIC } else { HandleTypes::POSIX_FD };
    assert_eq!(auto.handle_types(), expect);
    eprintln!("auto chose {:?}", auto.handle_types());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_cache_reuses_blocks_trims_idle_chunks_and_returns_memory() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let baseline = used(&ctx);
    {
        let cache =
            CachingAllocator::new(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap(), 2 * MIB)
                .unwrap();
        assert!(matches!(cache.allocate(0), Err(Error::InvalidArgument(_))));
        let a = cache.allocate(1000).unwrap();
        assert_eq!(a.len(), 1024);
        let p = a.ptr();
        drop(a);
        assert_eq!(cache.allocate(700).unwrap().ptr(), p, "a freed block is reused");
        let blocks: Vec<_> = (0..2048).map(|_| cache.allocate(1024).unwrap()).collect();
        let mut ptrs: Vec<u64> = blocks.iter().map(|b| b.ptr()).collect();
        ptrs.sort();
        ptrs.dedup();
        assert_eq!(ptrs.len(), 2048, "no block handed out twice");
        let big = cache.allocate(5 * MIB).unwrap();
        assert_eq!(big.len(), 6 * MIB);
        let s = cache.stats();
        assert_eq!(s.in_use, 2048 * 1024 + 6 * MIB);
        assert_eq!(s.mapped, s.in_use + s.cached);
        drop(blocks);
        drop(big);
        assert_eq!(cache.stats().in_use, 0);
        let released = cache.trim();
        assert_eq!(released, s.mapped);
        assert_eq!(cache.stats(), cuvmm::alloc::CacheStats::default());
    }
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_allocate_free_and_export_from_one_cache() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let cache =
        CachingAllocator::new(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap(), 2 * MIB).unwrap();
    std::thread::scope(|sc| {
        for t in 0..8u32 {
            let (cache, ctx) = (cache.clone(), ctx.clone());
            sc.spawn(move || {
                let k = Kernels::load(&ctx).unwrap();
                let st = Stream::new(&ctx).unwrap();
                for i in 0..50u32 {
                    let size = 4096 << (i % 6);
                    let a = cache.allocate(size).unwrap();
                    // SAFETY: the block holds `size` bytes of mapped device memory while `a` lives.
                    let mut v = unsafe { cuvmm::DeviceSliceMut::<u32>::from_raw_parts(a.ptr(), size / 4) };
                    k.pattern_u32(&st, &mut v, 0, t * 1000 + i).unwrap();
                    assert_eq!(k.count_pattern_mismatches(&st, &v.as_slice(), 0, t * 1000 + i).unwrap(), 0);
                    if i % 10 == 0 {
                        // Export and import in this process: the imported view sees the same data.
                        // Carved blocks are refused; a dedicated one is exported.
                        let (x, y) = UnixStream::pair().unwrap();
                        assert!(matches!(a.share(x.as_fd(), 0), Err(e) if e.kind() == cuvmm::ErrorKind::Refused(cuvmm::Refusal::SharesItsAllocation)));
                        let d = cache.allocate_shareable(size).unwrap();
                        // SAFETY: the block holds at least `size` bytes of mapped device memory.
                        let mut dv =
                            unsafe { cuvmm::DeviceSliceMut::<u32>::from_raw_parts(d.ptr(), size / 4) };
                        k.pattern_u32(&st, &mut dv, 0, t * 1000 + i).unwrap();
                        d.share(x.as_fd(), (t * 100 + i) as u64).unwrap();
                        let shm = SharedMemory::import(
                            &ctx,
                            common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap(),
                            &[],
                        )
                        .unwrap();
                        assert_eq!(shm.len(), d.len());
                        assert_eq!(
                            k.count_pattern_mismatches(
                                &st,
                                &shm.as_slice::<u32>().slice(0..size / 4).unwrap(),
                                0,
                                t * 1000 + i
                            )
                            .unwrap(),
                            0
                        );
                    }
                }
            });
        }
    });
    assert_eq!(cache.stats().in_use, 0);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn access_exists_exactly_for_the_granted_devices() {
    let Some(_) = common::two_gpus() else { return };
    let devices = Device::all().unwrap();
    let (c0, c1) = (Context::new(devices[0]).unwrap(), Context::new(devices[1]).unwrap());
    let alloc = PeerAllocator::new(&c0, &[(devices[1], Access::Read)], ExportMode::PosixFd).unwrap();
    let mut a = alloc.allocate(16 * MIB).unwrap();
    assert_eq!(a.access(devices[0]).unwrap(), Access::ReadWrite);
    assert_eq!(a.access(devices[1]).unwrap(), Access::Read);
    for d in &devices[2..] {
        assert_eq!(a.access(*d).unwrap(), Access::None);
    }
    let (k0, k1) = (Kernels::load(&c0).unwrap(), Kernels::load(&c1).unwrap());
    let (s0, s1) = (Stream::new(&c0).unwrap(), Stream::new(&c1).unwrap());
    k0.pattern_u32(&s0, &mut a.as_mut_slice::<u32>(), 0, 31).unwrap();
    s0.synchronize().unwrap();
    // A kernel on the peer reads the owner's memory through the mapping.
    assert_eq!(k1.count_pattern_mismatches(&s1, &a.as_slice::<u32>(), 0, 31).unwrap(), 0);
    a.set_access(&[(devices[1], Access::ReadWrite)]).unwrap();
    assert_eq!(a.access(devices[1]).unwrap(), Access::ReadWrite);
    // Narrowing removes it.
    a.set_access(&[(devices[1], Access::None)]).unwrap();
    assert_eq!(a.access(devices[1]).unwrap(), Access::None);
    assert_eq!(a.access(devices[0]).unwrap(), Access::ReadWrite);
}

/// The environment variable that makes `a_shared_cache_block_exposes_exactly_the_block` play the
/// importing process.
const BLOCK_IMPORTER: &str = "CUVMM_IPC_BLOCK_IMPORTER";

/// A cache block travels as a physical allocation of its own: the importing process maps exactly
/// the block, reads its data, cannot reach past it, and the block's neighbours in the exporter's
/// cache stay out of its reach. Blocks carved from a shared chunk are refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_shared_cache_block_exposes_exactly_the_block() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    if let Some(path) = std::env::var_os(BLOCK_IMPORTER) {
        // The importing process.
        let mut s = UnixStream::connect(path).unwrap();
        let mut want = [0u8; 8];
        s.read_exact(&mut want).unwrap();
        let want = u64::from_le_bytes(want) as usize;
        let msg = common::recv(s.as_fd(), PeerPolicy::SameUid).unwrap();
        let mut shm = SharedMemory::import(&ctx, msg, &[]).unwrap();
        assert_eq!(shm.len(), want, "the shared range is the block");
        assert_eq!(shm.mapping().len(), want, "the whole imported allocation is the block");
        let mut word = [0u32; 1];
        assert!(matches!(shm.copy_to_host(want, &mut word), Err(Error::InvalidArgument(_))));
        assert!(matches!(shm.copy_to_host(want - 2, &mut word), Err(Error::InvalidArgument(_))));
        shm.copy_to_host(want - 4, &mut word).unwrap();
        assert_eq!(k.count_pattern_mismatches(&st, &shm.as_slice::<u32>(), 0, 71).unwrap(), 0);
        k.pattern_u32(&st, &mut shm.as_mut_slice::<u32>(), 0, 72).unwrap();
        st.synchronize().unwrap();
        s.write_all(&[1]).unwrap();
        assert_eq!(byte(&mut s), 2);
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let peer = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
    let gran = peer.granularity();
    let chunk = 4 * gran.max(2 * MIB);
    let cache = CachingAllocator::new(peer, chunk).unwrap();
    let fill = |ptr: u64, len: usize, seed: u32| {
        // SAFETY: `len` bytes of a live cache block.
        let mut v = unsafe { cuvmm::DeviceSliceMut::<u32>::from_raw_parts(ptr, len / 4) };
        k.pattern_u32(&st, &mut v, 0, seed).unwrap();
    };
    let intact = |ptr: u64, len: usize, seed: u32| {
        // SAFETY: as above.
        let v = unsafe { cuvmm::DeviceSlice::<u32>::from_raw_parts(ptr, len / 4) };
        k.count_pattern_mismatches(&st, &v, 0, seed).unwrap() == 0
    };
    // Carved blocks, the chunk's first one included, share their chunk: refused, nothing sent.
    let neighbours: Vec<_> = (0..3).map(|_| cache.allocate(4096).unwrap()).collect();
    for (i, b) in neighbours.iter().enumerate() {
        fill(b.ptr(), b.len(), 900 + i as u32);
        assert!(!b.is_shareable());
        let (x, y) = UnixStream::pair().unwrap();
        match b.share(x.as_fd(), 1) {
            Err(e) if e.kind() == cuvmm::ErrorKind::Refused(cuvmm::Refusal::SharesItsAllocation) => {}
            other => panic!("a carved block was exported: {other:?}"),
        }
        drop(x);
        let end = cuvmm::ipc::recv_message(y.as_fd(), PeerPolicy::SameUid);
        assert!(matches!(end, Ok(None)), "nothing was sent: {end:?}");
    }
    // Blocks that own their physical allocation can be shared: large requests, requests that fill
    // a chunk, and dedicated ones however small.
    assert!(cache.allocate(chunk + 1).unwrap().is_shareable());
    assert!(cache.allocate(chunk).unwrap().is_shareable());
    let block = cache.allocate_shareable(4096).unwrap();
    assert_eq!(block.len(), gran, "rounded up to the granularity");
    assert!(block.is_shareable());
    fill(block.ptr(), block.len(), 71);
    st.synchronize().unwrap();
    let before = cache.stats();

    let (l, path) = listener();
    let mut child = common::rerun_this_test().env(BLOCK_IMPORTER, &path).spawn().unwrap();
    let (mut s, _) = l.accept().unwrap();
    let _ = std::fs::remove_file(path);
    s.write_all(&(block.len() as u64).to_le_bytes()).unwrap();
    block.share(s.as_fd(), 7).unwrap();
    assert_eq!(byte(&mut s), 1, "imported");
    assert!(intact(block.ptr(), block.len(), 72), "the importer wrote the block");
    for (i, b) in neighbours.iter().enumerate() {
        assert!(intact(b.ptr(), b.len(), 900 + i as u32), "neighbour {i} untouched");
    }
    s.write_all(&[2]).unwrap();
    assert!(child.wait().unwrap().success(), "the importer's checks failed");
    // A block that was shared is released when dropped, never cached for another allocation.
    let len = block.len();
    drop(block);
    let after = cache.stats();
    assert_eq!(after.mapped, before.mapped - len);
    assert_eq!(after.cached, before.cached);
    assert_eq!(after.in_use, before.in_use - len);
}
