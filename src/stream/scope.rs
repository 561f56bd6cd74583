//! Asynchronous copies that are sound with respect to Rust lifetimes.
//!
//! Host memory handed to an asynchronous copy is read or written by the DMA engine after the call
//! returns. [`scope`] lends host buffers for the scope's lifetime `'a` and synchronises every stream
//! it used before it returns (also when the closure fails or panics), so while a copy is in flight
//! safe code can neither read, write nor free the host memory involved: it is borrowed until the
//! synchronisation point, like `std::thread::scope` does for threads.
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
//!     let landing = s.copy_to_host(&stream, dev.as_slice(), &mut output)?;
//!     // Runs on a driver thread once the copy has landed; may borrow anything outliving the scope.
//!     s.then(landing, |data| data.iter_mut().for_each(|x| *x *= 10))?;
//!     Ok(())
//! })?;
//! assert_eq!(&output[..], &[10, 20, 30, 40]);
//! # Ok(()) }
//! ```
//!
//! # Pageable memory
//! Any `&[T]` works, pinned or not. From pageable memory the driver first copies the data into a
//! pinned staging buffer of its own: a copy to the device returns once the source has been staged
//! (the source is then free again, though the call may take as long as the transfer), and a copy to
//! pageable host memory returns only when it is complete. Both are correct inside a scope; only
//! pinned or registered memory overlaps with other work.
//!
//! # When synchronisation fails
//! The borrows may end only once every copy is known to be finished. If synchronising a stream
//! fails when the scope ends (a kernel faulted, the device was lost, a driver call failed), cuvmm
//! cannot confirm that: the DMA engine may still be writing into, or reading from, host memory
//! that would go back to the caller and be reused. So the process prints one line naming the
//! error and aborts, as `std` does when a thread-scope guarantee cannot be kept. Errors of the
//! scope's own calls (an invalid argument, a failed enqueue) are returned as usual; only the
//! final confirmation is fatal. Inside a stream host function, where no driver call can have
//! queued anything, the error is returned instead.

use crate::driver::{driver, result, sys::CUstream};
use crate::error::{Error, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::Stream;
use std::cell::RefCell;
use std::marker::PhantomData;

/// The handle a [`scope`] closure receives.
pub struct Scope<'a> {
    streams: RefCell<Vec<&'a Stream>>,
    /// `'a` is invariant: a `&Scope<'a>` must not shrink to a shorter lifetime, which would let a
    /// shorter-lived buffer in.
    _invariant: PhantomData<fn(&'a ()) -> &'a ()>,
}

/// The destination of a copy to the host that is still in flight. Its data can be reached only
/// once the copy has landed: through [`Scope::then`] (a host function queued after the copy) or
/// [`Landing::wait`].
#[must_use = "the data is reachable only through `Scope::then` or `Landing::wait`"]
pub struct Landing<'a, T> {
    data: &'a mut [T],
    stream: &'a Stream,
}

impl<'a, T> Landing<'a, T> {
    /// Waits for the copy (synchronises its stream) and returns the data.
    pub fn wait(self) -> Result<&'a mut [T]> {
        self.stream.synchronize()?;
        Ok(self.data)
    }
}

/// Runs `f` with a [`Scope`]; every stream used through it is synchronised before this returns.
/// Returns `f`'s error, else the first synchronisation error.
pub fn scope<'a, R>(f: impl FnOnce(&Scope<'a>) -> Result<R>) -> Result<R> {
    struct SyncOnDrop<'s, 'a>(&'s Scope<'a>);
    impl Drop for SyncOnDrop<'_, '_> {
        fn drop(&mut self) {
            // Reached only when `f` panicked: the copies must still finish before borrows end.
            let _ = self.0.finish();
        }
    }
    let scope = Scope { streams: RefCell::new(Vec::new()), _invariant: PhantomData };
    let guard = SyncOnDrop(&scope);
    let r = f(&scope);
    std::mem::forget(guard);
    scope.finish()?;
    r
}

impl Scope<'_> {
    /// Synchronises every stream used, aborting when completion cannot be confirmed (see the
    /// module documentation).
    fn finish(&self) -> Result<()> {
        for s in self.streams.borrow().iter() {
            confirm(s)?;
        }
        Ok(())
    }
}

/// Synchronises `stream`, whose queued copies use host memory about to be handed back; aborts
/// when completion cannot be confirmed (see the module documentation).
pub(crate) fn confirm(stream: &Stream) -> Result<()> {
    match stream.synchronize() {
        Ok(()) => Ok(()),
        Err(e) if crate::driver::callback::in_host_function() => Err(e),
        Err(e) => unconfirmed(&e),
    }
}

/// Ends the process: returning would hand back host memory a copy may still be using.
#[cold]
fn unconfirmed(e: &Error) -> ! {
    eprintln!(
        "cuvmm: cannot confirm that asynchronous copies of borrowed host memory have finished \
         ({e}); aborting rather than returning memory the device may still use"
    );
    std::process::abort()
}

fn same_len(host: usize, device: usize) -> Result<()> {
    if host != device {
        return Err(Error::invalid(format!(
            "length mismatch: host side {host} elements, device side {device}"
        )));
    }
    Ok(())
}

