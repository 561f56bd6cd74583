//! The driver's stream-ordered pool (CUDA 11.2): what cuvmm's stream allocator is measured
//! against. Each entry point is optional: a driver without it returns [`Error::Unsupported`].
//!
//! [`Error::Unsupported`]: crate::Error::Unsupported

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::c_void;

/// `cuDeviceGetDefaultMemPool`: the device's default pool, which lives as long as the driver.
#[inline]
pub fn default_mem_pool(api: &Api, dev: CUdevice) -> Result<CUmemoryPool> {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the out-pointer is a valid local; the driver checks the device.
    unsafe { api.cuDeviceGetDefaultMemPool(&mut pool, dev) }?;
    Ok(pool)
}

/// `cuMemAllocAsync`: `bytes` from the pool of the stream's device, ordered on `stream`.
///
/// # Safety
/// `stream` is live, or a default-stream value, in the current context.
#[inline]
pub unsafe fn alloc_async(api: &Api, bytes: usize, stream: CUstream) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: the out-pointer is a valid local; the stream per the caller's contract.
    unsafe { api.cuMemAllocAsync(&mut ptr, bytes, stream) }?;
    Ok(ptr)
}

/// `cuMemFreeAsync`.
///
/// # Safety
/// `ptr` came from [`alloc_async`] and is freed once; `stream` as there; no work queued after
/// the free on any stream uses the memory.
#[inline]
pub unsafe fn free_async(api: &Api, ptr: CUdeviceptr, stream: CUstream) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemFreeAsync(ptr, stream) }
}

/// `cuMemPoolSetAttribute` of an attribute whose value is a `cuuint64_t` (the release threshold,
/// the high-water marks).
///
/// # Safety
/// `pool` is live; `attr` takes a `cuuint64_t`.
#[inline]
pub unsafe fn set_attribute_u64(
    api: &Api,
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
    value: u64,
) -> Result<()> {
    let mut value = value;
    // SAFETY: the value is a valid local of the type `attr` takes (the caller's contract).
    unsafe { api.cuMemPoolSetAttribute(pool, attr, (&mut value as *mut u64).cast::<c_void>()) }
}

/// `cuMemPoolGetAttribute` of an attribute whose value is a `cuuint64_t`.
///
/// # Safety
/// As [`set_attribute_u64`].
#[inline]
pub unsafe fn get_attribute_u64(api: &Api, pool: CUmemoryPool, attr: CUmemPool_attribute) -> Result<u64> {
    let mut value = 0u64;
    // SAFETY: the out-pointer is a valid local of the type `attr` writes (the caller's contract).
    unsafe { api.cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast::<c_void>()) }?;
    Ok(value)
}

/// `cuMemPoolTrimTo`: returns the pool's unused memory beyond `keep` bytes to the device.
///
/// # Safety
/// `pool` is live.
#[inline]
pub unsafe fn trim_to(api: &Api, pool: CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemPoolTrimTo(pool, keep) }
}
