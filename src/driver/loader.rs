//! Opening the driver library and resolving entry points.

use super::api::Api;
use super::resolver::find_get_proc_address;
use crate::error::{Error, LoadAttempt, Result};
use std::ffi::{c_void, CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::ptr::NonNull;
use std::sync::OnceLock;

/// The environment variable that names the driver library to open instead of the default ones.
///
/// Tests use it to exercise the failure paths (`CUVMM_LIBCUDA=/nonexistent cuvmm info`); it also
/// lets a user pick one of several installed drivers.
///
/// It is trusted configuration, like `LD_LIBRARY_PATH` or `LD_PRELOAD`: whoever sets it chooses
/// the code that runs inside the process, and [`Driver::load_default`] and [`driver`] load the
/// library it names under the contract of [`Driver::load_from`] without checking it. A program
/// that runs with more privileges than whoever controls its environment (a setuid binary, a
/// service that passes a client's environment on) must remove it, as the dynamic loader ignores
/// `LD_PRELOAD` in such programs.
pub const LIBRARY_ENV: &str = "CUVMM_LIBCUDA";

/// The sonames tried, in order, when [`LIBRARY_ENV`] is not set (or set to nothing).
pub const DEFAULT_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// An opened driver: its resolved entry points, initialised with `cuInit`.
///
/// The library is never closed: entry points may be called from any thread at any time until the
/// process exits, and NVIDIA's driver does not support being unloaded from a live process.
pub struct Driver {
    api: Api,
    version: i32,
}

static GLOBAL: OnceLock<Result<Driver>> = OnceLock::new();

/// The process-wide driver, opened and initialised on first use.
///
/// The outcome, success or failure, is kept: with no driver every later call returns the same
/// [`Error::DriverNotFound`] without trying again.
///
/// Inside a stream host function it returns [`Error::InHostFunction`]: CUDA forbids driver calls
/// there (see [`callback`](super::callback)).
#[inline]
pub fn driver() -> Result<&'static Driver> {
    if super::callback::in_host_function() {
        return Err(super::callback::refuse("the CUDA driver"));
    }
    GLOBAL.get_or_init(Driver::load_default).as_ref().map_err(Clone::clone)
}

impl Driver {
    /// Opens the library named by [`LIBRARY_ENV`], or else the first of [`DEFAULT_LIBRARIES`] that opens.
    /// An empty value counts as unset, as an empty `LD_PRELOAD` does: `dlopen` of an empty path
    /// would open the program itself.
    ///
    /// Safe because both sources are trusted: the default sonames are what the system's dynamic
    /// loader resolves to the installed NVIDIA driver, and [`LIBRARY_ENV`] is configuration with
    /// the standing of `LD_PRELOAD` (its documentation says why).
    pub fn load_default() -> Result<Driver> {
        if let Some(path) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
            // SAFETY: the variable is trusted configuration (see LIBRARY_ENV): whoever sets it
            // vouches that it names a CUDA driver, as whoever sets LD_PRELOAD vouches for what it
            // names.
            return unsafe { Driver::load_from(path) };
        }
        let mut tried = Vec::new();
        for name in DEFAULT_LIBRARIES {
            match open(OsStr::new(name)) {
                Ok(handle) => return Driver::from_handle(name, handle),
                Err(attempt) => tried.push(attempt),
            }
        }
        Err(Error::DriverNotFound { tried })
    }

    /// Opens the driver library at `path` (not cached: each call resolves afresh).
    ///
    /// # Safety
    ///
    /// Opening a library runs its initialisers, and every entry point resolved from it is then
    /// called with the signature `cuda.h` gives it, with nothing to check that the library agrees.
    /// So `path` must name an NVIDIA CUDA driver library, or a library that implements every entry
    /// point it exports under a CUDA name (`cuGetProcAddress`, `cuGetProcAddress_v2`, and each
    /// one those resolve) with `cuda.h`'s signature and semantics, and whose initialisers are
    /// sound to run in this process. A library that exports neither resolver is refused with
    /// [`Error::MissingEntryPoint`] after its initialisers ran, and nothing else of it is called.
    ///
    /// Calling it without `unsafe` does not compile:
    ///
    /// ```compile_fail,E0133
    /// let _ = cuvmm::driver::Driver::load_from("/usr/lib/libcuda.so.1");
    /// ```
    pub unsafe fn load_from(path: impl AsRef<OsStr>) -> Result<Driver> {
        let path = path.as_ref();
        let handle = open(path).map_err(|a| Error::DriverNotFound { tried: vec![a] })?;
        Driver::from_handle(&path.to_string_lossy(), handle)
    }

    fn from_handle(library: &str, handle: NonNull<c_void>) -> Result<Driver> {
        // Every way to a `Driver` comes here. Resolving entry points calls the driver, which a
        // stream host function must not.
        if super::callback::in_host_function() {
            return Err(super::callback::refuse("loading the CUDA driver"));
        }
        let resolver = find_get_proc_address(library, handle)?;
        let api = Api::resolve(library, &resolver)?;
        super::result::init(&api)?;
        let version = super::result::driver_version(&api)?;
        Ok(Driver { api, version })
    }

    /// The resolved entry points.
    pub fn api(&self) -> &Api {
        &self.api
    }

    /// The driver's CUDA version (13000 for CUDA 13.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The library path or soname that was opened.
    pub fn library(&self) -> &str {
        self.api.library()
    }
}

fn open(path: &OsStr) -> Result<NonNull<c_void>, LoadAttempt> {
    let attempt = |message: String| LoadAttempt { path: path.to_string_lossy().into_owned(), message };
    let cpath = CString::new(path.as_bytes()).map_err(|_| attempt("path contains a NUL byte".into()))?;
    if cfg!(miri) {
        // Miri cannot run foreign code: under it the crate behaves as on a machine without a
        // driver, so tests that only touch the failure paths still run there.
        return Err(attempt("Miri cannot load foreign libraries".into()));
    }
    // SAFETY: dlopen takes a NUL-terminated path; RTLD_LOCAL keeps the driver's symbols out of the
    // global namespace so they cannot interpose on anyone else's.
    let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    NonNull::new(handle).ok_or_else(|| attempt(dlerror_message()))
}

fn dlerror_message() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string that stays valid until the next dl*
    // call on this thread; it is copied out at once.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, see above.
        unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_cannot_be_opened_is_driver_not_found() {
        // SAFETY: no such file (and no foreign code at all under Miri): nothing of it runs.
        let err = unsafe { Driver::load_from("/nonexistent/libcuda.so.1") }.err().expect("must fail");
        match err {
            Error::DriverNotFound { tried } => {
                assert_eq!(tried.len(), 1);
                assert_eq!(tried[0].path, "/nonexistent/libcuda.so.1");
            }
            other => panic!("wrong error: {other:?}"),
        }
        // SAFETY: a path with a NUL byte is refused before dlopen.
        let nul = unsafe { Driver::load_from("a\0b") }.err().expect("must fail");
        assert!(matches!(nul, Error::DriverNotFound { tried } if tried[0].message.contains("NUL")));
    }
}
