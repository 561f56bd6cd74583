//! Synchronous copies between host slices and device memory, with length checks. Asynchronous
//! copies live with streams.

use crate::context::Context;
use crate::driver::{driver, result, sys::CUdeviceptr};
use crate::error::{Error, Result};
use crate::memory::DeviceCopy;

fn same_len(what: &str, host: usize, device: usize) -> Result<()> {
    if host != device {
        return Err(Error::invalid(format!("{what}: host slice has {host} elements, device side {device}")));
    }
    Ok(())
}

/// Copies `src` to `dst`, which holds `dst_len` elements.
pub(crate) fn htod<T: DeviceCopy>(ctx: &Context, dst: CUdeviceptr, src: &[T], dst_len: usize) -> Result<()> {
    same_len("copy to device", src.len(), dst_len)?;
    if src.is_empty() {
        return Ok(());
    }
    ctx.bind()?;
    let api = driver()?.api();
    // SAFETY: `src` is a live slice of `size_of_val(src)` bytes; the caller's `dst` holds as many.
    // cuMemcpyHtoD returns once `src` may be reused, but from pageable memory the DMA into `dst` may
    // still be in flight: waiting for the legacy stream makes the data visible to every stream.
    unsafe {
        result::mem::memcpy_htod(api, dst, src.as_ptr().cast(), std::mem::size_of_val(src))?;
        result::stream::synchronize(api, std::ptr::null_mut())
    }
}

/// Copies `src_len` elements at `src` into `dst`.
pub(crate) fn dtoh<T: DeviceCopy>(
    ctx: &Context,
    dst: &mut [T],
    src: CUdeviceptr,
    src_len: usize,
) -> Result<()> {
    same_len("copy to host", dst.len(), src_len)?;
    if dst.is_empty() {
        return Ok(());
    }
    ctx.bind()?;
    // SAFETY: `dst` is writable for its byte size; `T: DeviceCopy` makes any bytes a valid value;
    // the synchronous copy has finished when the call returns.
    unsafe {
        result::mem::memcpy_dtoh(driver()?.api(), dst.as_mut_ptr().cast(), src, std::mem::size_of_val(dst))
    }
}

/// Copies `len` elements at `src` into a new vector.
pub(crate) fn dtoh_vec<T: DeviceCopy>(ctx: &Context, src: CUdeviceptr, len: usize) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    if len == 0 {
        return Ok(v);
    }
    ctx.bind()?;
    // SAFETY: the vector has room for `len` elements; the copy fills all of them before `set_len`,
    // and `T: DeviceCopy` makes any bytes valid.
    unsafe {
        result::mem::memcpy_dtoh(
            driver()?.api(),
            v.as_mut_ptr().cast(),
            src,
            len * std::mem::size_of::<T>(),
        )?;
        v.set_len(len);
    }
    Ok(v)
}

/// Copies host data into a device view (synchronous; lengths must match).
pub fn to_device<T: DeviceCopy>(
    ctx: &Context,
    dst: &mut crate::DeviceSliceMut<'_, T>,
    src: &[T],
) -> Result<()> {
    // The host wait records nothing, so `htod` checking the lengths after it loses nothing.
    let _turn = dst.host(crate::stream::order::Use::Write)?;
    htod(ctx, dst.ptr(), src, dst.len())
}

/// Copies a device view into host memory (synchronous; lengths must match).
pub fn to_host<T: DeviceCopy>(ctx: &Context, dst: &mut [T], src: &crate::DeviceSlice<'_, T>) -> Result<()> {
    let _turn = src.host(crate::stream::order::Use::Read)?;
    dtoh(ctx, dst, src.ptr(), src.len())
}
