//! cuvmm: safe, fast CUDA virtual memory management.
//!
//! CUDA's virtual memory management (VMM) API separates physical memory from the addresses it is
//! mapped at. cuvmm makes it safe to use from Rust: growable device vectors that never copy,
//! custom allocators, and device memory shared with other processes, with every driver error a
//! typed [`Error`] and every piece of device memory ordered across the streams that use it.
//!
//! The crate loads `libcuda.so.1` at run time: no CUDA is needed to build it or to run its CPU
//! tests, and with no driver every call returns [`Error::DriverNotFound`]. It is layered like
//! cudarc: [`driver`] holds the raw ABI, the entry-point table (each call returns a [`Result`])
//! and, inside the crate, a thin layer of one function per driver call that turns out-pointers into
//! return values; the safe types sit on top of that layer.
//!
//! # A growable device vector
//! [`VmmVec`] reserves a large address range once and maps physical memory at its end as it
//! grows: pushing never copies and the base address stays put.
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::{Context, VmmVec};
//! let ctx = Context::for_ordinal(0)?;
//! let mut v = VmmVec::<f32>::new(&ctx)?;
//! let base = v.device_ptr();
//! v.extend_from_slice(&[1.0, 2.0, 3.0])?;
//! v.resize(64 << 20, 0.5)?; // 256 MiB: more chunks mapped, nothing copied
//! assert_eq!(v.device_ptr(), base);
//! assert_eq!(v.get(1)?, Some(2.0));
//! # Ok(()) }
//! ```
//!
//! # The VMM layer
//! [`vmm`] gives the pieces themselves: physical memory, address reservations, mappings and
//! access, for allocators of your own.
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
//! let ctx = cuvmm::Context::for_ordinal(0)?;
//! let phys = PhysicalMemory::builder(&ctx).create(2 << 20)?;
//! let va = Reservation::new(&ctx, 1 << 30)?; // 1 GiB of addresses, no memory yet
//! let m = va.map(0, &phys, 0, 2 << 20)?;
//! m.set_access(&[(ctx.device(), Access::ReadWrite)])?;
//! println!("2 MiB mapped at {:#x}", m.ptr());
//! # Ok(()) }
//! ```
//!
//! # Asynchronous copies that borrow host memory
//! [`scope`] lends host buffers to copies on streams and synchronises before the borrows end, as
//! `std::thread::scope` does for threads.
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::{scope, Context, PinnedBuffer, Stream, VmmVec};
//! let ctx = Context::for_ordinal(0)?;
//! let stream = Stream::non_blocking(&ctx)?;
//! let input = PinnedBuffer::from_slice(&ctx, &[1u32, 2, 3, 4])?;
//! let mut output = PinnedBuffer::<u32>::new(&ctx, 4)?;
//! let mut dev = VmmVec::<u32>::new(&ctx)?;
//! dev.resize(4, 0)?;
//! scope(|s| {
//!     s.copy_to_device(&stream, &input, dev.as_mut_slice())?;
//!     s.copy_to_host(&stream, dev.as_slice(), &mut output)?.wait()?;
//!     Ok(())
//! })?;
//! assert_eq!(&output[..], &[1, 2, 3, 4]);
//! # Ok(()) }
//! ```
//!
//! # Sharing memory with another process
//! [`alloc::PeerAllocator`] makes exportable memory, [`ipc::share`] sends it over a Unix socket
//! (the descriptor as `SCM_RIGHTS`, a header whose format `docs/WIRE.md` documents), and
//! [`ipc::SharedMemory::import`] maps it in the receiver, after checking the peer and every byte
//! it sent. A [`VmmVec`] that keeps growing is shared with [`VmmVec::share_growth`] and followed
//! with [`ipc::GrowableImport`], which maps each new chunk at the exporter's offset in one range
//! reserved up front.
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::alloc::{ExportMode, PeerAllocator};
//! use cuvmm::ipc::{recv_message, PeerPolicy, SharedMemory};
//! use std::os::fd::AsFd;
//! use std::os::unix::net::UnixStream;
//! let ctx = cuvmm::Context::for_ordinal(0)?;
//! let (exporter, importer) = UnixStream::pair().expect("socketpair");
//! // Exporting process:
//! let alloc = PeerAllocator::new(&ctx, &[], ExportMode::PosixFd)?;
//! let block = alloc.allocate(4 << 20)?;
//! block.share(exporter.as_fd(), 0, 4 << 20, 7)?;
//! // Importing process (the other end of the socket):
//! // `None`: the exporter closed the socket without sending anything.
//! let Some(msg) = recv_message(importer.as_fd(), PeerPolicy::SameUid)? else { return Ok(()) };
//! let shared = SharedMemory::import(&ctx, msg, &[])?;
//! let mut first = [0u32; 4];
//! shared.copy_to_host(0, &mut first)?;
//! # Ok(()) }
//! ```
//!
//! # Where to look
//! * [`vmm`]: physical memory, reservations, mappings, access, striping, and [`VmmVec`].
//! * [`memory`]: device views for copies and kernels, and plain [`DeviceBuffer`]s.
//! * [`stream`]: streams, events, host functions, [`scope`]d copies, and the [`stream::order`]
//!   record that keeps streams sharing memory from racing.
//! * [`host`]: pinned and registered host memory, and the staging ring for pageable memory.
//! * [`alloc`]: [`alloc::StreamAllocator`], the stream-ordered caching allocator (with sleep and
//!   wake of tagged memory) to take for device memory; and allocators whose memory other processes
//!   can import.
//! * [`ipc`]: sharing memory with other processes, and vectors they follow as they grow.
//! * [`module`] and [`kernels`]: loading PTX and launching kernels; the crate's own kernels.
//! * [`caps`], [`device`], [`context`]: what the machine supports; devices and their contexts.
//!
//! The repository's `docs/` holds a guide per subsystem (`docs/guide/`), the threat model
//! (`docs/SOUNDNESS.md`: what safe code is guaranteed, what is trusted, what `unsafe` callers
//! uphold), the measurements (`docs/PERFORMANCE.md`) and how the crate is tested
//! (`docs/TESTING.md`).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod alloc;
pub mod caps;
pub mod context;
#[cfg(feature = "cudarc")]
pub mod cudarc;
pub mod device;
pub mod driver;
pub mod error;
#[cfg(feature = "fault-injection")]
pub mod faults;
pub mod host;
pub mod ipc;
pub mod kernels;
pub mod memory;
pub mod module;
pub mod stream;
pub mod vmm;

