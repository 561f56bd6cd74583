//! Events.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::c_uint;

/// `cuEventCreate`.
#[inline]
pub fn create(api: &Api, flags: c_uint) -> Result<CUevent> {
    let mut raw: CUevent = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the flags.
    unsafe { api.cuEventCreate(&mut raw, flags) }?;
    Ok(raw)
}

/// `cuEventRecord`.
///
/// # Safety
/// `event` is live; `stream` is live or one of the special default-stream values.
#[inline]
pub unsafe fn record(api: &Api, event: CUevent, stream: CUstream) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuEventRecord(event, stream) }
}

/// `cuEventSynchronize`.
///
/// # Safety
/// `event` is live.
#[inline]
pub unsafe fn synchronize(api: &Api, event: CUevent) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuEventSynchronize(event) }
}

/// `cuEventQuery`: whether the work before the record has completed (`CUDA_ERROR_NOT_READY`
/// becomes `false`).
///
/// # Safety
/// `event` is live.
#[inline]
pub unsafe fn query(api: &Api, event: CUevent) -> Result<bool> {
    // SAFETY: the caller's contract (see # Safety).
    match unsafe { api.cuEventQuery(event) } {
        Ok(()) => Ok(true),
        Err(e) if e.is_code(CUresult::ERROR_NOT_READY) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `cuEventElapsedTime`: milliseconds from `start` to `end`.
///
/// # Safety
/// Both events are live.
#[inline]
pub unsafe fn elapsed_time(api: &Api, start: CUevent, end: CUevent) -> Result<f32> {
    let mut ms = 0f32;
    // SAFETY: the out-pointer is a valid local; the events per the caller's contract.
    unsafe { api.cuEventElapsedTime(&mut ms, start, end) }?;
    Ok(ms)
}

/// `cuEventDestroy`.
///
/// # Safety
/// The caller owns `event` and destroys it once; nothing uses it afterwards.
#[inline]
pub unsafe fn destroy(api: &Api, event: CUevent) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuEventDestroy(event) }
}
