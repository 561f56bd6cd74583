//! Devices: enumeration and attributes. Every call here takes only values the driver checks
//! (ordinals, device numbers), so all are safe.

use crate::driver::sys::*;
use crate::driver::Api;
use crate::error::Result;
use std::ffi::{c_char, c_int};

/// `cuDeviceGetCount`.
#[inline]
pub fn get_count(api: &Api) -> Result<c_int> {
    let mut n = 0;
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuDeviceGetCount(&mut n) }?;
    Ok(n)
}

/// `cuDeviceGet`: the device of an ordinal.
#[inline]
pub fn get(api: &Api, ordinal: c_int) -> Result<CUdevice> {
    let mut raw: CUdevice = 0;
    // SAFETY: the out-pointer is a valid local; the driver checks the ordinal.
    unsafe { api.cuDeviceGet(&mut raw, ordinal) }?;
    Ok(raw)
}

/// `cuDeviceGetName` into `buf` (NUL-terminated by the driver).
#[inline]
pub fn get_name(api: &Api, buf: &mut [c_char], dev: CUdevice) -> Result<()> {
    let len = c_int::try_from(buf.len()).unwrap_or(c_int::MAX);
    // SAFETY: the driver writes at most `len` bytes, which `buf` holds.
    unsafe { api.cuDeviceGetName(buf.as_mut_ptr(), len, dev) }
}

/// `cuDeviceGetUuid`.
#[inline]
pub fn get_uuid(api: &Api, dev: CUdevice) -> Result<CUuuid> {
    let mut u = CUuuid::default();
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuDeviceGetUuid(&mut u, dev) }?;
    Ok(u)
}

/// `cuDeviceTotalMem`.
#[inline]
pub fn total_mem(api: &Api, dev: CUdevice) -> Result<usize> {
    let mut bytes = 0;
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuDeviceTotalMem(&mut bytes, dev) }?;
    Ok(bytes)
}

/// `cuDeviceGetAttribute`.
#[inline]
pub fn get_attribute(api: &Api, attr: CUdevice_attribute, dev: CUdevice) -> Result<c_int> {
    let mut v = 0;
    // SAFETY: the out-pointer is a valid local; the driver checks the attribute.
    unsafe { api.cuDeviceGetAttribute(&mut v, attr, dev) }?;
    Ok(v)
}

/// `cuDeviceGetPCIBusId` into `buf` (NUL-terminated by the driver).
#[inline]
pub fn get_pci_bus_id(api: &Api, buf: &mut [c_char], dev: CUdevice) -> Result<()> {
    let len = c_int::try_from(buf.len()).unwrap_or(c_int::MAX);
    // SAFETY: the driver writes at most `len` bytes, which `buf` holds.
    unsafe { api.cuDeviceGetPCIBusId(buf.as_mut_ptr(), len, dev) }
}

/// `cuDeviceCanAccessPeer`.
#[inline]
pub fn can_access_peer(api: &Api, dev: CUdevice, peer: CUdevice) -> Result<bool> {
    let mut can = 0;
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuDeviceCanAccessPeer(&mut can, dev, peer) }?;
    Ok(can != 0)
}
