//! Pinned memory, registration, streams, events, callbacks, async copies and kernels on a GPU.

use cuvmm::host::{HostCopy, KernelLane, Staging};
use cuvmm::host::{PinnedFlags, RegisterFlags};
use cuvmm::kernels::{pattern_value, Kernels};
use cuvmm::{scope, Context, DeviceBuffer, Error, Event, PinnedBuffer, Registered, Stream, VmmVec};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

/// Fresh, non-zero data for every call.
fn fresh(n: usize, salt: u32) -> Vec<u32> {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    (0..n as u64).map(|i| pattern_value(i, t ^ salt) | 1).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trips_for_every_copy_and_buffer_kind() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let n = 3 << 20;
    let data = fresh(n, 1);
    // Device sides: a VmmVec, a mapped VMM range (via VmmVec's mapping), a plain allocation.
    let mut vv = VmmVec::<u32>::with_capacity(&ctx, n).unwrap();
    vv.resize(n, 0).unwrap();
    let mut plain = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
    // Host sides: pinned, pinned with flags, registered, pageable.
    let pinned = PinnedBuffer::from_slice(&ctx, &data).unwrap();
    let mut flagged = PinnedBuffer::<u32>::with_flags(
        &ctx,
        n,
        PinnedFlags { portable: true, device_mapped: true, write_combined: false },
    )
    .unwrap();
    flagged.copy_from_slice(&data);
    let mut legacy = data.clone();
    let pageable = data.clone();
    let flags = RegisterFlags { portable: true, ..Default::default() };
    Registered::with(&ctx, &mut legacy, flags, |reg| {
        let sources: [(&str, &[u32]); 4] =
            [("pinned", &pinned), ("flagged", &flagged), ("registered", reg), ("pageable", &pageable)];
        for (name, src) in sources {
            let mut back_pinned = PinnedBuffer::<u32>::new(&ctx, n).unwrap();
            let mut back_pageable = vec![0u32; n];
            scope(|s| {
                s.copy_to_device(&st, src, vv.as_mut_slice())?;
                s.copy_on_device(&st, vv.as_slice(), plain.as_mut_slice())?;
                let _ = s.copy_to_host(&st, plain.as_slice(), &mut back_pinned)?;
                let _ = s.copy_to_host(&st, vv.as_slice(), &mut back_pageable)?;
                Ok(())
            })
            .unwrap();
            assert!(back_pinned[..] == data[..], "{name}: pinned destination");
            assert!(back_pageable == data, "{name}: pageable destination");
        }
    })
    .unwrap();
    // Memset through the scope.
    scope(|s| s.fill_u32(&st, plain.as_mut_slice(), 0xdead_beef)).unwrap();
    assert!(plain.to_vec().unwrap().iter().all(|&x| x == 0xdead_beef));
    // A device-mapped pinned buffer has a device address.
    assert!(flagged.device_ptr().unwrap() != 0);
    assert!(matches!(pinned.device_ptr(), Err(Error::InvalidArgument(_))));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_staged_pageable_path_round_trips_exactly() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    // Small chunks and few slots so that every slot is reused many times; odd length for a tail.
    let mut staging = Staging::new(&ctx, 1 << 20, 3, 4).unwrap();
    // Either kind of store; 9 Mi words are longer than the streamed tail of a transfer to the device.
    for (copy, n) in
        HostCopy::ALL.into_iter().flat_map(|c| [1usize, 1000, (5 << 20) + 3, 9 << 20].map(|n| (c, n)))
    {
        staging.set_host_copy(copy);
        let data = fresh(n, n as u32);
        let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
        staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
        assert_eq!(dev.to_vec().unwrap(), data, "to device, {copy}, n = {n}");
        let mut back = vec![0u32; n];
        staging.to_host(&st, dev.as_slice(), &mut back).unwrap();
        assert!(back == data, "to host, {copy}, n = {n}");
    }
    let mut dev = DeviceBuffer::<u32>::new(&ctx, 4).unwrap();
    assert!(matches!(staging.to_device(&st, &[1, 2, 3], dev.as_mut_slice()), Err(Error::InvalidArgument(_))));
}

