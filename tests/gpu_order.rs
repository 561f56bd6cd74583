//! Device-side ordering across streams, and host functions that reach for the driver, on a GPU.

use cuvmm::kernels::Kernels;
use cuvmm::{scope, Context, DeviceBuffer, Error, PinnedBuffer, Stream, VmmVec};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

/// Elements and iterations of a busy kernel that runs for tens of milliseconds on an H100
/// (2^40 dependent multiply-adds spread over the whole GPU).
const N: usize = 1 << 20;
const ITERS: u32 = 1 << 20;

/// A value no busy kernel produces from 1.0.
fn marker(round: usize) -> f32 {
    -1000.0 - round as f32
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_read_on_another_stream_sees_what_a_slow_kernel_wrote() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let mut v = VmmVec::<f32>::with_capacity(&ctx, N).unwrap();
    v.resize(N, 1.0).unwrap();
    // Pinned on both sides: from pageable memory the driver's copies wait on the host for the
    // stream, which would hide a missing device-side wait.
    let mut out = PinnedBuffer::<f32>::new(&ctx, N).unwrap();
    for round in 0..5 {
        let want = PinnedBuffer::from_slice(&ctx, &vec![marker(round); N]).unwrap();
        let t = Instant::now();
        scope(|s| {
            // Stream A: a slow kernel, then the marker written over its result.
            k.busy_f32(&a, &mut v.as_mut_slice(), ITERS)?;
            s.copy_to_device(&a, &want, v.as_mut_slice())?;
            // Stream B: read it back. Without ordering this copy runs while A is still busy.
            let landing = s.copy_to_host(&b, v.as_slice(), &mut out)?;
            landing.wait()?;
            Ok(())
        })
        .unwrap();
        assert!(
            out[..] == want[..],
            "round {round}: stream B read before stream A's write ({:?})",
            &out[..4]
        );
        if round == 0 {
            eprintln!("round 0 took {:?} (the busy kernel must take well over a copy's time)", t.elapsed());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_synchronous_read_waits_for_a_fill_on_a_non_blocking_stream() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut buf = DeviceBuffer::<f32>::from_slice(&ctx, &vec![1.0; N]).unwrap();
    let mut v = VmmVec::<u32>::new(&ctx).unwrap();
    v.resize(N, 1).unwrap();
    for round in 0..3 {
        let fill = 0xc0de_0000 + round as u32;
        k.busy_f32(&st, &mut buf.as_mut_slice(), ITERS).unwrap();
        scope(|s| s.fill_u32(&st, v.as_mut_slice(), fill)).unwrap();
        // Queued after a slow kernel on `st`: the legacy-stream copy must wait for it.
        k.busy_f32(&st, &mut buf.as_mut_slice(), ITERS).unwrap();
        k.fill_u32(&st, &mut v.as_mut_slice(), fill + 1).unwrap();
        let got = v.to_vec().unwrap();
        assert!(
            got.iter().all(|&x| x == fill + 1),
            "round {round}: to_vec ran before the fill: {:x}",
            got[0]
        );
        // DeviceBuffer's synchronous copies likewise.
        k.busy_f32(&st, &mut buf.as_mut_slice(), ITERS).unwrap();
        let m = vec![marker(round); N];
        scope(|s| s.copy_to_device(&st, &m, buf.as_mut_slice())).unwrap();
        assert!(buf.to_vec().unwrap().iter().all(|&x| x == marker(round)));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_resize_fill_waits_for_a_kernel_still_writing_the_memory() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut v = VmmVec::<f32>::with_capacity(&ctx, N).unwrap();
    for round in 0..3 {
        v.resize(N, 1.0).unwrap();
        k.busy_f32(&st, &mut v.as_mut_slice(), ITERS).unwrap();
        // The elements go, the mapped memory stays; the refill must come after the kernel.
        v.truncate(0);
        v.resize(N, marker(round)).unwrap();
        let got = v.to_vec().unwrap();
        let bad = got.iter().filter(|&&x| x != marker(round)).count();
        assert_eq!(bad, 0, "round {round}: {bad} elements were overwritten by the kernel after the fill");
        v.truncate(0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn streams_on_disjoint_halves_stay_correct_and_a_third_sees_both() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let (a, b, c) = (
        Stream::non_blocking(&ctx).unwrap(),
        Stream::non_blocking(&ctx).unwrap(),
        Stream::non_blocking(&ctx).unwrap(),
    );
    let mut v = VmmVec::<f32>::with_capacity(&ctx, 2 * N).unwrap();
    v.resize(2 * N, 1.0).unwrap();
    let mut out = vec![0f32; 2 * N];
    let (three, four) = (vec![3.0; N], vec![4.0; N]);
    scope(|s| {
        let (mut lo, mut hi) = v.as_mut_slice().split_at_mut(N)?;
        k.busy_f32(&a, &mut lo, ITERS)?;
        s.copy_to_device(&a, &three, lo)?;
        k.busy_f32(&b, &mut hi, ITERS)?;
        s.copy_to_device(&b, &four, hi)?;
        s.copy_to_host(&c, v.as_slice(), &mut out)?.wait()?;
        Ok(())
    })
    .unwrap();
    assert!(out[..N].iter().all(|&x| x == 3.0) && out[N..].iter().all(|&x| x == 4.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_host_function_that_drops_a_buffer_frees_it_without_hanging() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let bytes = 1usize << 30;
    cuvmm::driver::callback::flush_deferred_releases().unwrap();
    let before = ctx.memory_info().unwrap().free;
    let buf = DeviceBuffer::<u8>::new(&ctx, bytes).unwrap();
    let v = VmmVec::<u32>::with_capacity(&ctx, 64 << 20).unwrap();
    let during = ctx.memory_info().unwrap().free;
    assert!(before - during >= bytes + (256 << 20), "allocated: {}", before - during);
    let (tx, rx) = channel();
    st.launch_host_fn(move || {
        // Both destructors call the driver (cuMemFree after a synchronize, cuMemUnmap and
        // cuMemRelease): here they must be deferred, not run.
        drop(buf);
        drop(v);
        tx.send(cuvmm::driver::callback::in_host_function()).unwrap();
    })
    .unwrap();
    assert!(rx.recv_timeout(Duration::from_secs(20)).expect("the host function did not finish"));
    st.synchronize().unwrap();
    cuvmm::driver::callback::flush_deferred_releases().unwrap();
    let after = ctx.memory_info().unwrap().free;
    assert!(after + (4 << 20) >= before, "not freed: before {before}, after {after}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn driver_calls_inside_a_host_function_are_refused_with_a_typed_error() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let buf = DeviceBuffer::<u32>::from_slice(&ctx, &[1, 2, 3]).unwrap();
    let (tx, rx) = channel();
    let c2 = ctx.clone();
    st.launch_host_fn(move || {
        let copy = buf.to_vec();
        let alloc = DeviceBuffer::<u32>::new(&c2, 4).map(|_| ());
        let sync = c2.synchronize();
        let stream = Stream::new(&c2).map(|_| ());
        tx.send([copy.map(|_| ()), alloc, sync, stream]).unwrap();
    })
    .unwrap();
    let all = rx.recv_timeout(Duration::from_secs(20)).expect("the host function hung");
    st.synchronize().unwrap();
    for (i, r) in all.iter().enumerate() {
        assert!(matches!(r, Err(Error::InHostFunction { .. })), "call {i}: {r:?}");
    }
    // Outside the host function everything works again.
    assert_eq!(DeviceBuffer::from_slice(&ctx, &[5u32]).unwrap().to_vec().unwrap(), [5]);
}
