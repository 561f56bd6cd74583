//! The driver's legacy sharing of `cuMemAlloc` memory between processes (`cuIpc*`): what
//! cuvmm's sharing is measured against.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::c_uint;

/// `cuIpcGetMemHandle`: a handle another process opens to reach the allocation at `ptr`.
///
/// # Safety
/// `ptr` is the start of a live `cuMemAlloc` allocation of the current context.
#[inline]
pub unsafe fn get_mem_handle(api: &Api, ptr: CUdeviceptr) -> Result<CUipcMemHandle> {
    let mut handle = CUipcMemHandle::default();
    // SAFETY: the out-pointer is a valid local; the allocation per the caller's contract.
    unsafe { api.cuIpcGetMemHandle(&mut handle, ptr) }?;
    Ok(handle)
}

/// `cuIpcOpenMemHandle`: maps another process's allocation into the current context.
///
/// # Safety
/// `handle` came from [`get_mem_handle`] in a process that keeps the allocation alive while it
/// is open here; the address is closed once with [`close_mem_handle`].
#[inline]
pub unsafe fn open_mem_handle(api: &Api, handle: CUipcMemHandle, flags: c_uint) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: the out-pointer is a valid local; the handle per the caller's contract.
    unsafe { api.cuIpcOpenMemHandle(&mut ptr, handle, flags) }?;
    Ok(ptr)
}

/// `cuIpcCloseMemHandle`.
///
/// # Safety
/// `ptr` came from [`open_mem_handle`], is closed once, and no queued work uses it.
#[inline]
pub unsafe fn close_mem_handle(api: &Api, ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuIpcCloseMemHandle(ptr) }
}
