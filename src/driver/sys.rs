//! `#[repr(C)]` types and constants of the CUDA driver ABI (CUDA 12 and 13).
//!
//! Every layout here was checked against `cuda.h` from CUDA 13.0 with `tools/abi_probe.c` on the GPU
//! machine; `tests/abi.rs` pins the same sizes and offsets so a change cannot slip in unnoticed.
//! Enumerations are integer newtypes, not Rust enums: the driver may hand back values this crate
//! does not know, and a Rust enum holding an unlisted discriminant would be undefined behaviour.
// Names and fields mirror cuda.h one for one; its documentation is theirs.
#![allow(non_camel_case_types, non_snake_case, missing_docs)]

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::fmt;

/// A device ordinal as the driver knows it.
pub type CUdevice = c_int;
/// A device virtual address.
pub type CUdeviceptr = u64;
/// The handle of a physical allocation made by `cuMemCreate` or imported from another process.
pub type CUmemGenericAllocationHandle = c_ulonglong;

macro_rules! opaque_handles {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        pub type $name = *mut c_void;
    )*};
}
opaque_handles! {
    /// A CUDA context.
    CUcontext;
    /// A stream.
    CUstream;
    /// An event.
    CUevent;
    /// A loaded module.
    CUmodule;
    /// A kernel in a loaded module.
    CUfunction;
    /// A stream-ordered memory pool.
    CUmemoryPool;
}

/// A host function enqueued by `cuLaunchHostFunc`.
pub type CUhostFn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// The status every driver call returns. Unknown codes are kept as they are.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CUresult(pub c_int);

macro_rules! codes {
    ($ty:ident { $($name:ident = $v:expr,)* }) => {
        impl $ty {
            $(pub const $name: $ty = $ty($v);)*
            /// The name `cuda.h` gives this code, where this crate knows it.
            pub fn known_name(self) -> Option<&'static str> {
                match self.0 {
                    $($v => Some(concat!("CUDA_", stringify!($name))),)*
                    _ => None,
                }
            }
        }
    };
}
codes!(CUresult {
    SUCCESS = 0,
    ERROR_INVALID_VALUE = 1,
    ERROR_OUT_OF_MEMORY = 2,
    ERROR_NOT_INITIALIZED = 3,
    ERROR_DEINITIALIZED = 4,
    ERROR_STUB_LIBRARY = 34,
    ERROR_NO_DEVICE = 100,
    ERROR_INVALID_DEVICE = 101,
    ERROR_INVALID_CONTEXT = 201,
    ERROR_ALREADY_MAPPED = 208,
    ERROR_INVALID_HANDLE = 400,
    ERROR_NOT_FOUND = 500,
    ERROR_NOT_READY = 600,
    ERROR_ILLEGAL_ADDRESS = 700,
    ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    ERROR_CONTEXT_IS_DESTROYED = 709,
    ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    ERROR_NOT_PERMITTED = 800,
    ERROR_NOT_SUPPORTED = 801,
    ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    ERROR_UNKNOWN = 999,
});

impl CUresult {
    /// Whether the call succeeded.
    pub fn is_success(self) -> bool {
        self == CUresult::SUCCESS
    }
}

impl fmt::Debug for CUresult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.known_name() {
            Some(n) => write!(f, "{n}({})", self.0),
            None => write!(f, "CUresult({})", self.0),
        }
    }
}

impl fmt::Display for CUresult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