/// With the kernel lane on, chunks go to the device through kernels as well as the copy engines,
/// every byte arrives, and the kernels wait for what the caller queued before the transfer (a
/// slow kernel, then a fill of the destination that would overwrite an early copy).
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_kernel_lane_carries_chunks_after_the_callers_earlier_work() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut staging = Staging::new(&ctx, 1 << 20, 4, 4).unwrap();
    staging
        .set_kernel_lane(Some((Kernels::load(&ctx).unwrap(), KernelLane { bias: 1, slowdown: 0.0 })))
        .unwrap();
    let mut slow = DeviceBuffer::<f32>::new(&ctx, 1 << 22).unwrap();
    // An odd length: the last chunk is no whole number of 16-byte words and takes the copy engines.
    for (round, n) in [(16usize << 20) + 3, 24 << 20].into_iter().enumerate() {
        let data = fresh(n, 77 + round as u32);
        let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
        k.busy_f32(&st, &mut slow.as_mut_slice(), 4000).unwrap();
        k.fill_u32(&st, &mut dev.as_mut_slice(), 0).unwrap();
        staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
        assert!(dev.to_vec().unwrap() == data, "n = {n}");
    }
    assert!(staging.kernel_chunks() > 0, "no chunk went through the kernel lane");
    staging.set_kernel_lane(None).unwrap();
    let before = staging.kernel_chunks();
    let data = fresh(1 << 20, 5);
    let mut dev = DeviceBuffer::<u32>::new(&ctx, 1 << 20).unwrap();
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    assert!(dev.to_vec().unwrap() == data);
    assert_eq!(staging.kernel_chunks(), before, "off, the lane takes no chunk");
}

