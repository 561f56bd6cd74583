//! Sharing a `StreamAllocator`'s blocks with other processes, on the CPU against the fake driver's
//! FAKE_VMM device (its exports are real descriptors): which pages a block exports, that an import
//! and its release leave no descriptor, mapping or reservation behind, and the marks' accounting.

mod common;

use common::{count, fake_device, fake_symbol};

use cuvmm::alloc::{AllocatorConfig, BlockImport, BlockRange, GraphMemory, StreamAllocator};
use std::os::fd::AsFd;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The fake driver's handle that an exported descriptor names.
fn handle_of(fd: &std::os::fd::OwnedFd) -> String {
    use std::os::fd::AsRawFd;
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    let name = link.to_string_lossy().into_owned();
    name.split("fake-handle-").nth(1).unwrap().split(' ').next().unwrap().to_owned()
}

#[test]
fn a_block_exports_the_pages_under_it_and_a_thousand_round_trips_leave_nothing_behind() {
    let (_turn, lib, ctx) = fake_device();
    let config = AllocatorConfig { page: 2 * MIB, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    // SAFETY: the legacy default stream; the block is freed below, before the allocator goes.
    let small = unsafe { alloc.allocate_raw(4096, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    // SAFETY: as above.
    let big = unsafe { alloc.allocate_raw(5 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    assert_eq!(alloc.owner_of(big + 12345), Some(BlockRange { start: big, len: 5 * MIB as u64 }));
    assert_eq!(alloc.owner_of(small + 4096), None, "past the small block");

    let fds0 = open_fds();
    let exports = count(&lib, "cuMemExportToShareableHandle");
    let (created, released) = (count(&lib, "cuMemCreate"), count(&lib, "cuMemRelease"));
    let (maps, unmaps) = (count(&lib, "cuMemMap"), count(&lib, "cuMemUnmap"));
    let (reserves, frees) = (count(&lib, "cuMemAddressReserve"), count(&lib, "cuMemAddressFree"));
    for round in 0..1000 {
        let e = alloc.export(big + 100).unwrap();
        assert_eq!((e.share.block, e.share.len, e.share.page), (big, 5 * MIB as u64, 2 * MIB));
        // 5 MiB from a page boundary: three pages.
        assert_eq!((e.fds.len(), e.share.first_page), (3, big.get() / (2 * MIB as u64) * (2 * MIB as u64)));
        assert_eq!(alloc.stats().exported, 5 * MIB as u64);
        let borrowed: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
        let imported = BlockImport::import(&ctx, &borrowed, e.share.page, &[]).unwrap();
        assert_eq!(imported.len(), 6 * MIB);
        if round == 0 {
            assert_eq!(count(&lib, "cuMemImportFromShareableHandle"), 3);
        }
        drop(imported);
        drop(e);
        alloc.unexport(big).unwrap();
    }
    assert_eq!(alloc.stats().exported, 0);
    assert_eq!(count(&lib, "cuMemExportToShareableHandle") - exports, 3, "each page exported once");
    assert_eq!(open_fds(), fds0 + 3, "every descriptor handed out closed; one kept for each page");
    assert_eq!(count(&lib, "cuMemCreate") - created, 0, "an export creates nothing");
    assert_eq!(count(&lib, "cuMemRelease") - released, 3000, "every imported handle released");
    assert_eq!(count(&lib, "cuMemMap") - maps, 3000);
    assert_eq!(count(&lib, "cuMemUnmap") - unmaps, 3000, "every imported page unmapped");
    assert_eq!(count(&lib, "cuMemAddressReserve") - reserves, 1000);
    assert_eq!(count(&lib, "cuMemAddressFree") - frees, 1000, "every import's address space freed");
    assert!(alloc.unexport(big).is_err(), "nothing shared any more");
    assert!(BlockImport::import(&ctx, &[], 2 * MIB, &[]).is_err(), "nothing to import");
    // The owner named among the peers is granted once; the import, dropped at once, leaves nothing.
    let e = alloc.export(big).unwrap();
    let borrowed: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
    let maps = count(&lib, "cuMemMap") - count(&lib, "cuMemUnmap");
    let peer = cuvmm::Device::get(0).unwrap();
    assert!(
        BlockImport::import(&ctx, &borrowed, e.share.page, &[peer]).is_ok(),
        "the owner itself is no peer"
    );
    assert_eq!(count(&lib, "cuMemMap") - count(&lib, "cuMemUnmap"), maps);
    drop(e);
    alloc.unexport(big).unwrap();
    // SAFETY: the blocks came from this allocator on the legacy stream and are freed once.
    unsafe {
        alloc.free_raw(small, std::ptr::null_mut()).unwrap();
        alloc.free_raw(big, std::ptr::null_mut()).unwrap();
    }
    assert!(alloc.export(big).is_err(), "a freed block");
    alloc.empty_cache().unwrap();
    assert_eq!(open_fds(), fds0, "the kept descriptors closed with their pages");
}

#[test]
fn a_block_at_the_address_of_a_freed_one_exports_its_own_pages() {
    let (_turn, lib, ctx) = fake_device();
    let config = AllocatorConfig { page: 2 * MIB, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    let fds0 = open_fds();
    // SAFETY: the legacy default stream; each block is freed once below.
    let a = unsafe { alloc.allocate_raw(4 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    let (e1, e2) = (alloc.export(a).unwrap(), alloc.export(a).unwrap());
    let first: Vec<String> = e1.fds.iter().map(handle_of).collect();
    let again: Vec<String> = e2.fds.iter().map(handle_of).collect();
    assert_eq!(first, again, "the same pages, their exports kept");
    assert_eq!((e1.share.pages.len(), &e1.share.pages), (2, &e2.share.pages), "the same serials");
    drop((e1.fds, e2.fds));
    alloc.unexport(a).unwrap();
    alloc.unexport(a).unwrap();
    // SAFETY: as above.
    unsafe { alloc.free_raw(a, std::ptr::null_mut()).unwrap() };
    alloc.empty_cache().unwrap();
    assert_eq!(open_fds(), fds0, "released pages close their kept descriptors");
    let exports = count(&lib, "cuMemExportToShareableHandle");
    // SAFETY: as above.
    let b = unsafe { alloc.allocate_raw(4 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    assert_eq!(b, a, "the same address, on new pages");
    let e3 = alloc.export(b).unwrap();
    let fresh: Vec<String> = e3.fds.iter().map(handle_of).collect();
    assert_eq!(count(&lib, "cuMemExportToShareableHandle") - exports, 2);
    assert!(
        e3.share.pages.iter().all(|s| !e1.share.pages.contains(s)),
        "new pages, new serials: {:?}",
        e3.share.pages
    );
    assert!(fresh.iter().all(|h| !first.contains(h)), "{fresh:?} names a released page of {first:?}");
    alloc.unexport(b).unwrap();
    // SAFETY: as above.
    unsafe { alloc.free_raw(b, std::ptr::null_mut()).unwrap() };
}

#[test]
fn above_the_export_threshold_a_block_is_one_exportable_allocation() {
    let (_turn, lib, ctx) = fake_device();
    let config = AllocatorConfig { page: 2 * MIB, export_threshold: 8 * MIB, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    let created = count(&lib, "cuMemCreate");
    // SAFETY: the legacy default stream; freed below, before the allocator goes.
    let big = unsafe { alloc.allocate_raw(19 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    assert_eq!(count(&lib, "cuMemCreate") - created, 1, "one physical allocation");
    let e = alloc.export(big).unwrap();
    assert_eq!((e.fds.len(), e.share.page, e.share.first_page), (1, 20 * MIB, big.get()));
    // Its one page is 20 MiB, no power of two: the import aligns to what divides it.
    let borrowed: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
    let imported = BlockImport::import(&ctx, &borrowed, e.share.page, &[]).unwrap();
    assert_eq!(imported.len(), 20 * MIB);
    assert_eq!(imported.ptr() % (4 * MIB as u64), 0, "aligned to 4 MiB, the power of two dividing 20 MiB");
    drop(imported);
    drop(e);
    alloc.unexport(big).unwrap();
    // SAFETY: as above.
    let small = unsafe { alloc.allocate_raw(7 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    assert_eq!(alloc.export(small).unwrap().fds.len(), 4, "below the threshold: ordinary pages");
    alloc.unexport(small).unwrap();
    // SAFETY: both came from this allocator on the legacy stream and are freed once.
    unsafe {
        alloc.free_raw(big, std::ptr::null_mut()).unwrap();
        alloc.free_raw(small, std::ptr::null_mut()).unwrap();
    }
    let released = count(&lib, "cuMemRelease");
    assert!(alloc.empty_cache().unwrap() >= 20 * MIB);
    assert!(count(&lib, "cuMemRelease") - released >= 1);
}

#[test]
fn a_block_freed_while_imported_keeps_its_memory_from_later_blocks_until_let_go() {
    let (_turn, lib, ctx) = fake_device();
    let config = AllocatorConfig { page: 2 * MIB, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    let len = 6 * MIB as u64;
    // SAFETY: the legacy default stream; freed once below.
    let big = unsafe { alloc.allocate_raw(len as usize, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    let e = alloc.export(big).unwrap();
    let borrowed: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
    let imported = BlockImport::import(&ctx, &borrowed, e.share.page, &[]).unwrap();
    drop(e);
    // What FSDP's `storage.resize_(0)` does to a parameter a reader still maps.
    // SAFETY: from this allocator on the legacy stream, freed once.
    unsafe { alloc.free_raw(big, std::ptr::null_mut()).unwrap() };
    let s = alloc.stats();
    assert_eq!((s.live, s.exported, s.freed_shared), (0, 0, len));
    assert_eq!(alloc.owner_of(big), None);
    assert!(alloc.unexport(big + 4096).is_err(), "named by its address only");
    let released = count(&lib, "cuMemRelease");
    alloc.empty_cache().unwrap();
    assert_eq!(count(&lib, "cuMemRelease"), released, "its pages stay mapped here");
    let mut later = Vec::new();
    for n in [len, len, len / 2, 3 * MIB as u64, len] {
        // SAFETY: as above.
        let a = unsafe { alloc.allocate_raw(n as usize, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
        assert!(a + n <= big || a >= big + len, "a later block at {a:#x} lies on the freed shared one");
        later.push(a);
    }
    for a in later {
        // SAFETY: as above.
        unsafe { alloc.free_raw(a, std::ptr::null_mut()).unwrap() };
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().mapped, len, "its three pages stay, and nothing else");
    drop(imported);
    alloc.unexport(big).unwrap();
    assert_eq!(alloc.stats().freed_shared, 0);
    assert!(alloc.unexport(big).is_err(), "nothing shared any more");
    // Freed now: its pages go back to the driver once idle.
    alloc.empty_cache().unwrap();
    assert_eq!((alloc.stats().mapped, alloc.stats().live), (0, 0));
}

/// Holds the fake driver's exports (`on`) or lets them go.
fn hold_exports(lib: &std::path::Path, on: bool) {
    let f = fake_symbol(lib, "fake_hold_exports");
    // SAFETY: `fake_hold_exports` is `void (int)` in the fake driver, an atomic store.
    unsafe { std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(i32)>(f)(i32::from(on)) }
}

#[test]
fn a_thread_exporting_a_blocks_pages_holds_up_no_allocation_meanwhile() {
    let (_turn, lib, ctx) = fake_device();
    let config = AllocatorConfig { page: 2 * MIB, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    // SAFETY: the legacy default stream; every block is freed below, before the allocator goes.
    let big = unsafe { alloc.allocate_raw(5 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    let share = alloc.export_mark(big).unwrap();
    let exports = count(&lib, "cuMemExportToShareableHandle");
    hold_exports(&lib, true);
    let exporter = {
        let alloc = alloc.clone();
        std::thread::spawn(move || alloc.exported_fds(share.block))
    };
    while count(&lib, "cuMemExportToShareableHandle") == exports {
        std::thread::sleep(Duration::from_millis(1));
    }
    // The exporter waits in the driver now; an allocation on another thread goes on.
    let (told, done) = std::sync::mpsc::channel();
    let allocating = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            // SAFETY: as above.
            let p = unsafe { alloc.allocate_raw(64 << 10, std::ptr::null_mut(), GraphMemory::Keep) };
            told.send(()).unwrap();
            p
        })
    };
    let went_on = done.recv_timeout(Duration::from_secs(10)).is_ok();
    hold_exports(&lib, false);
    let fds = exporter.join().unwrap().unwrap();
    let small = allocating.join().unwrap().unwrap();
    assert!(went_on, "an allocation waited for another thread's export");
    assert_eq!(fds.len(), 3, "the pages under the block");
    // SAFETY: blocks of this allocator, no work queued on them.
    unsafe {
        alloc.free_raw(small, std::ptr::null_mut()).unwrap();
        alloc.free_raw(big, std::ptr::null_mut()).unwrap();
    }
    alloc.unexport(big).unwrap();
    assert_eq!(alloc.stats().live, 0);
}

#[test]
fn pages_made_once_exports_go_ahead_carry_their_descriptors_and_a_later_export_asks_nothing() {
    let (_turn, lib, ctx) = fake_device();
    let config = AllocatorConfig { page: 2 * MIB, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    let exports = count(&lib, "cuMemExportToShareableHandle");
    // SAFETY: the legacy default stream; every block is freed below, before the allocator goes.
    let before = unsafe { alloc.allocate_raw(4 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    assert_eq!(count(&lib, "cuMemExportToShareableHandle"), exports, "nothing exported unasked");

    alloc.export_pages_ahead();
    let created = count(&lib, "cuMemCreate");
    // SAFETY: as above.
    let after = unsafe { alloc.allocate_raw(6 * MIB, std::ptr::null_mut(), GraphMemory::Keep) }.unwrap();
    let made = count(&lib, "cuMemCreate") - created;
    assert!(made > 0, "new pages");
    assert_eq!(count(&lib, "cuMemExportToShareableHandle") - exports, made, "each new page exported once");

    let share = alloc.export_mark(after).unwrap();
    let fds = alloc.exported_fds(share.block).unwrap();
    assert_eq!(fds.len(), share.pages.len());
    assert_eq!(count(&lib, "cuMemExportToShareableHandle") - exports, made, "the descriptors were ready");
    // The block made before still exports when asked.
    let old = alloc.export(before).unwrap();
    assert_eq!(old.fds.len(), 2);
    assert_eq!(count(&lib, "cuMemExportToShareableHandle") - exports, made + 2);
    drop((fds, old));
    alloc.unexport(share.block).unwrap();
    alloc.unexport(before).unwrap();
    // SAFETY: blocks of this allocator, no work queued on them.
    unsafe {
        alloc.free_raw(after, std::ptr::null_mut()).unwrap();
        alloc.free_raw(before, std::ptr::null_mut()).unwrap();
    }
    assert_eq!(alloc.stats().live, 0);
}
