//! Plain-data element types and borrowed views of device memory.

use crate::driver::sys::CUdeviceptr;
use crate::error::{Error, Result};
use crate::stream::order::{Tracker, Turn, Use};
use crate::stream::Stream;
use std::marker::PhantomData;
use std::ops::Range;

/// Types that may be copied bytewise between host and device.
///
/// # Safety
/// Implementors must have no padding and no invalid bit patterns (any bytes a kernel or another
/// process writes must be a valid value), and must own no resources: `Copy`, `'static`, like
/// bytemuck's `Pod`. `bool`, `char`, references and enums do not qualify.
pub unsafe trait DeviceCopy: Copy + Send + Sync + 'static {}

macro_rules! device_copy {
    ($($t:ty),*) => {$(
        // SAFETY: a primitive integer or float: every bit pattern is valid and there is no padding.
        unsafe impl DeviceCopy for $t {}
    )*};
}
device_copy!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);
// SAFETY: an array of plain data has no padding between elements and inherits their validity.
unsafe impl<T: DeviceCopy, const N: usize> DeviceCopy for [T; N] {}

/// The accessors both view types share.
macro_rules! view_accessors {
    () => {
        /// The device address.
        pub fn ptr(&self) -> CUdeviceptr {
            self.ptr
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether there are no elements.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// Length in bytes.
        pub fn byte_len(&self) -> usize {
            self.len * std::mem::size_of::<T>()
        }

        /// Makes `stream` wait for the work other streams queued through cuvmm that wrote this
        /// memory, and records a read on `stream`: call it before queuing your own kernel or copy
        /// that reads the view on `stream` (cuvmm's own operations do it themselves), and keep the
        /// returned [`Turn`] until that work is queued. Views made with `from_raw_parts` carry no
        /// record and return at once. See [`crate::stream::order`].
        pub fn prepare_read(&self, stream: &Stream) -> Result<Turn<'a>> {
            self.order_on(stream, Use::Read)
        }

        fn order_on(&self, stream: &Stream, access: Use) -> Result<Turn<'a>> {
            match self.order {
                Some(t) => t.device_access(stream, self.ptr, self.end(), access),
                None => Ok(Turn::none()),
            }
        }

        /// Waits on the host for the conflicting work of other streams, before a synchronous
        /// access; hold the turn until that access is done.
        pub(crate) fn host(&self, access: Use) -> Result<Turn<'a>> {
            match self.order {
                Some(t) => t.host_access(self.ptr, self.end(), access),
                None => Ok(Turn::none()),
            }
        }

        /// The record the view carries, if any.
        pub(crate) fn tracker(&self) -> Option<&'a Tracker> {
            self.order
        }

        fn end(&self) -> u64 {
            self.ptr + self.byte_len() as u64
        }
    };
}

fn sub_range(len: usize, r: &Range<usize>) -> Result<()> {
    if r.start > r.end || r.end > len {
        return Err(Error::invalid(format!("range {r:?} is out of bounds for length {len}")));
    }
    Ok(())
}

/// A borrowed, read-only view of `len` elements of device memory, for kernel launches and copies.
/// The borrow keeps the memory mapped for as long as the view exists on the host; device work
/// queued through it stays safe afterwards because cuvmm's owners synchronise before they unmap.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    order: Option<&'a Tracker>,
    _m: PhantomData<&'a [T]>,
}

/// A borrowed, writable view of device memory.
#[derive(Debug)]
pub struct DeviceSliceMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    order: Option<&'a Tracker>,
    _m: PhantomData<&'a mut [T]>,
}

#[cfg(feature = "cudarc")]
impl<T> DeviceSlice<'_, T> {
    /// The field holding the device address, for cudarc's launch builder (see `crate::cudarc`).
    pub(crate) fn addr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}

#[cfg(feature = "cudarc")]
impl<T> DeviceSliceMut<'_, T> {
    /// As [`DeviceSlice::addr_ref`].
    pub(crate) fn addr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}

impl<'a, T: DeviceCopy> DeviceSlice<'a, T> {
    /// A view of `len` elements at `ptr`, with no record of the streams that use it.
    ///
    /// # Safety
    /// `ptr` must be device memory, accessible from the context it will be used in, valid for `len`
    /// elements for all of `'a`, and stay valid until device work queued through the view has
    /// finished. The view carries no cross-stream record: the caller orders work on different
    /// streams that touches this memory (see [`crate::stream::order`]).
    pub unsafe fn from_raw_parts(ptr: CUdeviceptr, len: usize) -> Self {
        DeviceSlice { ptr, len, order: None, _m: PhantomData }
    }

