//! Contexts: the devices' primary contexts and the calling thread's current one.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::c_int;

/// `cuDevicePrimaryCtxRetain`: `dev`'s primary context, retained once more.
#[inline]
pub fn primary_retain(api: &Api, dev: CUdevice) -> Result<CUcontext> {
    let mut raw: CUcontext = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the device.
    unsafe { api.cuDevicePrimaryCtxRetain(&mut raw, dev) }?;
    Ok(raw)
}

/// `cuDevicePrimaryCtxRelease`.
///
/// # Safety
/// The caller took the retain this releases (with [`primary_retain`]) and releases it once: a
/// release of someone else's may destroy the context under them.
#[inline]
pub unsafe fn primary_release(api: &Api, dev: CUdevice) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuDevicePrimaryCtxRelease(dev) }
}

/// `cuCtxSetCurrent`.
///
/// # Safety
/// `ctx` is null or a live context.
#[inline]
pub unsafe fn set_current(api: &Api, ctx: CUcontext) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuCtxSetCurrent(ctx) }
}

/// `cuCtxSynchronize`: waits for the current context's work.
#[inline]
pub fn synchronize(api: &Api) -> Result<()> {
    // SAFETY: no arguments.
    unsafe { api.cuCtxSynchronize() }
}

/// `cuCtxGetStreamPriorityRange`: `(least, greatest)`.
#[inline]
pub fn stream_priority_range(api: &Api) -> Result<(c_int, c_int)> {
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: both out-pointers are valid locals.
    unsafe { api.cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }?;
    Ok((least, greatest))
}

/// `cuCtxGetCurrent`: the calling thread's current context (null when none is).
#[inline]
pub fn get_current(api: &Api) -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuCtxGetCurrent(&mut ctx) }?;
    Ok(ctx)
}
