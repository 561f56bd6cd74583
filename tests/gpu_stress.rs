//! Several threads growing their own VmmVecs while allocating, freeing and exporting from one
//! shared caching allocator; every result checked.

mod common;

use cuvmm::alloc::{CachingAllocator, ExportMode, PeerAllocator};
use cuvmm::ipc::{PeerPolicy, SharedMemory};
use cuvmm::{Context, VmmVec};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_grow_vectors_and_share_one_allocator() {
    let ctx = Context::for_ordinal(0).unwrap();
    let before = ctx.memory_info().unwrap().used();
    {
        let cache =
            CachingAllocator::new(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap(), 2 << 20)
                .unwrap();
        std::thread::scope(|sc| {
            for t in 0..8u32 {
                let (ctx, cache) = (ctx.clone(), cache.clone());
                sc.spawn(move || {
                    let mut v = VmmVec::<u32>::new(&ctx).unwrap();
                    let mut model = Vec::new();
                    for i in 0..200u32 {
                        let chunk: Vec<u32> =
                            (0..(i % 13 + 1) * 5000).map(|k| t << 24 ^ i << 12 ^ k).collect();
                        v.extend_from_slice(&chunk).unwrap();
                        model.extend_from_slice(&chunk);
                        if i % 50 == 49 {
                            v.truncate(model.len() / 2);
                            model.truncate(model.len() / 2);
                            v.shrink_to_fit().unwrap();
                        }
                        // Blocks to be shared get their own physical allocation: a shared block
                        // must not expose its neighbours.
                        let a = if i % 20 == 0 {
                            cache.allocate_shareable(512 << (i % 8)).unwrap()
                        } else {
                            cache.allocate(512 << (i % 8)).unwrap()
                        };
                        let payload = [t ^ i; 32];
                        // SAFETY: the block holds at least 512 bytes of mapped device memory.
                        let mut dst = unsafe { cuvmm::DeviceSliceMut::<u32>::from_raw_parts(a.ptr(), 32) };
                        cuvmm::stream::copy::to_device(&ctx, &mut dst, &payload).unwrap();
                        if i % 20 == 0 {
                            let (x, y) = UnixStream::pair().unwrap();
                            a.share(x.as_fd(), i as u64).unwrap();
                            let shm = SharedMemory::import(
                                &ctx,
                                common::recv(y.as_fd(), PeerPolicy::SameUid).unwrap(),
                                &[],
                            )
                            .unwrap();
                            let mut back = [0u32; 32];
                            shm.copy_to_host(0, &mut back).unwrap();
                            assert_eq!(back, payload, "thread {t} op {i}");
                        }
                    }
                    assert_eq!(v.to_vec().unwrap(), model, "thread {t}");
                });
            }
        });
        assert_eq!(cache.stats().in_use, 0);
        cache.trim();
    }
    ctx.synchronize().unwrap();
    let after = ctx.memory_info().unwrap().used();
    assert!(after.abs_diff(before) <= 2 << 20, "before {before}, after {after}");
}
