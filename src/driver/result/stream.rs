//! Streams: creation, ordering, queries, host functions and graph capture.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::{c_int, c_uint, c_void};

/// `cuStreamCreate`.
#[inline]
pub fn create(api: &Api, flags: c_uint) -> Result<CUstream> {
    let mut raw: CUstream = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the flags.
    unsafe { api.cuStreamCreate(&mut raw, flags) }?;
    Ok(raw)
}

/// `cuStreamCreateWithPriority`.
#[inline]
pub fn create_with_priority(api: &Api, flags: c_uint, priority: c_int) -> Result<CUstream> {
    let mut raw: CUstream = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the flags and clamps the priority.
    unsafe { api.cuStreamCreateWithPriority(&mut raw, flags, priority) }?;
    Ok(raw)
}

/// `cuStreamDestroy`.
///
/// # Safety
/// The caller owns `stream` and destroys it once; nothing queues on it afterwards.
#[inline]
pub unsafe fn destroy(api: &Api, stream: CUstream) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuStreamDestroy(stream) }
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// `stream` is live or one of the special default-stream values (null among them).
#[inline]
pub unsafe fn synchronize(api: &Api, stream: CUstream) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuStreamSynchronize(stream) }
}

/// `cuStreamQuery`: whether all queued work is done (`CUDA_ERROR_NOT_READY` becomes `false`).
///
/// # Safety
/// As [`synchronize`].
#[inline]
pub unsafe fn query(api: &Api, stream: CUstream) -> Result<bool> {
    // SAFETY: the caller's contract (see # Safety).
    match unsafe { api.cuStreamQuery(stream) } {
        Ok(()) => Ok(true),
        Err(e) if e.is_code(CUresult::ERROR_NOT_READY) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `cuStreamWaitEvent` (flags 0): work queued on `stream` from now on waits for `event`.
///
/// # Safety
/// `event` is live; `stream` as in [`synchronize`].
#[inline]
pub unsafe fn wait_event(api: &Api, stream: CUstream, event: CUevent) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety); flags must be 0.
    unsafe { api.cuStreamWaitEvent(stream, event, 0) }
}

/// `cuLaunchHostFunc`.
///
/// # Safety
/// `stream` as in [`synchronize`]; `f` may be called once with `data` on a driver thread, after
/// everything queued before it, and must be sound to call so then.
#[inline]
pub unsafe fn launch_host_func(api: &Api, stream: CUstream, f: CUhostFn, data: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuLaunchHostFunc(stream, f, data) }
}

/// `cuStreamIsCapturing`: the `CU_STREAM_CAPTURE_STATUS_*` of `stream`.
///
/// # Safety
/// As [`synchronize`].
#[inline]
pub unsafe fn is_capturing(api: &Api, stream: CUstream) -> Result<c_int> {
    let mut status = 0;
    // SAFETY: the out-pointer is a valid local; the stream per the caller's contract.
    unsafe { api.cuStreamIsCapturing(stream, &mut status) }?;
    Ok(status)
}

/// `cuStreamGetId`: the stream's id, unique for the life of the process (CUDA 12.0 and later).
///
/// # Safety
/// `stream` is live (not a special default-stream value).
#[inline]
pub unsafe fn get_id(api: &Api, stream: CUstream) -> Result<u64> {
    let mut id = 0;
    // SAFETY: the out-pointer is a valid local; the stream per the caller's contract.
    unsafe { api.cuStreamGetId(stream, &mut id) }?;
    Ok(id)
}

/// `cuStreamGetCaptureInfo`: the capture status of `stream` and the capture's id.
///
/// # Safety
/// As [`synchronize`].
#[inline]
pub unsafe fn capture_info(api: &Api, stream: CUstream) -> Result<(c_int, u64)> {
    let (mut status, mut id) = (0, 0u64);
    // SAFETY: the out-pointers are valid locals, the optional ones null; the stream per the
    // caller's contract.
    unsafe {
        api.cuStreamGetCaptureInfo(
            stream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }?;
    Ok((status, id))
}

/// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture mode to `mode` and
/// returns the one it replaces.
#[inline]
pub fn exchange_capture_mode(api: &Api, mode: c_int) -> Result<c_int> {
    let mut mode = mode;
    // SAFETY: the in/out pointer is a valid local; the driver checks the mode.
    unsafe { api.cuThreadExchangeStreamCaptureMode(&mut mode) }?;
    Ok(mode)
}