impl<'a> Scope<'a> {
    fn using(&self, stream: &'a Stream) -> CUstream {
        let mut v = self.streams.borrow_mut();
        if !v.iter().any(|s| std::ptr::eq(*s, stream)) {
            v.push(stream);
        }
        stream.raw()
    }

    /// Binds the context for a copy of `len` elements whose lengths the caller checked (before
    /// ordering it); `None` when there is nothing to copy.
    fn prepare(&self, stream: &'a Stream, len: usize) -> Result<Option<CUstream>> {
        if len == 0 {
            return Ok(None);
        }
        stream.context().bind()?;
        Ok(Some(self.using(stream)))
    }

    /// Adds `stream` to those synchronised when the scope ends: for streams that only run kernels
    /// or record events queued outside the scope's own methods.
    pub fn track(&self, stream: &'a Stream) {
        self.using(stream);
    }

    /// Queues a copy of `src` into `dst` on `stream`. Lengths must match.
    pub fn copy_to_device<T: DeviceCopy>(
        &self,
        stream: &'a Stream,
        src: &'a [T],
        mut dst: DeviceSliceMut<'_, T>,
    ) -> Result<()> {
        same_len(src.len(), dst.len())?;
        let _turn = dst.prepare_write(stream)?;
        let Some(raw) = self.prepare(stream, src.len())? else { return Ok(()) };
        // SAFETY: `src` stays borrowed (unchangeable, unfreeable) until the scope synchronises
        // `stream`; `dst` holds as many bytes.
        unsafe {
            result::mem::memcpy_htod_async(
                driver()?.api(),
                dst.ptr(),
                src.as_ptr().cast(),
                std::mem::size_of_val(src),
                raw,
            )
        }
    }

    /// Queues a copy of `src` into `dst` on `stream`; `dst` is reachable again through the
    /// returned [`Landing`] or after the scope. Lengths must match.
    pub fn copy_to_host<T: DeviceCopy>(
        &self,
        stream: &'a Stream,
        src: DeviceSlice<'_, T>,
        dst: &'a mut [T],
    ) -> Result<Landing<'a, T>> {
        same_len(dst.len(), src.len())?;
        let _turn = src.prepare_read(stream)?;
        if let Some(raw) = self.prepare(stream, dst.len())? {
            // SAFETY: `dst` stays borrowed mutably (no other access) until the copy has landed;
            // T: DeviceCopy makes any bytes written a valid T.
            unsafe {
                result::mem::memcpy_dtoh_async(
                    driver()?.api(),
                    dst.as_mut_ptr().cast(),
                    src.ptr(),
                    std::mem::size_of_val(dst),
                    raw,
                )
            }?;
        }
        Ok(Landing { data: dst, stream })
    }

    /// Queues a device-to-device copy on `stream`. Lengths must match.
    pub fn copy_on_device<T: DeviceCopy>(
        &self,
        stream: &'a Stream,
        src: DeviceSlice<'_, T>,
        mut dst: DeviceSliceMut<'_, T>,
    ) -> Result<()> {
        same_len(src.len(), dst.len())?;
        let _turns = crate::stream::order::turns(&[src.tracker(), dst.tracker()])?;
        let _r = (src.prepare_read(stream)?, dst.prepare_write(stream)?);
        let Some(raw) = self.prepare(stream, src.len())? else { return Ok(()) };
        // SAFETY: both ranges are live device memory of the lengths checked above.
        unsafe { result::mem::memcpy_dtod_async(driver()?.api(), dst.ptr(), src.ptr(), src.byte_len(), raw) }
    }

    /// Queues `dst[i] = value` on `stream`.
    pub fn fill_u32(&self, stream: &'a Stream, mut dst: DeviceSliceMut<'_, u32>, value: u32) -> Result<()> {
        let _turn = dst.prepare_write(stream)?;
        stream.context().bind()?;
        let raw = self.using(stream);
        // SAFETY: `dst` is live device memory of `len` u32s.
        unsafe { result::mem::memset_d32_async(driver()?.api(), dst.ptr(), value, dst.len(), raw) }
    }

    /// Queues `dst[i] = value` on `stream`, bytewise.
    pub fn fill_u8(&self, stream: &'a Stream, mut dst: DeviceSliceMut<'_, u8>, value: u8) -> Result<()> {
        let _turn = dst.prepare_write(stream)?;
        stream.context().bind()?;
        let raw = self.using(stream);
        // SAFETY: `dst` is live device memory of `len` bytes.
        unsafe { result::mem::memset_d8_async(driver()?.api(), dst.ptr(), value, dst.len(), raw) }
    }

    /// Queues `f` to run on a driver thread after the work queued on `stream` so far. `f` may
    /// borrow anything that outlives the scope. It must not call CUDA.
    pub fn host_fn(&self, stream: &'a Stream, f: impl FnOnce() + Send + 'a) -> Result<()> {
        self.using(stream);
        // SAFETY: the scope synchronises `stream` before 'a ends, so `f`'s borrows outlive its run.
        unsafe { stream.launch_host_fn_unchecked(f) }
    }

    /// Queues `f` to run on the landed data, right after the copy on the copy's stream.
    pub fn then<T: Send>(&self, landing: Landing<'a, T>, f: impl FnOnce(&mut [T]) + Send + 'a) -> Result<()> {
        let Landing { data, stream } = landing;
        self.host_fn(stream, move || f(data))
    }
}
