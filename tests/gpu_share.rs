//! Blocks of the stream-ordered allocator shared as exported pages, on a GPU: what the importer
//! maps is the exporter's memory, it stays valid after the exporter frees the block, and a block
//! above the export threshold is one allocation, imported whatever its size. A block freed while
//! imported keeps its memory from later blocks until let go, and exports of the same pages after
//! the first are the kept ones. A block marked shared without descriptors gives them on request,
//! freed meanwhile or not.

mod common;

use common::{read, words_mut};
use cuvmm::alloc::{AllocatorConfig, BlockImport, DevicePtr, GraphMemory, StreamAllocator};
use cuvmm::kernels::Kernels;
use cuvmm::{Context, Stream};
use std::os::fd::AsFd;

const N: usize = 3 << 20; // u32 words: 12 MiB, over four 4 MiB pages from an unaligned start

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_imported_block_is_the_same_memory_and_outlives_the_exporters_free() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    // Pages of 4 MiB (the default is 128 MiB), so that a 12 MiB block spans several.
    let config = AllocatorConfig { page: 4 << 20, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    // A 2 MiB block first (large: above 1 MiB), so that the big one starts inside a page.
    let small = alloc.allocate(2 << 20, &s).unwrap();
    let big = alloc.allocate(N * 4, &s).unwrap();
    k.fill_u32(&s, &mut words_mut(big.ptr(), N), 0xabcd_0001).unwrap();
    s.synchronize().unwrap();
    let e = alloc.export(DevicePtr::new(big.ptr() + 4096)).unwrap();
    assert_eq!(e.share.block.get(), big.ptr());
    assert!(e.share.first_page < big.ptr() && e.fds.len() == 4, "{e:?}");
    let fds: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
    let imported = BlockImport::import(&ctx, &fds, e.share.page, &[]).unwrap();
    let at = imported.ptr() + (big.ptr() - e.share.first_page);
    drop(e);
    assert!(read(&ctx, at, N).iter().all(|&v| v == 0xabcd_0001), "the importer sees the exporter's bytes");
    // A write through the import is seen at the block's own address.
    k.fill_u32(&s, &mut words_mut(at, 1024), 0x5eed).unwrap();
    s.synchronize().unwrap();
    assert!(read(&ctx, big.ptr(), 1024).iter().all(|&v| v == 0x5eed));
    // The exporter lets go and empties its cache: the import still holds the memory.
    alloc.unexport(DevicePtr::new(big.ptr())).unwrap();
    assert_eq!(alloc.stats().exported, 0);
    drop(big);
    drop(small);
    ctx.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    let got = read(&ctx, at, N);
    assert!(got[..1024].iter().all(|&v| v == 0x5eed) && got[1024..].iter().all(|&v| v == 0xabcd_0001));
    drop(imported);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn above_the_export_threshold_a_block_exports_as_one_descriptor() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let s = Stream::non_blocking(&ctx).unwrap();
    let config = AllocatorConfig { export_threshold: 64 << 20, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    // SAFETY: a live stream of the context, alive past the free below.
    let p = unsafe { alloc.allocate_raw(100 << 20, s.raw(), GraphMemory::Keep) }.unwrap().get();
    let e = alloc.export(DevicePtr::new(p)).unwrap();
    assert_eq!((e.fds.len(), e.share.page, e.share.first_page), (1, 100 << 20, p));
    // 100 MiB is no power of two: the import is aligned to what divides it, and is the same memory.
    let fds: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
    let imported = BlockImport::import(&ctx, &fds, e.share.page, &[]).unwrap();
    drop(e);
    let k = Kernels::load(&ctx).unwrap();
    let words = (100 << 20) / 4;
    k.fill_u32(&s, &mut words_mut(imported.ptr(), words), 0x19_0019).unwrap();
    s.synchronize().unwrap();
    assert!(read(&ctx, p, words).iter().all(|&v| v == 0x19_0019), "the exporter sees the importer's write");
    drop(imported);
    alloc.unexport(DevicePtr::new(p)).unwrap();
    // SAFETY: from this allocator, freed once on its stream.
    unsafe { alloc.free_raw(DevicePtr::new(p), s.raw()) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(alloc.empty_cache().unwrap(), 100 << 20);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_freed_while_imported_keeps_its_memory_and_a_kept_export_imports_the_same_pages() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    // SAFETY: a live stream of the context, alive past every free below.
    let p = unsafe { alloc.allocate_raw(N * 4, s.raw(), GraphMemory::Keep) }.unwrap().get();
    k.fill_u32(&s, &mut words_mut(p, N), 0x1111_1111).unwrap();
    s.synchronize().unwrap();
    // Shared twice: the second export hands out the descriptors the first one kept.
    let (e1, e2) = (alloc.export(DevicePtr::new(p)).unwrap(), alloc.export(DevicePtr::new(p)).unwrap());
    let fds1: Vec<_> = e1.fds.iter().map(|f| f.as_fd()).collect();
    let fds2: Vec<_> = e2.fds.iter().map(|f| f.as_fd()).collect();
    let one = BlockImport::import(&ctx, &fds1, e1.share.page, &[]).unwrap();
    let two = BlockImport::import(&ctx, &fds2, e2.share.page, &[]).unwrap();
    let (at1, at2) = (one.ptr() + (p - e1.share.first_page), two.ptr() + (p - e2.share.first_page));
    drop((e1, e2));
    k.fill_u32(&s, &mut words_mut(at2, 1024), 0x5eed).unwrap();
    s.synchronize().unwrap();
    assert!(read(&ctx, at1, 1024).iter().all(|&v| v == 0x5eed), "both imports map the block's pages");
    // Freed while imported: the next blocks of its size, on its stream, lie elsewhere.
    // SAFETY: from this allocator, freed once on its stream.
    unsafe { alloc.free_raw(DevicePtr::new(p), s.raw()) }.unwrap();
    assert_eq!(alloc.stats().freed_shared, (N * 4) as u64);
    let mut later = Vec::new();
    for _ in 0..4 {
        // SAFETY: as above.
        let b = unsafe { alloc.allocate_raw(N * 4, s.raw(), GraphMemory::Keep) }.unwrap().get();
        assert!(b + (N * 4) as u64 <= p || b >= p + (N * 4) as u64, "{b:#x} lies on the freed shared block");
        k.fill_u32(&s, &mut words_mut(b, N), 0x2222_2222).unwrap();
        later.push(b);
    }
    s.synchronize().unwrap();
    let got = read(&ctx, at1, N);
    assert!(got[..1024].iter().all(|&v| v == 0x5eed) && got[1024..].iter().all(|&v| v == 0x1111_1111));
    drop((one, two));
    alloc.unexport(DevicePtr::new(p)).unwrap();
    assert_eq!(alloc.stats().freed_shared, (N * 4) as u64, "one sharing left");
    alloc.unexport(DevicePtr::new(p)).unwrap();
    assert_eq!(alloc.stats().freed_shared, 0);
    for b in later {
        // SAFETY: as above.
        unsafe { alloc.free_raw(DevicePtr::new(b), s.raw()) }.unwrap();
    }
    s.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().live, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_marked_shared_gives_its_descriptors_on_request_after_its_free() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let k = Kernels::load(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let big = alloc.allocate(N * 4, &s).unwrap();
    k.fill_u32(&s, &mut words_mut(big.ptr(), N), 0x3a5e_0003).unwrap();
    s.synchronize().unwrap();
    let full = alloc.export(DevicePtr::new(big.ptr())).unwrap();
    alloc.unexport(DevicePtr::new(big.ptr())).unwrap();
    let m = alloc.export_mark(DevicePtr::new(big.ptr() + 512)).unwrap();
    assert_eq!(m, full.share, "the same block on the same pages");
    assert_eq!(alloc.stats().exported, (N * 4) as u64);
    // Freed before any importer asked: the mark keeps the pages whose descriptors come later.
    let block = big.ptr();
    drop(big);
    s.synchronize().unwrap();
    let fds = alloc.exported_fds(DevicePtr::new(block)).unwrap();
    assert_eq!(fds.len(), m.pages.len());
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let imported = BlockImport::import(&ctx, &borrowed, m.page, &[]).unwrap();
    drop(fds);
    let at = imported.ptr() + (block - m.first_page);
    assert!(read(&ctx, at, N).iter().all(|&v| v == 0x3a5e_0003), "the block's own bytes");
    drop(imported);
    alloc.unexport(DevicePtr::new(block)).unwrap();
    assert!(alloc.exported_fds(DevicePtr::new(block)).is_err(), "let go: no descriptor any more");
    assert_eq!((alloc.stats().exported, alloc.stats().freed_shared), (0, 0));
}