    /// A view whose uses are recorded in `order`, the record of the memory's owner.
    ///
    /// # Safety
    /// As [`from_raw_parts`](Self::from_raw_parts), except that the ordering is `order`'s job.
    pub(crate) unsafe fn tracked(ptr: CUdeviceptr, len: usize, order: &'a Tracker) -> Self {
        DeviceSlice { ptr, len, order: Some(order), _m: PhantomData }
    }

    view_accessors!();

    /// A sub-view; out-of-bounds ranges are errors.
    pub fn slice(&self, r: Range<usize>) -> Result<DeviceSlice<'a, T>> {
        sub_range(self.len, &r)?;
        Ok(DeviceSlice {
            ptr: self.ptr + (r.start * std::mem::size_of::<T>()) as u64,
            len: r.len(),
            order: self.order,
            _m: PhantomData,
        })
    }
}

impl<'a, T: DeviceCopy> DeviceSliceMut<'a, T> {
    /// A writable view of `len` elements at `ptr`.
    ///
    /// # Safety
    /// As [`DeviceSlice::from_raw_parts`], and nothing else may use the memory as a `DeviceSliceMut`
    /// at the same time.
    pub unsafe fn from_raw_parts(ptr: CUdeviceptr, len: usize) -> Self {
        DeviceSliceMut { ptr, len, order: None, _m: PhantomData }
    }

    /// A writable view whose uses are recorded in `order`.
    ///
    /// # Safety
    /// As [`from_raw_parts`](Self::from_raw_parts), except that the ordering is `order`'s job.
    pub(crate) unsafe fn tracked(ptr: CUdeviceptr, len: usize, order: &'a Tracker) -> Self {
        DeviceSliceMut { ptr, len, order: Some(order), _m: PhantomData }
    }

    view_accessors!();

    /// Like [`prepare_read`](Self::prepare_read), for work that writes the view on `stream`: it
    /// waits for earlier reads and writes on other streams.
    pub fn prepare_write(&mut self, stream: &Stream) -> Result<Turn<'a>> {
        self.order_on(stream, Use::Write)
    }

    /// A read-only view of the same memory.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice { ptr: self.ptr, len: self.len, order: self.order, _m: PhantomData }
    }

    /// Reborrows for a shorter time.
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut { ptr: self.ptr, len: self.len, order: self.order, _m: PhantomData }
    }

    /// A writable sub-view; out-of-bounds ranges are errors.
    pub fn slice_mut(self, r: Range<usize>) -> Result<DeviceSliceMut<'a, T>> {
        sub_range(self.len, &r)?;
        Ok(DeviceSliceMut {
            ptr: self.ptr + (r.start * std::mem::size_of::<T>()) as u64,
            len: r.len(),
            order: self.order,
            _m: PhantomData,
        })
    }

    /// Splits into two disjoint writable views at `mid`.
    pub fn split_at_mut(self, mid: usize) -> Result<(DeviceSliceMut<'a, T>, DeviceSliceMut<'a, T>)> {
        sub_range(self.len, &(0..mid))?;
        let tail = self.ptr + (mid * std::mem::size_of::<T>()) as u64;
        Ok((
            DeviceSliceMut { ptr: self.ptr, len: mid, order: self.order, _m: PhantomData },
            DeviceSliceMut { ptr: tail, len: self.len - mid, order: self.order, _m: PhantomData },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_views_check_bounds_and_offset_by_element_size() {
        // SAFETY: the views are never used to reach a device.
        let v = unsafe { DeviceSlice::<u32>::from_raw_parts(0x1000, 10) };
        let s = v.slice(2..5).unwrap();
        assert_eq!((s.ptr(), s.len(), s.byte_len()), (0x1008, 3, 12));
        assert!(v.slice(5..11).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 6..5;
        assert!(v.slice(reversed).is_err());
        // SAFETY: as above.
        let m = unsafe { DeviceSliceMut::<u64>::from_raw_parts(0x2000, 4) };
        let (a, b) = m.split_at_mut(1).unwrap();
        assert_eq!((a.ptr(), a.len(), b.ptr(), b.len()), (0x2000, 1, 0x2008, 3));
        assert!(b.split_at_mut(4).is_err());
    }
}
