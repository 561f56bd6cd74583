//! Device memory as Rust sees it: the element trait, borrowed views, and plain `cuMemAlloc`
//! buffers.
//!
//! Reach for [`DeviceSlice`] / [`DeviceSliceMut`] to hand device memory to copies and kernels:
//! every owner in cuvmm ([`DeviceBuffer`], [`VmmVec`](crate::VmmVec), shared and allocated memory)
//! lends them, and they carry the owner's record of stream use (see [`crate::stream::order`]).
//! [`DeviceBuffer`] is the simple fixed-size allocation, and the reference VMM types are measured
//! against.

mod buffer;
mod view;

pub use buffer::DeviceBuffer;
pub use view::{DeviceCopy, DeviceSlice, DeviceSliceMut};
