//! Modules and kernel launches.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::{c_uint, c_void, CStr};

/// `cuModuleLoadData`: loads a module into the current context.
///
/// # Safety
/// `image` points to a module image the driver can parse without reading past its end: a cubin or
/// fatbin, or NUL-terminated PTX text followed by as many bytes as the driver reads ahead.
#[inline]
pub unsafe fn load_data(api: &Api, image: *const c_void) -> Result<CUmodule> {
    let mut raw: CUmodule = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the image per the caller's contract.
    unsafe { api.cuModuleLoadData(&mut raw, image) }?;
    Ok(raw)
}

/// `cuModuleGetFunction`.
///
/// # Safety
/// `module` is live.
#[inline]
pub unsafe fn get_function(api: &Api, module: CUmodule, name: &CStr) -> Result<CUfunction> {
    let mut raw: CUfunction = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the name is NUL-terminated; the module per the
    // caller's contract.
    unsafe { api.cuModuleGetFunction(&mut raw, module, name.as_ptr()) }?;
    Ok(raw)
}

/// `cuModuleUnload`.
///
/// # Safety
/// The caller owns `module`, unloads it once, and none of its kernels runs or is queued.
#[inline]
pub unsafe fn unload(api: &Api, module: CUmodule) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuModuleUnload(module) }
}

/// `cuLaunchKernel` with `params` and no `extra`.
///
/// # Safety
/// `f` is a live kernel of the current context; `stream` is live or a default-stream value;
/// `params` holds one pointer per kernel parameter, each to a value of the parameter's type; the
/// memory the kernel touches stays valid until it has run.
#[allow(clippy::too_many_arguments)]
#[inline]
pub unsafe fn launch_kernel(
    api: &Api,
    f: CUfunction,
    grid: (c_uint, c_uint, c_uint),
    block: (c_uint, c_uint, c_uint),
    shared_bytes: c_uint,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety); `extra` is null.
    unsafe {
        api.cuLaunchKernel(
            f,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            shared_bytes,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}
