//! The raw driver layer: the only module that declares foreign functions.
//!
//! `libcuda.so.1` is opened with `dlopen` the first time anything needs it (or the path in
//! [`LIBRARY_ENV`]); `cuGetProcAddress` is found with `dlsym` and resolves every other entry point at
//! a pinned ABI version, so `cuMemcpyHtoDAsync` means `cuMemcpyHtoDAsync_v2` whatever driver is
//! installed. Each entry point becomes an `unsafe` method of [`Api`] that returns a [`Result`]
//! carrying the call's name and code; the driver's own name and text for the code are
//! asked for when the error is displayed. [`result`]
//! wraps each entry point in one function that returns its out-values: the safe types call
//! those, and so may code outside the crate that measures or does what the safe types do not
//! (the CLI's raw-driver baselines do), rather than the entry points themselves.
//!
//! Nothing here links against CUDA: the crate builds and its CPU tests run on machines without it.
//!
//! [`Result`]: crate::Result

mod api;
pub mod callback;
pub(crate) mod host_fn;
mod loader;
mod resolver;
pub mod result;
pub mod sys;

pub use api::Api;
pub use loader::{driver, Driver, DEFAULT_LIBRARIES, LIBRARY_ENV};
