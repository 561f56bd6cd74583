//! cuvmm: safe, fast CUDA virtual memory management.
//!
//! The crate loads `libcuda.so.1` at run time (no CUDA is needed to build it or run its CPU tests;
//! with no driver every call returns [`Error::DriverNotFound`]) and layers, like cudarc:
//!
//! * [`driver`]: the raw ABI types and the entry-point table, each call returning a [`Result`];
//! * safe types on top: [`Device`], [`Context`], the capability [`caps::Report`].
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! let report = cuvmm::caps::Report::query()?;
//! for d in &report.devices {
//!     println!("{}: VMM {:?}, granularity {:?}", d.name, d.vmm, d.granularity);
//! }
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod alloc;
pub mod caps;
pub mod context;
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
pub use error::{Error, LoadAttempt, Result};
pub use host::{PinnedBuffer, Registered};
pub use memory::{DeviceBuffer, DeviceCopy, DeviceSlice, DeviceSliceMut};
pub use stream::{scope, Event, Landing, Scope, Stream};
pub use vmm::{VmmVec, VmmVecBuilder};

/// The README's examples, compiled as doctests (GPU ones compiled, not run).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
