//! cuvmm beside cudarc on a GPU (feature `cudarc`): cudarc kernels over cuvmm memory, cuvmm work on
//! cudarc streams, ordered both ways.

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cuvmm::kernels::{pattern_value, Kernels, PTX};
use cuvmm::{scope, Context, PinnedBuffer, Stream, VmmVec};

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cudarc_kernel_over_a_vmmvec_is_ordered_with_cuvmm_work_on_other_streams() {
    let cuda = CudaContext::new(0).unwrap();
    let cuda_stream = cuda.new_stream().unwrap();
    let module = cuda.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).unwrap();
    let pattern = module.load_function("cuvmm_pattern_u32").unwrap();
    let ctx = Context::from_cudarc(&cuda).unwrap();
    assert_eq!(ctx.raw().cast::<std::ffi::c_void>(), cuda.cu_ctx().cast::<std::ffi::c_void>());
    let on_cudarc = Stream::from_cudarc(&ctx, &cuda_stream).unwrap();
    let other = Stream::non_blocking(&ctx).unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let n = 1usize << 22;
    let mut v = VmmVec::<u32>::with_capacity(&ctx, n).unwrap();
    v.resize(n, 1).unwrap();
    let mut out = PinnedBuffer::<u32>::new(&ctx, n).unwrap();
    for round in 0..3u32 {
        let seed = 0xc0da_0000 + round;
        // A slow cuvmm kernel on another stream writes the vector first…
        let mut f = VmmVec::<f32>::with_capacity(&ctx, n).unwrap();
        f.resize(n, 1.0).unwrap();
        k.busy_f32(&other, &mut f.as_mut_slice(), 1 << 16).unwrap();
        k.fill_u32(&other, &mut v.as_mut_slice(), 0xdead).unwrap();
        // …then cudarc's launch over the vector's view, on cudarc's stream.
        let mut view = v.as_mut_slice();
        let turn = view.prepare_write(&on_cudarc).unwrap();
        let (len, first) = (n as u64, 0u64);
        let mut launch = cuda_stream.launch_builder(&pattern);
        launch.arg(&view).arg(&len).arg(&first).arg(&seed);
        // SAFETY: the pattern kernel writes exactly the n elements of the vector.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
        drop(turn);
        // A cuvmm copy on the other stream reads it back: it must wait for cudarc's launch.
        scope(|s| s.copy_to_host(&other, v.as_slice(), &mut out)?.wait().map(|_| ())).unwrap();
        let bad = out.iter().enumerate().filter(|&(i, &x)| x != pattern_value(i as u64, seed)).count();
        assert_eq!(bad, 0, "round {round}");
    }
    // The cudarc stream outlives cuvmm's handle of it, and cuvmm never destroyed it.
    drop(on_cudarc);
    drop(v);
    cuda_stream.synchronize().unwrap();
    let mut view_after = VmmVec::<u32>::new(&ctx).unwrap();
    view_after.resize(4, 3).unwrap();
    let again = Stream::from_cudarc(&ctx, &cuda_stream).unwrap();
    let mut host = [0u32; 4];
    scope(|s| s.copy_to_host(&again, view_after.as_slice(), &mut host)?.wait().map(|_| ())).unwrap();
    assert_eq!(host, [3; 4]);
}

/// `DeviceRepr` would let cudarc's safe copies (`clone_htod`, `clone_dtoh`) rebuild a `VmmVec` or
/// a writable view from device bytes: a second owner of the same memory. cuvmm's types are
/// kernel arguments through `PushKernelArg` instead, and must not be `DeviceRepr`.
#[test]
fn cuvmm_owners_and_views_are_not_values_cudarc_may_copy() {
    use std::marker::PhantomData;
    struct Probe<T>(PhantomData<T>);
    trait NotRepr {
        fn is_repr(&self) -> bool {
            false
        }
    }
    impl<T> NotRepr for Probe<T> {}
    impl<T: cudarc::driver::DeviceRepr> Probe<T> {
        fn is_repr(&self) -> bool {
            true
        }
    }
    assert!(Probe::<u64>(PhantomData).is_repr(), "the probe tells a DeviceRepr type");
    assert!(!Probe::<VmmVec<u32>>(PhantomData).is_repr());
    assert!(!Probe::<cuvmm::DeviceSlice<'static, u32>>(PhantomData).is_repr());
    assert!(!Probe::<cuvmm::DeviceSliceMut<'static, u32>>(PhantomData).is_repr());
}
