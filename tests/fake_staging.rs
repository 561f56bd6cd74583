//! The staging ring on the CPU, against the fake driver's FAKE_VMM device, whose device memory is
//! host memory, whose copies are memcpy and whose host functions run at once: data really moves,
//! so every way of cutting a transfer into chunks and pieces is checked byte for byte, and (with
//! `--features fault-injection`) a copy failing part-way returns its error without a thread left
//! waiting.
//!
//! One test only: the driver is loaded once per process, from `CUVMM_LIBCUDA`, which must be set
//! before anything touches it.

mod common;

use cuvmm::host::{HostCopy, Staging, StagingConfig};
use cuvmm::{Context, DeviceBuffer, Stream};

const KIB: usize = 1 << 10;

fn fresh(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed)).collect()
}

#[test]
fn staged_transfers_round_trip_for_every_shape() {
    let lib = common::fake_driver("FAKE_VMM");
    // The only test of this process, and nothing has touched the driver yet.
    std::env::set_var(cuvmm::driver::LIBRARY_ENV, &lib);
    let ctx = Context::for_ordinal(0).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let shapes = [
        // chunk, piece, slots, threads
        (64 * KIB, 64 * KIB, 2, 1),
        (64 * KIB, 16 * KIB, 2, 4),
        (64 * KIB, 24 * KIB, 3, 3), // pieces that do not divide the chunk
        (256 * KIB, 64 * KIB, 4, 8),
        (1024 * KIB, 256 * KIB, 16, 2),
    ];
    // Each shape with either kind of store; sources and destinations at every 4-byte offset
    // within a line, so that the streaming copy's unaligned heads and tails are crossed.
    for ((chunk, piece, slots, threads), host_copy) in
        shapes.into_iter().flat_map(|s| HostCopy::ALL.map(|c| (s, c)))
    {
        let config = StagingConfig { chunk, piece, slots, threads, host_copy };
        let mut staging = Staging::with_config(&ctx, config).unwrap();
        assert_eq!(staging.config(), config);
        for (k, n) in [1usize, 1000, 16 * KIB, (300 * KIB) + 3, 2 * 1024 * KIB + 5].into_iter().enumerate() {
            let skew = k * 3 % 16;
            let padded = fresh(n + skew, n as u32);
            let data = &padded[skew..];
            let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
            staging.to_device(&st, data, dev.as_mut_slice()).unwrap();
            assert!(dev.to_vec().unwrap() == data, "to device, {config:?}, n = {n}");
            let mut back = vec![0u32; n + 16];
            staging.to_host(&st, dev.as_slice(), &mut back[skew..skew + n]).unwrap();
            assert!(&back[skew..skew + n] == data, "to host, {config:?}, n = {n}");
            assert!(back[..skew].iter().chain(&back[skew + n..]).all(|&w| w == 0), "wrote outside");
        }
    }
    // The stores change between transfers of one ring, and the next transfer uses them.
    let mut staging =
        Staging::with_config(&ctx, StagingConfig { threads: 3, ..StagingConfig::default() }).unwrap();
    for host_copy in [HostCopy::Plain, HostCopy::Streaming, HostCopy::Plain] {
        staging.set_host_copy(host_copy);
        assert_eq!(staging.config().host_copy, host_copy);
        for n in [1usize, 5 * 1024 * KIB + 7] {
            let data = fresh(n, n as u32);
            let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
            staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
            assert!(dev.to_vec().unwrap() == data, "to device, {host_copy}, n = {n}");
            let mut back = vec![0u32; n];
            staging.to_host(&st, dev.as_slice(), &mut back).unwrap();
            assert!(back == data, "to host, {host_copy}, n = {n}");
        }
    }
    // Fewer threads draining than filling: every byte still arrives, whatever the limit asked.
    let config =
        StagingConfig { chunk: 64 * KIB, piece: 16 * KIB, slots: 3, threads: 4, ..StagingConfig::default() };
    let mut staging = Staging::with_config(&ctx, config).unwrap();
    for (limit, got) in [(1, 1), (3, 3), (0, 1), (9, 4)] {
        staging.set_to_host_threads(limit);
        assert_eq!(staging.to_host_threads(), got, "limit {limit}");
        let n = 300 * KIB + 3;
        let data = fresh(n, limit as u32);
        let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
        staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
        let mut back = vec![0u32; n];
        staging.to_host(&st, dev.as_slice(), &mut back).unwrap();
        assert!(back == data, "to host on {got} of 4 threads");
    }
    let bad =
        StagingConfig { chunk: 64 * KIB, piece: 128 * KIB, slots: 2, threads: 1, ..StagingConfig::default() };
    assert!(Staging::with_config(&ctx, bad).is_err());

    // Traces: none unless asked for; then each transfer's, every chunk's steps in order.
    let config =
        StagingConfig { chunk: 64 * KIB, piece: 16 * KIB, slots: 3, threads: 4, ..StagingConfig::default() };
    let mut staging = Staging::with_config(&ctx, config).unwrap();
    let data = fresh(320 * KIB / 4 + 5, 7); // five chunks and a short sixth
    let bytes = data.len() * 4;
    let mut dev = DeviceBuffer::<u32>::new(&ctx, data.len()).unwrap();
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    assert!(staging.last_trace().is_none());
    staging.set_tracing(true);
    let covers = |t: &cuvmm::host::StagingTrace| {
        assert_eq!(t.bytes, bytes);
        assert_eq!(t.chunks.len(), 6);
        let mut at = 0;
        for c in &t.chunks {
            assert_eq!(c.offset, at);
            at += c.len;
        }
        assert_eq!(at, bytes);
        assert!(t.first_piece.unwrap() <= t.total);
    };
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    let t = staging.last_trace().unwrap().clone();
    assert!(t.to_device);
    covers(&t);
    for c in &t.chunks {
        let (filled, queued) = (c.filled.unwrap(), c.queued.unwrap());
        assert!(t.first_piece.unwrap() <= filled && filled <= queued && queued <= t.total, "{t:?}");
        assert!(c.landed.is_none() && c.drained.is_none());
    }
    let mut back = vec![0u32; data.len()];
    staging.to_host(&st, dev.as_slice(), &mut back).unwrap();
    assert!(back == data);
    let t = staging.last_trace().unwrap().clone();
    assert!(!t.to_device);
    covers(&t);
    for c in &t.chunks {
        let (queued, landed, drained) = (c.queued.unwrap(), c.landed.unwrap(), c.drained.unwrap());
        assert!(queued <= landed && landed <= drained && drained <= t.total, "{t:?}");
        assert!(c.filled.is_none());
    }
    // A refused call leaves no trace, nor does a transfer once tracing is off.
    assert!(staging.to_host(&st, dev.as_slice(), &mut back[..3]).is_err());
    assert!(staging.last_trace().is_none());
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    assert!(staging.last_trace().is_some());
    staging.set_tracing(false);
    assert!(staging.last_trace().is_none());
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    assert!(staging.last_trace().is_none());

    #[cfg(feature = "fault-injection")]
    {
        use cuvmm::driver::sys::CUresult;
        use cuvmm::faults;
        let config = StagingConfig {
            chunk: 64 * KIB,
            piece: 16 * KIB,
            slots: 3,
            threads: 4,
            ..StagingConfig::default()
        };
        let mut staging = Staging::with_config(&ctx, config).unwrap();
        let data = fresh(320 * KIB / 4, 9); // five chunks
        let mut dev = DeviceBuffer::<u32>::new(&ctx, data.len()).unwrap();
        for skip in [0, 2, 4] {
            faults::inject("cuMemcpyHtoDAsync", skip, CUresult::ERROR_OUT_OF_MEMORY);
            let err = staging.to_device(&st, &data, dev.as_mut_slice()).unwrap_err();
            assert_eq!(faults::clear(), 0);
            assert!(err.is_out_of_memory(), "{err}");
            faults::inject("cuMemcpyDtoHAsync", skip, CUresult::ERROR_OUT_OF_MEMORY);
            let mut back = vec![0u32; data.len()];
            let err = staging.to_host(&st, dev.as_slice(), &mut back).unwrap_err();
            assert_eq!(faults::clear(), 0);
            assert!(err.is_out_of_memory(), "{err}");
            faults::inject("cuEventSynchronize", skip, CUresult::ERROR_OUT_OF_MEMORY);
            let err = staging.to_host(&st, dev.as_slice(), &mut back).unwrap_err();
            assert_eq!(faults::clear(), 0);
            assert!(err.is_out_of_memory(), "{err}");
        }
        // Three slots for five chunks: the slots of the first two are handed on only once a
        // query says their DMA is done, so those two queries always happen.
        for skip in [0, 1] {
            faults::inject("cuEventQuery", skip, CUresult::ERROR_OUT_OF_MEMORY);
            let err = staging.to_device(&st, &data, dev.as_mut_slice()).unwrap_err();
            assert_eq!(faults::clear(), 0);
            assert!(err.is_out_of_memory(), "{err}");
        }
        // The ring still works.
        staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
        let mut back = vec![0u32; data.len()];
        staging.to_host(&st, dev.as_slice(), &mut back).unwrap();
        assert!(back == data);
    }
}
