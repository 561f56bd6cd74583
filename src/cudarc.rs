//! Working beside cudarc (feature `cudarc`).
//!
//! cudarc and cuvmm both use each device's primary context, so they share it: a cuvmm
//! [`Context`] for a cudarc `CudaContext` is the same driver context, and memory of either is
//! usable by the other's streams and kernels.
//!
//! * [`Context::from_cudarc`] and [`Stream::from_cudarc`] let cuvmm work in a context and on a
//!   stream cudarc created (the stream stays cudarc's: cuvmm never destroys it).
//! * cuvmm's device views ([`DeviceSlice`], [`DeviceSliceMut`]) and [`VmmVec`] are kernel
//!   arguments for cudarc's launch builder (`builder.arg(&view)`): each passes its device address.
//!   cudarc does not know cuvmm's record of stream use, so call the view's `prepare_read` /
//!   `prepare_write` with the launch stream (as a cuvmm [`Stream`]) before launching, and keep
//!   the returned turn until the launch is queued: the launch then waits for earlier uses on
//!   other streams, and later cuvmm operations wait for it.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//! use cuvmm::{Context, Stream, VmmVec};
//! let cuda = CudaContext::new(0)?;
//! let cuda_stream = cuda.new_stream()?;
//! let module = cuda.load_module(cudarc::nvrtc::Ptx::from_src(cuvmm::kernels::PTX))?;
//! let fill = module.load_function("cuvmm_fill_u32")?;
//!
//! let ctx = Context::from_cudarc(&cuda)?;
//! let stream = Stream::from_cudarc(&ctx, &cuda_stream)?;
//! let mut v = VmmVec::<u32>::new(&ctx)?;
//! v.resize(1 << 20, 0)?;
//! let (n, value) = (v.len() as u64, 7u32);
//! let mut view = v.as_mut_slice();
//! let turn = view.prepare_write(&stream)?;
//! let mut launch = cuda_stream.launch_builder(&fill);
//! launch.arg(&view).arg(&n).arg(&value);
//! // SAFETY: cuvmm_fill_u32(uint32_t *p, uint64_t n, uint32_t value) writes the n elements.
//! unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
//! drop(turn); // queued: other threads may order their work on `v` now
//! assert!(v.to_vec()?.iter().all(|&x| x == 7)); // waits for the kernel on cudarc's stream
//! # Ok(()) }
//! ```

use crate::context::Context;
use crate::driver::sys::CUdeviceptr;
use crate::error::{Error, Result};
use crate::memory::{DeviceSlice, DeviceSliceMut};
use crate::stream::Stream;
use crate::vmm::VmmVec;
use crate::DeviceCopy;
use ::cudarc::driver::{LaunchArgs, PushKernelArg};
use std::sync::Arc;

impl Context {
    /// The cuvmm handle of the context `cuda` uses: the primary context of its device, retained
    /// once more for as long as the returned value lives.
    pub fn from_cudarc(cuda: &Arc<::cudarc::driver::CudaContext>) -> Result<Context> {
        let ctx = Context::for_ordinal(cuda.ordinal())?;
        if ctx.raw().cast::<std::ffi::c_void>() != cuda.cu_ctx().cast::<std::ffi::c_void>() {
            return Err(Error::invalid(
                "the cudarc context is not its device's primary context, which cuvmm works in",
            ));
        }
        Ok(ctx)
    }
}

impl Stream {
    /// A cuvmm handle of a stream cudarc created, for cuvmm operations and for ordering views
    /// used by launches on it. It holds a clone of `stream`, so the stream outlives every use
    /// cuvmm makes of it, and cuvmm never destroys it.
    pub fn from_cudarc(ctx: &Context, stream: &Arc<::cudarc::driver::CudaStream>) -> Result<Stream> {
        if stream.context().cu_ctx().cast::<std::ffi::c_void>() != ctx.raw().cast::<std::ffi::c_void>() {
            return Err(Error::invalid("the cudarc stream belongs to another context"));
        }
        // CU_STREAM_PER_THREAD names a different stream on every thread; cuvmm's streams are used
        // from any thread, so that handle would order the wrong work.
        if stream.cu_stream() as usize == 0x2 {
            return Err(Error::invalid(
                "cudarc's per-thread stream means another stream on each thread; use one of its streams",
            ));
        }
        let raw = stream.cu_stream().cast();
        Ok(Stream::from_parts(ctx, raw, Some(Box::new(Arc::clone(stream)))))
    }
}

/// Pushes the device address `addr` (a field of a view or vector borrowed for `'b`) as a kernel
/// argument of pointer type.
#[inline(always)]
fn push_addr<'a, 'b: 'a>(args: &mut LaunchArgs<'a>, addr: &'b CUdeviceptr) {
    <LaunchArgs<'a> as PushKernelArg<&'b CUdeviceptr>>::arg(args, addr);
}

// Views and vectors are kernel arguments through these impls and not as `DeviceRepr`: that trait
// also lets cudarc's safe copies rebuild values of the type from device bytes, which for an owner
// (`VmmVec`) or a unique view (`DeviceSliceMut`) would make a second one.
//
// What is pushed is the device address, a `CUdeviceptr` inside the argument, which is borrowed
// for 'b and so outlives the builder; a kernel parameter of pointer type reads exactly those
// bytes. Launching is `unsafe` in cudarc: the caller vouches that the kernel stays within the view.

// SAFETY: see above.
unsafe impl<'a, 'b: 'a, 'c, T: DeviceCopy> PushKernelArg<&'b DeviceSlice<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceSlice<'c, T>) -> &mut Self {
        push_addr(self, arg.addr_ref());
        self
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, 'c, T: DeviceCopy> PushKernelArg<&'b DeviceSliceMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceSliceMut<'c, T>) -> &mut Self {
        push_addr(self, arg.addr_ref());
        self
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, 'c, T: DeviceCopy> PushKernelArg<&'b mut DeviceSliceMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceSliceMut<'c, T>) -> &mut Self {
        push_addr(self, arg.addr_ref());
        self
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T: DeviceCopy> PushKernelArg<&'b VmmVec<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b VmmVec<T>) -> &mut Self {
        push_addr(self, arg.addr_ref());
        self
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T: DeviceCopy> PushKernelArg<&'b mut VmmVec<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut VmmVec<T>) -> &mut Self {
        push_addr(self, arg.addr_ref());
        self
    }
}
