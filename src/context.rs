//! Contexts: a device's primary context, retained for as long as any clone is alive.

use crate::device::Device;
use crate::driver::{driver, result, sys::CUcontext};
use crate::error::Result;
use std::cell::Cell;
use std::sync::Arc;

thread_local! {
    /// The context cuvmm last made current on this thread (its handle as an integer; 0 for none
    /// or unknown). Only a hint: code outside cuvmm may have changed the current context since.
    static LAST_BOUND: Cell<usize> = const { Cell::new(0) };
}

/// A device's primary context, shared by cloning (an `Arc` inside).
///
/// Every operation of this crate that needs a context makes this one current on the calling thread
/// first ([`Context::bind`]), so values may be used from any thread. Dropping the last clone
/// releases the primary context; the driver destroys it once nothing else in the process (a CUDA
/// runtime, another library) retains it.
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
}

struct Inner {
    device: Device,
    raw: CUcontext,
}

// SAFETY: a primary context is a process-wide object: the driver API may be called with it from any
// thread (each thread makes it current for itself) and its calls are thread-safe. `raw` is only
// passed to the driver, never dereferenced, and it stays valid until `Drop` releases the retain taken
// in `Context::new`, which happens once, when no clone is left.
unsafe impl Send for Inner {}
// SAFETY: as above; `&Inner` gives nothing but copies of the handle to pass to the driver.
unsafe impl Sync for Inner {}

impl Context {
    /// Retains `device`'s primary context.
    pub fn new(device: Device) -> Result<Context> {
        let raw = result::ctx::primary_retain(driver()?.api(), device.raw())?;
        Ok(Context { inner: Arc::new(Inner { device, raw }) })
    }

    /// Retains the primary context of the device at `ordinal`.
    pub fn for_ordinal(ordinal: usize) -> Result<Context> {
        Context::new(Device::get(ordinal)?)
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        let r = unsafe { result::ctx::set_current(driver()?.api(), self.inner.raw) };
        LAST_BOUND.with(|c| c.set(if r.is_ok() { self.inner.raw as usize } else { 0 }));
        r
    }

    /// Makes this context current unless cuvmm's last bind on this thread was of this context.
    ///
    /// Only for driver calls whose meaning does not depend on the current context, because they
    /// name everything they act on (`cuMemMap`: an address range of the process-wide space and an
    /// allocation handle): code outside cuvmm may have made another context current since, and
    /// such a call is then made in that one. They must still tolerate
    /// `CUDA_ERROR_INVALID_CONTEXT` (no context current at all) by binding and retrying. This
    /// saves a `cuCtxSetCurrent` per call where nothing else switches contexts.
    pub(crate) fn bind_unless_last(&self) -> Result<()> {
        if LAST_BOUND.with(Cell::get) == self.inner.raw as usize {
            return Ok(());
        }
        self.bind()
    }

    /// The device this context belongs to.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUcontext {
        self.inner.raw
    }

    /// Waits for all work in this context to finish.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        result::ctx::synchronize(driver()?.api())
    }

    /// Free and total device memory as the driver reports them (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        self.bind()?;
        let (free, total) = result::mem::get_info(driver()?.api())?;
        Ok(MemoryInfo { free, total })
    }

    /// Whether two handles name the same context.
    pub fn same_as(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner) || self.inner.raw == other.inner.raw
    }
}

impl crate::driver::callback::Bind for Context {
    fn bind(&self) -> Result<()> {
        Context::bind(self)
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.device.ordinal())
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let device = self.device;
        crate::driver::callback::release(move || {
            if let Ok(d) = driver() {
                // SAFETY: releases the one retain `Context::new` took. An error here (the driver
                // being torn down at exit) leaves nothing to retry: it is recorded.
                crate::error::record_drop(unsafe { result::ctx::primary_release(d.api(), device.raw()) });
            }
        });
    }
}

/// Device memory as `cuMemGetInfo` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Free bytes.
    pub free: usize,
    /// Total bytes.
    pub total: usize,
}

impl MemoryInfo {
    /// Bytes in use: total minus free.
    pub fn used(&self) -> usize {
        self.total - self.free
    }
}