macro_rules! int_enum {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $var:ident = $v:expr,)* }) => {
        $(#[$m])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
        pub struct $name(pub $repr);
        impl $name {
            $($(#[$vm])* pub const $var: $name = $name($v);)*
        }
    };
}

int_enum!(
    /// `CUmemAllocationType`.
    CUmemAllocationType: c_int {
        INVALID = 0,
        PINNED = 1,
    }
);
int_enum!(
    /// `CUmemLocationType`.
    CUmemLocationType: c_int {
        INVALID = 0,
        DEVICE = 1,
        HOST = 2,
        HOST_NUMA = 3,
        HOST_NUMA_CURRENT = 4,
    }
);
int_enum!(
    /// `CUmemAllocationHandleType`, a bit set.
    CUmemAllocationHandleType: c_int {
        NONE = 0,
        POSIX_FILE_DESCRIPTOR = 1,
        WIN32 = 2,
        WIN32_KMT = 4,
        FABRIC = 8,
    }
);
int_enum!(
    /// `CUmemAccess_flags`.
    CUmemAccess_flags: c_int {
        PROT_NONE = 0,
        PROT_READ = 1,
        PROT_READWRITE = 3,
    }
);
int_enum!(
    /// `CUmemAllocationGranularity_flags`.
    CUmemAllocationGranularity_flags: c_int {
        MINIMUM = 0,
        RECOMMENDED = 1,
    }
);
int_enum!(
    /// `CUmemPool_attribute` (only those this crate sets).
    CUmemPool_attribute: c_int {
        RELEASE_THRESHOLD = 4,
        RESERVED_MEM_HIGH = 6,
    }
);
int_enum!(
    /// `CUdriverProcAddressQueryResult`.
    CUdriverProcAddressQueryResult: c_int {
        SUCCESS = 0,
        SYMBOL_NOT_FOUND = 1,
        VERSION_NOT_SUFFICIENT = 2,
    }
);

int_enum!(
    /// `CUdevice_attribute`: the ids this crate reads. Any other id may be passed as `CUdevice_attribute(n)`.
    CUdevice_attribute: c_int {
        MULTIPROCESSOR_COUNT = 16,
        CAN_MAP_HOST_MEMORY = 19,
        CONCURRENT_KERNELS = 31,
        PCI_BUS_ID = 33,
        PCI_DEVICE_ID = 34,
        GLOBAL_MEMORY_BUS_WIDTH = 37,
        L2_CACHE_SIZE = 38,
        ASYNC_ENGINE_COUNT = 40,
        UNIFIED_ADDRESSING = 41,
        PCI_DOMAIN_ID = 50,
        COMPUTE_CAPABILITY_MAJOR = 75,
        COMPUTE_CAPABILITY_MINOR = 76,
        CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91,
        VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
        HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
        GENERIC_COMPRESSION_SUPPORTED = 107,
        GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110,
        READ_ONLY_HOST_REGISTER_SUPPORTED = 113,
        MEMORY_POOLS_SUPPORTED = 115,
        GPU_DIRECT_RDMA_SUPPORTED = 116,
        HANDLE_TYPE_FABRIC_SUPPORTED = 128,
        NUMA_CONFIG = 130,
        NUMA_ID = 131,
        MULTICAST_SUPPORTED = 132,
        HOST_NUMA_ID = 134,
        HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 141,
        HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 145,
    }
);

/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`: entry points with the legacy default-stream semantics.
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
/// `CU_MEM_ALLOCATION_COMP_GENERIC`.
pub const CU_MEM_ALLOCATION_COMP_GENERIC: u8 = 1;
/// `CU_MEMHOSTALLOC_*` flags.
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// See [`CU_MEMHOSTALLOC_PORTABLE`].
pub const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 2;
/// See [`CU_MEMHOSTALLOC_PORTABLE`].
pub const CU_MEMHOSTALLOC_WRITECOMBINED: c_uint = 4;
/// `CU_MEMHOSTREGISTER_*` flags.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
/// See [`CU_MEMHOSTREGISTER_PORTABLE`].
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 2;
/// See [`CU_MEMHOSTREGISTER_PORTABLE`].
pub const CU_MEMHOSTREGISTER_READ_ONLY: c_uint = 8;
/// `CU_STREAM_NON_BLOCKING`.
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_STREAM_LEGACY`: the legacy default stream, also named by a null handle.
pub const CU_STREAM_LEGACY: usize = 1;
/// `CU_STREAM_PER_THREAD`: each thread's own default stream.
pub const CU_STREAM_PER_THREAD: usize = 2;
/// `CU_STREAM_CAPTURE_STATUS_NONE` (`CUstreamCaptureStatus`).
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
/// `CU_STREAM_CAPTURE_STATUS_ACTIVE`.
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
/// `CU_STREAM_CAPTURE_STATUS_INVALIDATED`.
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: c_int = 2;
/// `CU_STREAM_CAPTURE_MODE_RELAXED` (`CUstreamCaptureMode`).
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
/// `CU_EVENT_BLOCKING_SYNC`.
pub const CU_EVENT_BLOCKING_SYNC: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`.
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemLocation {
    pub type_: CUmemLocationType,
    pub id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemAllocFlags {
    pub compressionType: u8,
    pub gpuDirectRDMACapable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub type_: CUmemAllocationType,
    pub requestedHandleTypes: CUmemAllocationHandleType,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: CUmemAllocFlags,
}

impl Default for CUmemAllocationProp {
    fn default() -> Self {
        CUmemAllocationProp {
            type_: CUmemAllocationType::INVALID,
            requestedHandleTypes: CUmemAllocationHandleType::NONE,
            location: CUmemLocation::default(),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: CUmemAllocFlags::default(),
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: CUmemAccess_flags,
}

/// `CUmemFabricHandle`: 64 opaque bytes that name an allocation across an IMEX domain.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CUmemFabricHandle {
    pub data: [u8; 64],
}

impl Default for CUmemFabricHandle {
    fn default() -> Self {
        CUmemFabricHandle { data: [0; 64] }
    }
}

impl fmt::Debug for CUmemFabricHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUmemFabricHandle(")?;
        for b in &self.data {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// `CUipcMemHandle`: the legacy IPC handle of a `cuMemAlloc` allocation.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

impl Default for CUipcMemHandle {
    fn default() -> Self {
        CUipcMemHandle { reserved: [0; 64] }
    }
}

impl fmt::Debug for CUipcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CUipcMemHandle(..)")
    }
}
