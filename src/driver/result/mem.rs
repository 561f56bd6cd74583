//! Device memory: `cuMemAlloc` buffers, copies and fills, and the virtual memory management calls
//! (physical allocations, address reservations, mappings, access, sharing).

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::{c_int, c_uchar, c_uint, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `cuMemGetInfo` of the current context: `(free, total)` bytes.
#[inline]
pub fn get_info(api: &Api) -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both out-pointers are valid locals.
    unsafe { api.cuMemGetInfo(&mut free, &mut total) }?;
    Ok((free, total))
}

/// `cuMemAlloc` in the current context.
#[inline]
pub fn alloc(api: &Api, bytes: usize) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: the out-pointer is a valid local; the driver checks the size.
    unsafe { api.cuMemAlloc(&mut ptr, bytes) }?;
    Ok(ptr)
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` came from [`alloc`], is freed once, and nothing uses it afterwards.
#[inline]
pub unsafe fn free(api: &Api, ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemFree(ptr) }
}

/// `cuMemcpyHtoD`.
///
/// # Safety
/// `src` is readable and `dst` device memory writable for `bytes` bytes.
#[inline]
pub unsafe fn memcpy_htod(api: &Api, dst: CUdeviceptr, src: *const c_void, bytes: usize) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyHtoD(dst, src, bytes) }
}

/// `cuMemcpyDtoH`.
///
/// # Safety
/// `dst` is writable and `src` device memory readable for `bytes` bytes; whatever bytes land make
/// valid values of `dst`'s type.
#[inline]
pub unsafe fn memcpy_dtoh(api: &Api, dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyDtoH(dst, src, bytes) }
}

/// `cuMemcpyHtoDAsync`.
///
/// # Safety
/// As [`memcpy_htod`], until the copy has run on `stream` (live, or a default-stream value).
#[inline]
pub unsafe fn memcpy_htod_async(
    api: &Api,
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyHtoDAsync(dst, src, bytes, stream) }
}

/// `cuMemcpyDtoHAsync`.
///
/// # Safety
/// As [`memcpy_dtoh`], until the copy has run on `stream` (live, or a default-stream value).
#[inline]
pub unsafe fn memcpy_dtoh_async(
    api: &Api,
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyDtoHAsync(dst, src, bytes, stream) }
}

/// `cuMemcpyDtoDAsync`.
///
/// # Safety
/// `src` readable and `dst` writable device memory for `bytes` bytes until the copy has run on
/// `stream` (live, or a default-stream value).
#[inline]
pub unsafe fn memcpy_dtod_async(
    api: &Api,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyDtoDAsync(dst, src, bytes, stream) }
}

/// `cuMemsetD8Async`: `count` bytes of `value`.
///
/// # Safety
/// `dst` is writable device memory for `count` bytes until the fill has run on `stream` (live, or
/// a default-stream value).
#[inline]
pub unsafe fn memset_d8_async(
    api: &Api,
    dst: CUdeviceptr,
    value: c_uchar,
    count: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemsetD8Async(dst, value, count, stream) }
}

/// `cuMemsetD32Async`: `count` 32-bit words of `value`.
///
/// # Safety
/// As [`memset_d8_async`], for `4 * count` bytes.
#[inline]
pub unsafe fn memset_d32_async(
    api: &Api,
    dst: CUdeviceptr,
    value: c_uint,
    count: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemsetD32Async(dst, value, count, stream) }
}

/// `cuMemCreate`: `size` bytes of new physical memory as `prop` describes.
#[inline]
pub fn create(api: &Api, size: usize, prop: &CUmemAllocationProp) -> Result<CUmemGenericAllocationHandle> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: the out-pointer is a valid local; `prop` is a whole CUmemAllocationProp (its Windows
    // metadata pointer is not read on Linux); flags must be 0.
    unsafe { api.cuMemCreate(&mut handle, size, prop, 0) }?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// The caller owns this reference to `handle` (from [`create`] or an import) and releases it once.
#[inline]
pub unsafe fn release(api: &Api, handle: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemRelease(handle) }
}

/// `cuMemAddressReserve`: `size` bytes of new virtual address space. `addr` is only a hint.
#[inline]
pub fn address_reserve(api: &Api, size: usize, alignment: usize, addr: CUdeviceptr) -> Result<CUdeviceptr> {
    let mut base: CUdeviceptr = 0;
    // SAFETY: the out-pointer is a valid local; the driver checks size and alignment; flags 0.
    unsafe { api.cuMemAddressReserve(&mut base, size, alignment, addr, 0) }?;
    Ok(base)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// The caller reserved `[ptr, ptr + size)`, nothing is mapped in it, and it is freed once.
#[inline]
pub unsafe fn address_free(api: &Api, ptr: CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemAddressFree(ptr, size) }
}

/// `cuMemMap` (flags 0): `size` bytes of `handle` from `offset`, at `ptr`.
///
/// # Safety
/// `[ptr, ptr + size)` lies in a reservation of the caller's with nothing mapped there; `handle`
/// is live and holds `offset + size` bytes.
#[inline]
pub unsafe fn map(
    api: &Api,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemMap(ptr, size, offset, handle, 0) }
}

/// `cuMemUnmap`.
///
/// # Safety
/// The caller mapped `[ptr, ptr + size)`, unmaps it once, and no work that uses it is queued.
#[inline]
pub unsafe fn unmap(api: &Api, ptr: CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemUnmap(ptr, size) }
}

/// `cuMemSetAccess` for each of `descs`.
///
/// # Safety
/// `[ptr, ptr + size)` is mapped by the caller, who decides who may access it.
#[inline]
pub unsafe fn set_access(api: &Api, ptr: CUdeviceptr, size: usize, descs: &[CUmemAccessDesc]) -> Result<()> {
    // SAFETY: `descs` is valid for its length; the range per the caller's contract.
    unsafe { api.cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()) }
}

/// `cuMemGetAccess`: the `CU_MEM_ACCESS_FLAGS_*` `location` has at `ptr`.
#[inline]
pub fn get_access(api: &Api, location: &CUmemLocation, ptr: CUdeviceptr) -> Result<u64> {
    let mut flags = 0;
    // SAFETY: the out-pointer is a valid local, `location` a whole CUmemLocation; the driver only
    // looks `ptr` up.
    unsafe { api.cuMemGetAccess(&mut flags, location, ptr) }?;
    Ok(flags)
}

/// `cuMemGetAllocationGranularity`.
#[inline]
pub fn get_allocation_granularity(
    api: &Api,
    prop: &CUmemAllocationProp,
    option: CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: the out-pointer is a valid local; `prop` is a whole CUmemAllocationProp.
    unsafe { api.cuMemGetAllocationGranularity(&mut g, prop, option) }?;
    Ok(g)
}

/// `cuMemGetAllocationPropertiesFromHandle`. The driver looks the handle up and refuses one it
/// does not know.
#[inline]
pub fn get_allocation_properties(
    api: &Api,
    handle: CUmemGenericAllocationHandle,
) -> Result<CUmemAllocationProp> {
    let mut prop = CUmemAllocationProp::default();
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) }?;
    Ok(prop)
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor (the allocation must have been
/// created with that handle type).
#[inline]
pub fn export_fd(api: &Api, handle: CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for the POSIX-fd type the driver writes an int through the pointer.
    unsafe {
        api.cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast(),
            handle,
            CUmemAllocationHandleType::POSIX_FILE_DESCRIPTOR,
            0,
        )
    }?;
    // SAFETY: the driver created this descriptor for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemExportToShareableHandle` as a fabric handle (the allocation must have been created with
/// that handle type).
#[inline]
pub fn export_fabric(api: &Api, handle: CUmemGenericAllocationHandle) -> Result<CUmemFabricHandle> {
    let mut h = CUmemFabricHandle::default();
    // SAFETY: for the fabric type the driver writes a CUmemFabricHandle through the pointer.
    unsafe {
        api.cuMemExportToShareableHandle(
            (&mut h as *mut CUmemFabricHandle).cast(),
            handle,
            CUmemAllocationHandleType::FABRIC,
            0,
        )
    }?;
    Ok(h)
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor (the driver dups it: the caller
/// keeps `fd`). The returned handle is the caller's to [`release`].
#[inline]
pub fn import_fd(api: &Api, fd: BorrowedFd<'_>) -> Result<CUmemGenericAllocationHandle> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: for the POSIX-fd type the driver takes the fd's value cast to a pointer and dups it;
    // the out-pointer is a valid local.
    unsafe {
        api.cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as isize as *mut c_void,
            CUmemAllocationHandleType::POSIX_FILE_DESCRIPTOR,
        )
    }?;
    Ok(handle)
}

/// `cuMemImportFromShareableHandle` of a fabric handle. The returned handle is the caller's to
/// [`release`].
#[inline]
pub fn import_fabric(api: &Api, fabric: &CUmemFabricHandle) -> Result<CUmemGenericAllocationHandle> {
    let mut h = *fabric;
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: for the fabric type the driver reads a CUmemFabricHandle through the pointer; the
    // out-pointer is a valid local.
    unsafe {
        api.cuMemImportFromShareableHandle(
            &mut handle,
            (&mut h as *mut CUmemFabricHandle).cast(),
            CUmemAllocationHandleType::FABRIC,
        )
    }?;
    Ok(handle)
}

/// `cuMemcpyDtoD`: a copy between device allocations, synchronous with the host.
///
/// # Safety
/// `src` is readable and `dst` writable device memory for `bytes` bytes, in the current context.
#[inline]
pub unsafe fn memcpy_dtod(api: &Api, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyDtoD(dst, src, bytes) }
}

/// `cuMemcpyPeerAsync`: a copy from `src` in `src_ctx` to `dst` in `dst_ctx`, ordered on
/// `stream`.
///
/// # Safety
/// Both contexts are live; `src` is readable and `dst` writable for `bytes` bytes in their
/// contexts until the copy has run; `stream` is live or a default-stream value.
#[inline]
pub unsafe fn memcpy_peer_async(
    api: &Api,
    dst: CUdeviceptr,
    dst_ctx: CUcontext,
    src: CUdeviceptr,
    src_ctx: CUcontext,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (see # Safety).
    unsafe { api.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream) }
}

/// `cuMemGetAddressRange`: the base and size of the allocation that holds `ptr`, which the
/// driver looks up (and refuses when it knows none).
#[inline]
pub fn get_address_range(api: &Api, ptr: CUdeviceptr) -> Result<(CUdeviceptr, usize)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: the out-pointers are valid locals; `ptr` is only looked up.
    unsafe { api.cuMemGetAddressRange(&mut base, &mut size, ptr) }?;
    Ok((base, size))
}
