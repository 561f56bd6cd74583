//! Which driver calls cuvmm's VMM and sharing paths make, counted on the CPU against the fake
//! driver's FAKE_VMM mode (one device whose VMM entry points succeed and count their calls).
//!
//! The hand-written sequence these paths are judged against makes one driver call per step
//! (`cuMemMap`, `cuMemAddressReserve`, `cuMemExportToShareableHandle`…): every call beyond it is
//! listed here, with the reason it stays. With `--release -- --nocapture` the test also prints the
//! host time cuvmm adds around a `cuMemMap` that itself costs next to nothing.
//!
//! One test only: the driver is loaded once per process, from `CUVMM_LIBCUDA`, which must be set
//! before anything touches it.

mod common;

use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::driver::driver;
use cuvmm::ipc::{PeerPolicy, SharedMemory};
use cuvmm::vmm::{Access, Location, PhysicalMemory, Reservation};
use cuvmm::Context;
use std::ffi::{c_char, CString};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

const MIB: usize = 1 << 20;

/// The fake's call counters (a C `long`: 64 bits on the LP64 Linux targets cuvmm supports).
struct Counts {
    count: unsafe extern "C" fn(*const c_char) -> i64,
    reset: unsafe extern "C" fn(),
}

impl Counts {
    fn open(lib: &std::path::Path) -> Counts {
        let path = CString::new(lib.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: the fake driver is already loaded (RTLD_NOLOAD only finds it); its initialisers
        // have run.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(!h.is_null(), "the fake driver is not loaded");
        // SAFETY: both symbols are defined by fake_libcuda.c with these signatures.
        unsafe {
            let count = libc::dlsym(h, c"fake_count".as_ptr());
            let reset = libc::dlsym(h, c"fake_reset".as_ptr());
            assert!(!count.is_null() && !reset.is_null());
            Counts {
                count: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*const c_char) -> i64>(
                    count,
                ),
                reset: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn()>(reset),
            }
        }
    }

    fn reset(&self) {
        // SAFETY: no arguments; the counters are atomics.
        unsafe { (self.reset)() }
    }

    /// Every counted call made since the last reset, by name (calls made zero times left out),
    /// and the counters reset.
    fn take(&self) -> Vec<(&'static str, i64)> {
        const NAMES: [&str; 22] = [
            "cuDeviceGet",
            "cuDeviceGetAttribute",
            "cuDeviceGetName",
            "cuDeviceGetUuid",
            "cuDevicePrimaryCtxRetain",
            "cuDevicePrimaryCtxRelease",
            "cuCtxSetCurrent",
            "cuCtxGetCurrent",
            "cuCtxSynchronize",
            "cuMemGetAllocationGranularity",
            "cuMemCreate",
            "cuMemRelease",
            "cuMemAddressReserve",
            "cuMemAddressFree",
            "cuMemMap",
            "cuMemUnmap",
            "cuMemSetAccess",
            "cuMemGetAccess",
            "cuMemExportToShareableHandle",
            "cuMemImportFromShareableHandle",
            "cuMemGetAllocationPropertiesFromHandle",
            "cuDeviceGetCount",
        ];
        let out = NAMES
            .iter()
            .map(|n| {
                let c = CString::new(*n).unwrap();
                // SAFETY: a NUL-terminated name; the fake only compares it.
                (*n, unsafe { (self.count)(c.as_ptr()) })
            })
            .filter(|(_, k)| *k != 0)
            .collect();
        self.reset();
        out
    }
}

/// Asserts the calls made since the last reset, in the order of [`Counts::take`]'s list.
#[track_caller]
fn expect(counts: &Counts, what: &str, want: &[(&str, i64)]) {
    let got = counts.take();
    let mut want = want.to_vec();
    want.sort_by_key(|(n, _)| got.iter().position(|(g, _)| g == n).unwrap_or(usize::MAX));
    assert_eq!(got, want, "{what}");
}

