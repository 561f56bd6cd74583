//! Page-locked host memory: allocated by the driver or registered with it.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::{c_uint, c_void};

/// `cuMemHostAlloc`: `bytes` of new page-locked memory.
#[inline]
pub fn alloc(api: &Api, bytes: usize, flags: c_uint) -> Result<*mut c_void> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the flags.
    unsafe { api.cuMemHostAlloc(&mut p, bytes, flags) }?;
    Ok(p)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `p` came from [`alloc`], is freed once, and nothing uses it afterwards (no queued copy either).
#[inline]
pub unsafe fn free(api: &Api, p: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemFreeHost(p) }
}

/// `cuMemHostRegister`.
///
/// # Safety
/// `[p, p + bytes)` is memory of this process that stays mapped until [`unregister`].
#[inline]
pub unsafe fn register(api: &Api, p: *mut c_void, bytes: usize, flags: c_uint) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemHostRegister(p, bytes, flags) }
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// The caller registered `p` and unregisters it once, when no queued copy uses it any more.
#[inline]
pub unsafe fn unregister(api: &Api, p: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemHostUnregister(p) }
}

/// `cuMemHostGetDevicePointer`: the device address of page-locked memory mapped for the device.
/// The driver only looks `p` up, and refuses memory it does not know.
#[inline]
// An address looked up, never read through: safe to call with any pointer.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn get_device_pointer(api: &Api, p: *mut c_void) -> Result<CUdeviceptr> {
    let mut d: CUdeviceptr = 0;
    // SAFETY: the out-pointer is a valid local; `p` is not dereferenced; flags must be 0.
    unsafe { api.cuMemHostGetDevicePointer(&mut d, p, 0) }?;
    Ok(d)
}
