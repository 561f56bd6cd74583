//! The table of entry points, each pinned to the ABI version whose signature is declared here.

use super::resolver::Resolver;
use super::sys::*;
use crate::error::{DriverTexts, Error, Result};
use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_void};

macro_rules! entry_points {
    ($($req:ident fn $name:ident @ $ver:literal ($($arg:ident : $ty:ty),* $(,)?);)*) => {
        /// The driver's entry points, resolved once.
        ///
        /// Each method calls the entry point of the same name at the ABI version in its doc line
        /// and turns a failing `CUresult` into [`Error::Driver`]. An optional entry point the driver
        /// lacks returns [`Error::Unsupported`] when called.
        #[allow(non_snake_case)]
        pub struct Api {
            library: String,
            $($name: Option<unsafe extern "C" fn($($ty),*) -> CUresult>,)*
        }

        #[allow(non_snake_case, clippy::too_many_arguments)]
        impl Api {
            pub(crate) fn resolve(library: &str, r: &Resolver) -> Result<Api> {
                Ok(Api {
                    library: library.to_owned(),
                    $($name: match r.lookup(concat!(stringify!($name), "\0"), $ver) {
                        // SAFETY: the driver resolved this name at this ABI version, whose C
                        // signature is the one declared in this table (checked against cuda.h).
                        Ok(p) => Some(unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p.as_ptr())
                        }),
                        Err(reason) => entry_points!(@missing $req library $name $ver reason),
                    },)*
                })
            }

            $(
                #[doc = concat!("`", stringify!($name), "` at ABI version ", stringify!($ver), ".")]
                ///
                /// # Safety
                /// The arguments must meet the driver's contract for this call: pointers valid for
                /// what the call reads or writes, handles live, sizes within their allocations.
                pub unsafe fn $name(&self, $($arg: $ty),*) -> Result<()> {
                    if super::callback::in_host_function() {
                        return Err(super::callback::refuse(stringify!($name)));
                    }
                    let Some(f) = self.$name else {
                        return Err(self.unavailable(stringify!($name), $ver));
                    };
                    #[cfg(feature = "fault-injection")]
                    if let Some(rc) = crate::faults::take(stringify!($name)) {
                        return self.check(stringify!($name), rc);
                    }
                    // SAFETY: the caller upholds the call's contract (see # Safety).
                    let rc = unsafe { f($($arg),*) };
                    self.check(stringify!($name), rc)
                }
            )*
        }
    };
    (@missing required $lib:ident $name:ident $ver:literal $reason:ident) => {
        return Err(Error::MissingEntryPoint {
            library: $lib.to_owned(),
            name: stringify!($name),
            version: $ver,
            reason: $reason,
        })
    };
    (@missing optional $lib:ident $name:ident $ver:literal $reason:ident) => {{
        let _ = $reason;
        None
    }};
}

