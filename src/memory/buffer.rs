//! Plain device allocations (`cuMemAlloc`): the reference the VMM types are measured against, and
//! small scratch buffers.

use crate::context::Context;
use crate::driver::{driver, result, sys::CUdeviceptr};
use crate::error::{Error, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::order::{Tracker, Use};
use crate::vmm::bytes_for;
use std::marker::PhantomData;

/// `len` elements of device memory from `cuMemAlloc`, freed on drop after the context's queued work.
pub struct DeviceBuffer<T: DeviceCopy> {
    ctx: Context,
    ptr: CUdeviceptr,
    len: usize,
    order: Tracker,
    _t: PhantomData<T>,
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Uninitialised (arbitrary contents, which `T: DeviceCopy` makes harmless) storage for `len` elements.
    pub fn new(ctx: &Context, len: usize) -> Result<Self> {
        let bytes = bytes_for(len, std::mem::size_of::<T>())?;
        if bytes == 0 {
            return Err(Error::invalid("a device buffer needs at least one byte"));
        }
        ctx.bind()?;
        let ptr = result::mem::alloc(driver()?.api(), bytes)?;
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, len, order: Tracker::new(), _t: PhantomData })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        let mut b = DeviceBuffer::new(ctx, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// Copies `data` in; lengths must match.
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        let ctx = self.ctx.clone();
        crate::stream::copy::to_device(&ctx, &mut self.as_mut_slice(), data)
    }

    /// Copies everything out into `out`; lengths must match.
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        crate::stream::copy::to_host(&self.ctx, out, &self.as_slice())
    }

    /// Copies everything out.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let _turn = self.as_slice().host(Use::Read)?;
        crate::stream::copy::dtoh_vec(&self.ctx, self.ptr, self.len)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty buffers are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// A read-only view.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the allocation holds `len` elements and lives as long as the borrow.
        unsafe { DeviceSlice::tracked(self.ptr, self.len, &self.order) }
    }

    /// A writable view.
    pub fn as_mut_slice(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as above, and `&mut self` makes it the only writable view.
        unsafe { DeviceSliceMut::tracked(self.ptr, self.len, &self.order) }
    }

    /// The buffer's context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl<T: DeviceCopy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let (pending, ctx) = (self.order.take(), self.ctx.clone());
        crate::driver::callback::release_in(&self.ctx, self.ptr, move |api, ptr| {
            // Streams of other contexts (peers) that used it, then this one's: waiting for them
            // binds their contexts, so this one is made current again.
            pending.wait();
            let _ = ctx.bind();
            let _ = result::ctx::synchronize(api);
            // SAFETY: the allocation from cuMemAlloc in `new` is freed once, with no work queued
            // on it any more.
            crate::error::record_drop(unsafe { result::mem::free(api, ptr) });
        });
    }
}