pub use context::{Context, MemoryInfo};
pub use device::{Device, Uuid};
pub use error::{drop_error_count, take_drop_error, Error, ErrorKind, LoadAttempt, Refusal, Result};
pub use host::{PinnedBuffer, Registered};
pub use memory::{DeviceBuffer, DeviceCopy, DeviceSlice, DeviceSliceMut};
pub use stream::{scope, Event, Landing, Scope, Stream};
pub use vmm::{VmmVec, VmmVecBuilder};

/// The README's examples, compiled as doctests (GPU ones compiled, not run).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guides' examples, compiled as doctests (GPU ones compiled, not run).
#[cfg(doctest)]
pub mod guide_doctests {
    #[doc = include_str!("../docs/guide/vmm.md")]
    pub struct Vmm;
    #[doc = include_str!("../docs/guide/streams.md")]
    pub struct Streams;
    #[doc = include_str!("../docs/guide/host.md")]
    pub struct Host;
    #[doc = include_str!("../docs/guide/alloc.md")]
    pub struct Alloc;
    #[doc = include_str!("../docs/guide/ipc.md")]
    pub struct Ipc;
    #[doc = include_str!("../docs/guide/python.md")]
    pub struct Python;
    /// With the feature only: the example launches through cudarc.
    #[cfg(feature = "cudarc")]
    #[doc = include_str!("../docs/guide/cudarc.md")]
    pub struct Cudarc;
}