#[test]
fn each_vmm_and_sharing_step_makes_only_the_calls_it_needs() {
    let lib = common::fake_driver("FAKE_VMM");
    // The only test of this process, and nothing has touched the driver yet.
    std::env::set_var(cuvmm::driver::LIBRARY_ENV, &lib);
    driver().expect("the fake driver loads");
    let counts = Counts::open(&lib);
    let ctx = Context::for_ordinal(0).unwrap();
    let dev = ctx.device();
    let rw = [(dev, Access::ReadWrite)];

    // Warm-up: the first use of each kind of memory asks the driver what it supports and its
    // granularity, once per process.
    let b = PhysicalMemory::builder(&ctx);
    let phys = b.create(2 * MIB).unwrap();
    let va = Reservation::new(&ctx, 64 * MIB).unwrap();
    drop(va.map(0, &phys, 0, 2 * MIB).unwrap());
    counts.take();

    // A fresh builder: one bind, one cuMemCreate; nothing asked again.
    let phys2 = PhysicalMemory::builder(&ctx).create(4 * MIB).unwrap();
    expect(&counts, "create", &[("cuCtxSetCurrent", 1), ("cuMemCreate", 1)]);

    // A reservation: one bind, one cuMemAddressReserve.
    let va2 = Reservation::new(&ctx, 8 * MIB).unwrap();
    expect(&counts, "reserve", &[("cuCtxSetCurrent", 1), ("cuMemAddressReserve", 1)]);

    // A map right after cuvmm bound this context on this thread: cuMemMap alone.
    let m = va.map(0, &phys, 0, 2 * MIB).unwrap();
    expect(&counts, "map", &[("cuMemMap", 1)]);
    m.set_access(&rw).unwrap();
    expect(&counts, "set access", &[("cuCtxSetCurrent", 1), ("cuMemSetAccess", 1)]);
    // Unmap: the synchronisation binds, the unmap reuses that binding.
    drop(m);
    expect(&counts, "unmap", &[("cuCtxSetCurrent", 1), ("cuCtxSynchronize", 1), ("cuMemUnmap", 1)]);

    // A thread cuvmm has not bound yet: bind, then map.
    std::thread::scope(|s| {
        s.spawn(|| {
            let m = va.map(2 * MIB, &phys, 0, 2 * MIB).unwrap();
            expect(&counts, "map on a fresh thread", &[("cuCtxSetCurrent", 1), ("cuMemMap", 1)]);
            drop(m);
            counts.take();
            // Code outside cuvmm leaves no context current: the fake refuses the map, as a driver
            // may, and cuvmm binds and maps again.
            // SAFETY: a null context is allowed: it unbinds.
            unsafe { cuvmm::driver::result::ctx::set_current(driver().unwrap().api(), std::ptr::null_mut()) }
                .unwrap();
            let m = va.map(2 * MIB, &phys, 0, 2 * MIB).unwrap();
            expect(
                &counts,
                "map after another library unbound the context",
                &[("cuCtxSetCurrent", 2), ("cuMemMap", 2)],
            );
            drop(m);
        });
    });
    counts.take();

    // Sharing: the exporter exports and sends; nothing else reaches the driver (granularity and
    // the device's UUID, which go into the message, are known by now).
    let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap();
    let a = alloc.allocate(4 * MIB).unwrap();
    let (x, y) = UnixStream::pair().unwrap();
    a.share(x.as_fd(), 0, a.len(), 7).unwrap(); // warm-up: the UUID is asked once
    drop(common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap());
    counts.take();
    a.share(x.as_fd(), 0, a.len(), 7).unwrap();
    expect(&counts, "share", &[("cuCtxSetCurrent", 1), ("cuMemExportToShareableHandle", 1)]);

    // The importer, step by step as `cuvmm bench ipc` times it.
    let msg = common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap();
    let size = msg.share().expect("a share").size() as usize;
    let (_, fd, _) = msg.into_parts();
    let imported = PhysicalMemory::import_fd(&ctx, fd.unwrap().as_fd(), size).unwrap();
    expect(&counts, "import", &[("cuCtxSetCurrent", 1), ("cuMemImportFromShareableHandle", 1)]);
    let va3 = Reservation::new(&ctx, size).unwrap();
    let m3 = va3.map(0, &imported, 0, size).unwrap();
    m3.set_access(&rw).unwrap();
    expect(
        &counts,
        "import: reserve, map, access",
        &[("cuCtxSetCurrent", 2), ("cuMemAddressReserve", 1), ("cuMemMap", 1), ("cuMemSetAccess", 1)],
    );
    // Where imported memory lives is asked only when wanted, and once.
    assert_eq!(imported.location(), Location::Device(dev));
    assert_eq!(imported.location(), Location::Device(dev));
    expect(
        &counts,
        "location of imported memory",
        &[("cuCtxSetCurrent", 1), ("cuMemGetAllocationPropertiesFromHandle", 1)],
    );
    drop((m3, va3, imported));
    counts.take();

    // SharedMemory::import: the same four driver steps.
    a.share(x.as_fd(), 0, a.len(), 8).unwrap();
    let msg = common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap();
    counts.take();
    let shared = SharedMemory::import(&ctx, msg, &[]).unwrap();
    expect(
        &counts,
        "SharedMemory::import",
        &[
            ("cuCtxSetCurrent", 3),
            ("cuMemAddressReserve", 1),
            ("cuMemMap", 1),
            ("cuMemSetAccess", 1),
            ("cuMemImportFromShareableHandle", 1),
        ],
    );
    drop(shared);

    // What cuvmm adds to a cuMemMap on the host, against the same call made raw: a thousand maps
    // into distinct 2 MiB slots of one reservation each way, the crate's unmapped afterwards.
    let slots = 1000;
    let big = Reservation::new(&ctx, slots * 2 * MIB).unwrap();
    let api = driver().unwrap().api();
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        ctx.bind().unwrap();
        let t = Instant::now();
        let maps: Vec<_> = (0..slots).map(|i| big.map(i * 2 * MIB, &phys, 0, 2 * MIB).unwrap()).collect();
        let ours = t.elapsed().as_secs_f64() * 1e9 / slots as f64;
        drop(maps);
        let t = Instant::now();
        for i in 0..slots {
            // SAFETY: the fake's cuMemMap only counts; nothing is mapped.
            unsafe {
                cuvmm::driver::result::mem::map(
                    api,
                    big.base() + (i * 2 * MIB) as u64,
                    2 * MIB,
                    0,
                    phys.handle(),
                )
            }
            .unwrap();
        }
        let raw = t.elapsed().as_secs_f64() * 1e9 / slots as f64;
        best = (best.0.min(ours), best.1.min(raw));
    }
    println!(
        "host ns per map: Reservation::map {:.1}, raw cuMemMap {:.1}, cuvmm adds {:.1} (best of 5 batches of {slots})",
        best.0,
        best.1,
        best.0 - best.1
    );
    // As `cuvmm bench vmm-ops` times it: one slot, mapped and unmapped in turn, each map timed.
    let one = Reservation::new(&ctx, 2 * MIB).unwrap();
    let (mut ours, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..20_000 {
        let t = Instant::now();
        let m = one.map(0, &phys, 0, 2 * MIB).unwrap();
        ours.push(t.elapsed().as_nanos() as f64);
        drop(m);
        let t = Instant::now();
        // SAFETY: the fake's cuMemMap only counts; nothing is mapped.
        unsafe { cuvmm::driver::result::mem::map(api, one.base(), 2 * MIB, 0, phys.handle()) }.unwrap();
        raw.push(t.elapsed().as_nanos() as f64);
    }
    ours.sort_by(f64::total_cmp);
    raw.sort_by(f64::total_cmp);
    println!(
        "one slot, median ns per timed map: Reservation::map {:.0}, raw cuMemMap {:.0}",
        ours[ours.len() / 2],
        raw[raw.len() / 2]
    );
    drop((phys2, va2, a, alloc, b));
}