// Versions are those at which each signature appeared: cuGetProcAddress then returns, say,
// cuMemcpyHtoD_v2 for 3020 and cuDeviceGetUuid_v2 for 11040. Entry points from CUDA 11.0 or
// earlier are required; later ones are optional and fail only when called.
entry_points! {
    required fn cuInit @ 2000 (flags: c_uint);
    required fn cuDriverGetVersion @ 2020 (version: *mut c_int);
    required fn cuGetErrorName @ 6000 (error: CUresult, out: *mut *const c_char);
    required fn cuGetErrorString @ 6000 (error: CUresult, out: *mut *const c_char);

    required fn cuDeviceGetCount @ 2000 (count: *mut c_int);
    required fn cuDeviceGet @ 2000 (device: *mut CUdevice, ordinal: c_int);
    required fn cuDeviceGetName @ 2000 (name: *mut c_char, len: c_int, dev: CUdevice);
    optional fn cuDeviceGetUuid @ 11040 (uuid: *mut CUuuid, dev: CUdevice);
    required fn cuDeviceTotalMem @ 3020 (bytes: *mut usize, dev: CUdevice);
    required fn cuDeviceGetAttribute @ 2000 (value: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice);
    required fn cuDeviceGetPCIBusId @ 4010 (bus_id: *mut c_char, len: c_int, dev: CUdevice);
    required fn cuDeviceCanAccessPeer @ 4000 (can: *mut c_int, dev: CUdevice, peer: CUdevice);

    required fn cuDevicePrimaryCtxRetain @ 7000 (ctx: *mut CUcontext, dev: CUdevice);
    required fn cuDevicePrimaryCtxRelease @ 11000 (dev: CUdevice);
    required fn cuCtxSetCurrent @ 4000 (ctx: CUcontext);
    required fn cuCtxGetCurrent @ 4000 (ctx: *mut CUcontext);
    required fn cuCtxSynchronize @ 2000 ();
    required fn cuCtxEnablePeerAccess @ 4000 (peer: CUcontext, flags: c_uint);
    required fn cuCtxGetStreamPriorityRange @ 5050 (least: *mut c_int, greatest: *mut c_int);

    required fn cuMemGetInfo @ 3020 (free: *mut usize, total: *mut usize);
    required fn cuMemAlloc @ 3020 (dptr: *mut CUdeviceptr, bytes: usize);
    required fn cuMemFree @ 3020 (dptr: CUdeviceptr);
    required fn cuMemcpyHtoD @ 3020 (dst: CUdeviceptr, src: *const c_void, bytes: usize);
    required fn cuMemcpyDtoH @ 3020 (dst: *mut c_void, src: CUdeviceptr, bytes: usize);
    required fn cuMemcpyDtoD @ 3020 (dst: CUdeviceptr, src: CUdeviceptr, bytes: usize);
    required fn cuMemcpyHtoDAsync @ 3020 (dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream);
    required fn cuMemcpyDtoHAsync @ 3020 (dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream);
    required fn cuMemcpyDtoDAsync @ 3020 (dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream);
    required fn cuMemcpyPeerAsync @ 4000 (dst: CUdeviceptr, dst_ctx: CUcontext, src: CUdeviceptr, src_ctx: CUcontext, bytes: usize, stream: CUstream);
    required fn cuMemsetD8Async @ 3020 (dst: CUdeviceptr, value: c_uchar, count: usize, stream: CUstream);
    required fn cuMemsetD32Async @ 3020 (dst: CUdeviceptr, value: c_uint, count: usize, stream: CUstream);

    required fn cuMemHostAlloc @ 2020 (pp: *mut *mut c_void, bytes: usize, flags: c_uint);
    required fn cuMemFreeHost @ 2000 (p: *mut c_void);
    required fn cuMemHostRegister @ 6050 (p: *mut c_void, bytes: usize, flags: c_uint);
    required fn cuMemHostUnregister @ 4000 (p: *mut c_void);
    required fn cuMemHostGetDevicePointer @ 3020 (dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint);

    required fn cuMemCreate @ 10020 (handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: c_ulonglong);
    required fn cuMemRelease @ 10020 (handle: CUmemGenericAllocationHandle);
    required fn cuMemAddressReserve @ 10020 (ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: c_ulonglong);
    required fn cuMemAddressFree @ 10020 (ptr: CUdeviceptr, size: usize);
    required fn cuMemMap @ 10020 (ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: c_ulonglong);
    required fn cuMemUnmap @ 10020 (ptr: CUdeviceptr, size: usize);
    required fn cuMemSetAccess @ 10020 (ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
    required fn cuMemGetAccess @ 10020 (flags: *mut c_ulonglong, location: *const CUmemLocation, ptr: CUdeviceptr);
    required fn cuMemGetAllocationGranularity @ 10020 (granularity: *mut usize, prop: *const CUmemAllocationProp, option: CUmemAllocationGranularity_flags);
    required fn cuMemGetAllocationPropertiesFromHandle @ 10020 (prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle);
    required fn cuMemExportToShareableHandle @ 10020 (shareable: *mut c_void, handle: CUmemGenericAllocationHandle, kind: CUmemAllocationHandleType, flags: c_ulonglong);
    required fn cuMemImportFromShareableHandle @ 10020 (handle: *mut CUmemGenericAllocationHandle, shareable: *mut c_void, kind: CUmemAllocationHandleType);
    required fn cuMemRetainAllocationHandle @ 11000 (handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void);

    required fn cuStreamCreate @ 2000 (stream: *mut CUstream, flags: c_uint);
    required fn cuStreamCreateWithPriority @ 5050 (stream: *mut CUstream, flags: c_uint, priority: c_int);
    required fn cuStreamDestroy @ 4000 (stream: CUstream);
    required fn cuStreamSynchronize @ 2000 (stream: CUstream);
    required fn cuStreamQuery @ 2000 (stream: CUstream);
    required fn cuStreamWaitEvent @ 3020 (stream: CUstream, event: CUevent, flags: c_uint);
    optional fn cuStreamGetCaptureInfo @ 11030 (stream: CUstream, status: *mut c_int, id: *mut c_ulonglong, graph: *mut *mut c_void, deps: *mut *const *mut c_void, count: *mut usize);
    optional fn cuStreamIsCapturing @ 10000 (stream: CUstream, status: *mut c_int);
    optional fn cuStreamGetId @ 12000 (stream: CUstream, id: *mut c_ulonglong);
    optional fn cuStreamBeginCapture @ 10010 (stream: CUstream, mode: c_int);
    optional fn cuStreamEndCapture @ 10000 (stream: CUstream, graph: *mut *mut c_void);
    optional fn cuGraphInstantiateWithFlags @ 11040 (exec: *mut *mut c_void, graph: *mut c_void, flags: c_ulonglong);
    optional fn cuGraphLaunch @ 10000 (exec: *mut c_void, stream: CUstream);
    optional fn cuGraphExecDestroy @ 10000 (exec: *mut c_void);
    optional fn cuGraphDestroy @ 10000 (graph: *mut c_void);
    optional fn cuThreadExchangeStreamCaptureMode @ 10010 (mode: *mut c_int);
    required fn cuLaunchHostFunc @ 10000 (stream: CUstream, f: CUhostFn, user_data: *mut c_void);

    required fn cuEventCreate @ 2000 (event: *mut CUevent, flags: c_uint);
    required fn cuEventRecord @ 2000 (event: CUevent, stream: CUstream);
    required fn cuEventSynchronize @ 2000 (event: CUevent);
    required fn cuEventQuery @ 2000 (event: CUevent);
    required fn cuEventElapsedTime @ 2000 (ms: *mut f32, start: CUevent, end: CUevent);
    required fn cuEventDestroy @ 4000 (event: CUevent);

    required fn cuModuleLoadData @ 2000 (module: *mut CUmodule, image: *const c_void);
    required fn cuModuleUnload @ 2000 (module: CUmodule);
    required fn cuModuleGetFunction @ 2000 (f: *mut CUfunction, module: CUmodule, name: *const c_char);
    required fn cuLaunchKernel @ 4000 (f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void);

    required fn cuIpcGetMemHandle @ 4010 (handle: *mut CUipcMemHandle, ptr: CUdeviceptr);
    required fn cuMemGetAddressRange @ 3020 (base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr);
    required fn cuIpcOpenMemHandle @ 11000 (ptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint);
    required fn cuIpcCloseMemHandle @ 4010 (ptr: CUdeviceptr);

    optional fn cuMemAllocAsync @ 11020 (dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream);
    optional fn cuMemFreeAsync @ 11020 (dptr: CUdeviceptr, stream: CUstream);
    optional fn cuDeviceGetDefaultMemPool @ 11020 (pool: *mut CUmemoryPool, dev: CUdevice);
    optional fn cuMemPoolSetAttribute @ 11020 (pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void);
    optional fn cuMemPoolGetAttribute @ 11020 (pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void);
    optional fn cuMemPoolTrimTo @ 11020 (pool: CUmemoryPool, keep: usize);
}

impl Api {
    /// The library these entry points came from.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// Turns a status into a `Result`, naming the call. The driver's name and text for a failing
    /// code are asked for only when the error is displayed (see [`Error::Driver`]): a polling
    /// query's `CUDA_ERROR_NOT_READY` costs no string and no further driver call.
    #[inline]
    pub fn check(&self, call: &'static str, rc: CUresult) -> Result<()> {
        if rc.is_success() {
            return Ok(());
        }
        Err(Error::Driver {
            call,
            code: rc,
            texts: DriverTexts::new(self.cuGetErrorName, self.cuGetErrorString),
        })
    }

    fn unavailable(&self, name: &str, version: i32) -> Error {
        Error::unsupported(
            name,
            format!(
                "unsupported by this driver ({} has no such entry point at ABI version {version})",
                self.library
            ),
        )
    }
}