/// By default the lane waits for the copy engines to be slow: right after much device memory is
/// freed (the driver's work then halves their rate) chunks go through it too, and arrive whole.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_kernel_lane_takes_chunks_while_the_copy_engines_are_slow_after_frees() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut staging = Staging::with_defaults(&ctx).unwrap();
    staging.set_kernel_lane(Some((Kernels::load(&ctx).unwrap(), KernelLane::default()))).unwrap();
    let n = 128 << 20; // 512 MiB of u32
    let data = fresh(n, 91);
    let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
    // Undisturbed transfers both ways teach the ring what a chunk takes.
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    let mut back = vec![0u32; n];
    staging.to_host(&st, dev.as_slice(), &mut back).unwrap();
    assert!(back == data);
    let before = staging.kernel_chunks();
    let others: Vec<DeviceBuffer<u32>> = (0..12)
        .map(|_| {
            let mut b = DeviceBuffer::<u32>::new(&ctx, 1 << 28).unwrap();
            scope(|s| s.fill_u32(&st, b.as_mut_slice(), 0xa5a5_a5a5)).unwrap();
            b
        })
        .collect();
    st.synchronize().unwrap();
    drop(others);
    let data = fresh(n, 92);
    staging.to_device(&st, &data, dev.as_mut_slice()).unwrap();
    assert!(dev.to_vec().unwrap() == data);
    assert!(
        staging.kernel_chunks() > before,
        "no chunk went through the kernel lane right after 12 GiB of frees"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_order_work_and_time_it() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut buf = DeviceBuffer::<f32>::new(&ctx, 1 << 24).unwrap();
    let (a, b, c) = (Event::new(&ctx).unwrap(), Event::new(&ctx).unwrap(), Event::new(&ctx).unwrap());
    a.record(&st).unwrap();
    k.busy_f32(&st, &mut buf.as_mut_slice(), 200).unwrap();
    b.record(&st).unwrap();
    k.busy_f32(&st, &mut buf.as_mut_slice(), 2000).unwrap();
    c.record(&st).unwrap();
    assert!(!c.is_complete().unwrap(), "a long kernel is still running");
    c.synchronize().unwrap();
    assert!(a.is_complete().unwrap() && b.is_complete().unwrap());
    let (ab, bc, ac) = (a.elapsed_ms(&b).unwrap(), b.elapsed_ms(&c).unwrap(), a.elapsed_ms(&c).unwrap());
    assert!(ab > 0.0 && bc > ab * 3.0, "ten times the work takes longer: {ab} then {bc}");
    assert!((ab + bc - ac).abs() < 0.01 + ac * 1e-3, "{ab} + {bc} != {ac}");
    assert!(b.elapsed_ms(&a).unwrap() < 0.0);
    let quiet = Event::without_timing(&ctx).unwrap();
    quiet.record(&st).unwrap();
    assert!(matches!(a.elapsed_ms(&quiet), Err(Error::InvalidArgument(_))));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_wait_event_orders_work_across_streams() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let (s1, s2) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let n = 1 << 24;
    let mut buf = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
    let mut slow = DeviceBuffer::<f32>::new(&ctx, 1 << 22).unwrap();
    for round in 0..5u32 {
        // s1: a slow kernel, then writes the pattern. s2 waits on s1's event, then checks it.
        k.busy_f32(&s1, &mut slow.as_mut_slice(), 3000).unwrap();
        k.pattern_u32(&s1, &mut buf.as_mut_slice(), 0, round).unwrap();
        let e = Event::without_timing(&ctx).unwrap();
        e.record(&s1).unwrap();
        s2.wait_event(&e).unwrap();
        assert_eq!(k.count_pattern_mismatches(&s2, &buf.as_slice(), 0, round).unwrap(), 0, "round {round}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_callbacks_run_once_in_order_and_are_freed() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let token = Arc::new(());
    let mut buf = DeviceBuffer::<f32>::new(&ctx, 1 << 22).unwrap();
    for i in 0..100 {
        if i % 10 == 0 {
            k.busy_f32(&st, &mut buf.as_mut_slice(), 500).unwrap();
        }
        let (log, token) = (log.clone(), token.clone());
        st.launch_host_fn(move || {
            let _keep = token;
            log.lock().unwrap().push(i);
        })
        .unwrap();
    }
    st.synchronize().unwrap();
    assert_eq!(*log.lock().unwrap(), (0..100).collect::<Vec<_>>());
    // Every closure (and what it captured) has been dropped.
    assert_eq!(Arc::strong_count(&token), 1);

    // A callback queued behind long work on a stream that is then dropped still runs, once.
    let ran = Arc::new(AtomicUsize::new(0));
    {
        let s = Stream::non_blocking(&ctx).unwrap();
        k.busy_f32(&s, &mut buf.as_mut_slice(), 5000).unwrap();
        let r = ran.clone();
        s.launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    }
    ctx.synchronize().unwrap();
    for _ in 0..1000 {
        if Arc::strong_count(&ran) == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(Arc::strong_count(&ran), 1, "the closure was freed");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_landing_is_consumed_by_a_callback_after_the_copy() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let data = fresh(1 << 20, 7);
    let dev = DeviceBuffer::from_slice(&ctx, &data).unwrap();
    let mut out = PinnedBuffer::<u32>::new(&ctx, data.len()).unwrap();
    let seen = Mutex::new(None);
    scope(|s| {
        let landing = s.copy_to_host(&st, dev.as_slice(), &mut out)?;
        s.then(landing, |d| {
            *seen.lock().unwrap() = Some(d.iter().map(|&x| x as u64).sum::<u64>());
            d[0] = 42;
        })
    })
    .unwrap();
    assert_eq!(seen.into_inner().unwrap(), Some(data.iter().map(|&x| x as u64).sum()));
    assert_eq!(out[0], 42);
    assert!(out[1..] == data[1..]);
    // Landing::wait inside a scope.
    let mut out2 = vec![0u32; data.len()];
    scope(|s| {
        let got = s.copy_to_host(&st, dev.as_slice(), &mut out2)?.wait()?;
        assert!(got[..] == data[..]);
        Ok(())
    })
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_load_and_compute_the_right_results() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let n = (1 << 22) + 17;
    let a: Vec<f32> = fresh(n, 3).iter().map(|&x| (x % 1000) as f32 * 0.25).collect();
    let b: Vec<f32> = fresh(n, 4).iter().map(|&x| (x % 777) as f32).collect();
    let (da, db) = (DeviceBuffer::from_slice(&ctx, &a).unwrap(), DeviceBuffer::from_slice(&ctx, &b).unwrap());
    let mut dc = DeviceBuffer::<f32>::new(&ctx, n).unwrap();
    k.vector_add_f32(&st, &da.as_slice(), &db.as_slice(), &mut dc.as_mut_slice()).unwrap();
    st.synchronize().unwrap();
    let c = dc.to_vec().unwrap();
    assert!((0..n).all(|i| c[i] == a[i] + b[i]));
    let short = DeviceBuffer::<f32>::new(&ctx, 5).unwrap();
    assert!(matches!(
        k.vector_add_f32(&st, &da.as_slice(), &short.as_slice(), &mut dc.as_mut_slice()),
        Err(Error::InvalidArgument(_))
    ));

    let mut u = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
    k.fill_u32(&st, &mut u.as_mut_slice(), 7).unwrap();
    assert_eq!(k.checksum_u32(&st, &u.as_slice()).unwrap(), 7 * n as u64);
    k.pattern_u32(&st, &mut u.as_mut_slice(), 1000, 99).unwrap();
    st.synchronize().unwrap();
    let host = u.to_vec().unwrap();
    assert!((0..n).all(|i| host[i] == pattern_value(1000 + i as u64, 99)));
    assert_eq!(k.count_pattern_mismatches(&st, &u.as_slice(), 1000, 99).unwrap(), 0);
    assert_eq!(k.count_pattern_mismatches(&st, &u.as_slice(), 1001, 99).unwrap(), n as u64);
    assert_eq!(k.checksum_u32(&st, &u.as_slice()).unwrap(), host.iter().map(|&x| x as u64).sum::<u64>());
    // Unaligned starts take the 4-byte path, aligned ones the 16-byte path plus a tail.
    for start in [1usize, 2, 3, 4, 5] {
        let want: u64 = host[start..].iter().map(|&x| x as u64).sum();
        assert_eq!(
            k.checksum_u32(&st, &u.as_slice().slice(start..n).unwrap()).unwrap(),
            want,
            "start {start}"
        );
    }
    let mut f = DeviceBuffer::from_slice(&ctx, &[2.0f32, -1.0, 0.5]).unwrap();
    k.busy_f32(&st, &mut f.as_mut_slice(), 10).unwrap();
    st.synchronize().unwrap();
    let want: Vec<f32> = [2.0f32, -1.0, 0.5].iter().map(|&x| cuvmm::kernels::busy_value(x, 10)).collect();
    assert_eq!(f.to_vec().unwrap(), want);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_gives_typed_errors() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut dev = DeviceBuffer::<u32>::new(&ctx, 8).unwrap();
    let host = [1u32; 4];
    let mut host_out = [0u32; 4];
    // Length mismatches.
    assert!(matches!(
        scope(|s| s.copy_to_device(&st, &host, dev.as_mut_slice())),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        scope(|s| s.copy_to_host(&st, dev.as_slice(), &mut host_out).map(|_| ())),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(dev.copy_from_host(&host), Err(Error::InvalidArgument(_))));
    // Zero-length registration.
    let mut empty: Vec<u32> = Vec::new();
    assert!(matches!(
        Registered::with(&ctx, &mut empty, RegisterFlags::default(), |_| unreachable!()),
        Err(Error::InvalidArgument(_))
    ));
    // Registering memory that is already registered (by someone else, through the raw driver).
    let mut v = vec![0u8; 1 << 20];
    let api = cuvmm::driver::driver().unwrap().api();
    ctx.bind().unwrap();
    // SAFETY: `v` outlives the registration, which is undone below.
    unsafe { cuvmm::driver::result::host::register(api, v.as_mut_ptr().cast(), v.len(), 0) }.unwrap();
    match Registered::with(&ctx, &mut v, RegisterFlags::default(), |_| unreachable!()) {
        Err(e) if e.kind() == cuvmm::ErrorKind::Refused(cuvmm::Refusal::AlreadyRegistered) => {}
        other => panic!("expected a typed error, got {:?}", other.map(|_: ()| ())),
    }
    // SAFETY: registered above.
    unsafe { cuvmm::driver::result::host::unregister(api, v.as_mut_ptr().cast()) }.unwrap();
    Registered::with(&ctx, &mut v, RegisterFlags::default(), |_| ()).unwrap();
    // Invalid flags.
    assert!(matches!(RegisterFlags::from_bits(0x40), Err(Error::InvalidArgument(_))));
    assert_eq!(
        RegisterFlags::from_bits(3).unwrap(),
        RegisterFlags { portable: true, device_mapped: true, read_only: false }
    );
    // Zero-sized pinned buffers.
    assert!(matches!(PinnedBuffer::<u32>::new(&ctx, 0), Err(Error::InvalidArgument(_))));
    // A kernel on another context's stream is refused (there is one context per device: use the
    // same one to build a stream, but check the guard with an event of the right context).
    let e = Event::new(&ctx).unwrap();
    assert!(st.wait_event(&e).is_ok());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn read_only_registration_follows_device_support() {
    let ctx = ctx();
    let mut v = fresh(1 << 18, 9);
    let want = v.clone();
    let supported =
        ctx.device().flag(cuvmm::driver::sys::CUdevice_attribute::READ_ONLY_HOST_REGISTER_SUPPORTED).unwrap();
    let st = Stream::non_blocking(&ctx).unwrap();
    let mut dev = DeviceBuffer::<u32>::new(&ctx, want.len()).unwrap();
    let r = Registered::with(&ctx, &mut v, RegisterFlags { read_only: true, ..Default::default() }, |r| {
        scope(|s| s.copy_to_device(&st, r, dev.as_mut_slice())).unwrap();
    });
    if supported {
        r.unwrap();
        assert_eq!(dev.to_vec().unwrap(), want);
    } else {
        assert!(matches!(r, Err(Error::Unsupported { .. })));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn priorities_blocking_events_and_write_combined_memory_work() {
    let ctx = ctx();
    let (least, greatest) = Stream::priority_range(&ctx).unwrap();
    assert!(greatest <= least, "greatest priority is numerically lowest: {greatest} vs {least}");
    let hi = Stream::with_priority(&ctx, greatest).unwrap();
    let lo = Stream::with_priority(&ctx, least).unwrap();
    let blocking = Event::blocking(&ctx).unwrap();
    let start = Event::new(&ctx).unwrap();
    let data = fresh(1 << 20, 11);
    let mut wc = PinnedBuffer::<u32>::with_flags(
        &ctx,
        data.len(),
        PinnedFlags { write_combined: true, ..Default::default() },
    )
    .unwrap();
    wc.copy_from_slice(&data); // write-combined memory: written by the host, read by the device
    let mut dev = DeviceBuffer::<u32>::new(&ctx, data.len()).unwrap();
    scope(|s| {
        start.record(&lo)?;
        s.copy_to_device(&hi, &wc, dev.as_mut_slice())?;
        blocking.record(&hi)?;
        Ok(())
    })
    .unwrap();
    blocking.synchronize().unwrap();
    assert!(blocking.is_complete().unwrap() && hi.is_idle().unwrap() && lo.is_idle().unwrap());
    assert!(start.elapsed_ms(&blocking).unwrap() >= 0.0);
    assert_eq!(dev.to_vec().unwrap(), data);
}

/// Registers `v` through the raw driver and undoes it: succeeds only if nothing else holds a
/// registration of that memory.
fn registrable_again(ctx: &Context, v: &mut [u8]) -> bool {
    let api = cuvmm::driver::driver().unwrap().api();
    ctx.bind().unwrap();
    // SAFETY: `v` is live for the whole call, and the registration is undone before it returns.
    match unsafe { cuvmm::driver::result::host::register(api, v.as_mut_ptr().cast(), v.len(), 0) } {
        // SAFETY: registered just above.
        Ok(()) => unsafe { cuvmm::driver::result::host::unregister(api, v.as_mut_ptr().cast()) }
            .map(|()| true)
            .unwrap(),
        Err(e) if e.is_code(cuvmm::driver::sys::CUresult::ERROR_HOST_MEMORY_ALREADY_REGISTERED) => false,
        Err(e) => panic!("unexpected registration error: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_registration_never_outlives_its_closure() {
    let ctx = ctx();
    let mut v = vec![3u8; 1 << 20];
    let mut w = vec![4u8; 1 << 20];
    assert!(registrable_again(&ctx, &mut v), "nothing holds it yet");
    // While the closure runs the memory is registered; once `with` returns it is not.
    let inside = Registered::with(&ctx, &mut v, RegisterFlags::default(), |reg| {
        let mut other = vec![0u8; 1];
        assert!(registrable_again(&ctx, &mut other));
        // The same pages are held by this registration.
        !registrable_again(&ctx, &mut reg[..1])
    })
    .unwrap();
    assert!(inside, "the memory was registered inside the closure");
    assert!(registrable_again(&ctx, &mut v), "unregistered when `with` returned");
    // Also when the closure panics.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Registered::with(&ctx, &mut v, RegisterFlags::default(), |_| panic!("boom")).unwrap()
    }));
    assert!(r.is_err());
    assert!(registrable_again(&ctx, &mut v), "unregistered while unwinding");
    // Swapping the handles of two nested registrations leaves each `with` undoing its own.
    Registered::with(&ctx, &mut v, RegisterFlags::default(), |rv| {
        Registered::with(&ctx, &mut w, RegisterFlags::default(), |rw| std::mem::swap(rv, rw)).unwrap();
        assert_eq!(rv[0], 4, "the outer handle now names `w`");
    })
    .unwrap();
    assert!(registrable_again(&ctx, &mut v) && registrable_again(&ctx, &mut w));
    // The memory is the caller's again, unchanged.
    assert!(v.iter().all(|&b| b == 3) && w.iter().all(|&b| b == 4));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_pinned_buffers_are_zeroed_registered_and_round_trip() {
    let ctx = ctx();
    let st = Stream::non_blocking(&ctx).unwrap();
    // 96 MiB: past the size from which pinned buffers are mapped and registered.
    let n = 24 << 20;
    let mut src = PinnedBuffer::<u32>::new(&ctx, n).unwrap();
    assert!(src.iter().all(|&x| x == 0), "a new pinned buffer reads as zeros");
    // Its pages are page-locked already: the driver refuses to register them again.
    let bytes: &mut [u8] =
        // SAFETY: the same memory viewed as bytes; u32 has no invalid bit patterns.
        unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast(), 4096) };
    assert!(!registrable_again(&ctx, bytes), "a large pinned buffer is registered");
    let data = fresh(n, 7);
    src.copy_from_slice(&data);
    let mut dev = DeviceBuffer::<u32>::new(&ctx, n).unwrap();
    let mut back = PinnedBuffer::<u32>::with_flags(
        &ctx,
        n,
        PinnedFlags { portable: true, device_mapped: true, write_combined: false },
    )
    .unwrap();
    scope(|s| {
        s.copy_to_device(&st, &src, dev.as_mut_slice())?;
        let _ = s.copy_to_host(&st, dev.as_slice(), &mut back)?;
        Ok(())
    })
    .unwrap();
    assert!(back[..] == data[..]);
    assert!(back.device_ptr().unwrap() != 0, "device-mapped registration has a device address");
}
