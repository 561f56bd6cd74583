//! Finding entry points by name and ABI version through the driver's `cuGetProcAddress`: what the
//! table of entry points is filled from, and what the loader finds in a library it opened. Both
//! take it from here.

use super::sys::{CUdriverProcAddressQueryResult, CUresult, CU_GET_PROC_ADDRESS_LEGACY_STREAM};
use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::NonNull;

/// The CUDA 12 form, which says why a symbol was not found.
type GetProcAddressV2 = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    u64,
    *mut CUdriverProcAddressQueryResult,
) -> CUresult;
/// The CUDA 11.3 form, exported as plain `cuGetProcAddress`.
type GetProcAddressV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;

/// Resolves entry points by name and ABI version.
pub(crate) enum Resolver {
    V2(GetProcAddressV2),
    V1(GetProcAddressV1),
}

impl Resolver {
    /// Finds `name` (NUL-terminated) at ABI `version`, or says why not.
    pub(crate) fn lookup(&self, name: &'static str, version: c_int) -> Result<NonNull<c_void>, &'static str> {
        let cname = CStr::from_bytes_with_nul(name.as_bytes()).map_err(|_| "name is not NUL-terminated")?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let (rc, status) = match self {
            Resolver::V2(f) => {
                let mut status = CUdriverProcAddressQueryResult::SYMBOL_NOT_FOUND;
                // SAFETY: `f` is cuGetProcAddress_v2, whose signature GetProcAddressV2 matches
                // cuda.h; the name is NUL-terminated and both out-pointers are valid locals.
                let rc = unsafe {
                    f(cname.as_ptr(), &mut p, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &mut status)
                };
                (rc, status)
            }
            Resolver::V1(f) => {
                // SAFETY: as above, for the four-argument cuGetProcAddress.
                let rc = unsafe { f(cname.as_ptr(), &mut p, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM) };
                (rc, CUdriverProcAddressQueryResult::SUCCESS)
            }
        };
        match NonNull::new(p) {
            Some(p) if rc.is_success() && status == CUdriverProcAddressQueryResult::SUCCESS => Ok(p),
            _ if status == CUdriverProcAddressQueryResult::VERSION_NOT_SUFFICIENT => {
                Err("the driver is older than this ABI version")
            }
            _ => Err("the driver does not export it"),
        }
    }
}

/// The driver's `cuGetProcAddress` in the library `handle` opened (named `library` in errors): the
/// CUDA 12 form where it is exported, else the CUDA 11.3 one.
pub(crate) fn find_get_proc_address(library: &str, handle: NonNull<c_void>) -> Result<Resolver> {
    let sym = |name: &CStr| {
        // SAFETY: `handle` came from a successful dlopen and is never closed; the name is
        // NUL-terminated.
        NonNull::new(unsafe { libc::dlsym(handle.as_ptr(), name.as_ptr()) })
    };
    if let Some(p) = sym(c"cuGetProcAddress_v2") {
        // SAFETY: cuda.h declares cuGetProcAddress_v2 with exactly GetProcAddressV2's signature.
        return Ok(Resolver::V2(unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(p.as_ptr()) }));
    }
    if let Some(p) = sym(c"cuGetProcAddress") {
        // SAFETY: the exported plain cuGetProcAddress is the four-argument CUDA 11.3 form.
        return Ok(Resolver::V1(unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV1>(p.as_ptr()) }));
    }
    Err(Error::MissingEntryPoint {
        library: library.to_owned(),
        name: "cuGetProcAddress",
        version: 11030,
        reason: "not exported; is this libcuda.so from a driver older than CUDA 11.3?",
    })
}
