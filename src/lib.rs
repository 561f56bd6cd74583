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
pub mod bench;
pub mod buffer;
pub mod caps;
pub mod context;
pub mod copy;
pub mod device;
pub mod driver;
pub mod error;
pub mod event;
#[cfg(feature = "fault-injection")]
pub mod faults;
pub mod ipc;
pub mod kernels;
pub mod module;
pub mod order;
pub mod pinned;
pub mod scope;
pub mod staging;
pub mod stream;
pub mod vec;
pub mod view;
pub mod vmm;

pub use buffer::DeviceBuffer;
pub use context::{Context, MemoryInfo};
pub use device::{Device, Uuid};
pub use error::{Error, LoadAttempt, Result};
pub use event::Event;
pub use pinned::{PinnedBuffer, Registered};
pub use scope::{scope, Landing, Scope};
pub use stream::Stream;
pub use vec::{VmmVec, VmmVecBuilder};
pub use view::{DeviceCopy, DeviceSlice, DeviceSliceMut};

/// The README's examples, compiled as doctests (GPU ones compiled, not run).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
