//! One contiguous range backed by chunks that live on several devices (the vectorAddMMAP sample).

use super::layout::round_up;
use super::physical::PhysicalMemory;
use super::reservation::{Access, Mapping, Reservation};
use crate::context::Context;
use crate::device::Device;
use crate::driver::sys::CUdeviceptr;
use crate::error::{Error, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};

/// A range whose `stripe`-byte chunks are placed round-robin on the given devices, every device
/// granted read-write access to all of it. Kernels on any of them see one flat array.
///
/// ```no_run
/// # fn main() -> cuvmm::Result<()> {
/// let ctxs: Vec<_> = cuvmm::Device::all()?.into_iter().map(cuvmm::Context::new).collect::<Result<_, _>>()?;
/// let buf = cuvmm::vmm::Striped::new(&ctxs, 64 << 20, 2 << 20)?;
/// println!("{} bytes at {:#x}, chunk 3 lives on device {}", buf.len(), buf.ptr(), buf.owner(3 * buf.stripe()).ordinal());
/// # Ok(()) }
/// ```
pub struct Striped {
    // Dropped before `reservation` is: unmaps come before the address range is freed.
    mappings: Vec<Mapping>,
    reservation: Reservation,
    devices: Vec<Device>,
    stripe: usize,
    len: usize,
    order: crate::stream::order::Tracker,
}

impl std::fmt::Debug for Striped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Striped")
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("len", &self.len)
            .field("stripe", &self.stripe)
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl Striped {
    /// At least `size` bytes in chunks of at least `stripe` bytes (both rounded up to the largest
    /// granularity among the devices).
    pub fn new(ctxs: &[Context], size: usize, stripe: usize) -> Result<Striped> {
        if ctxs.is_empty() {
            return Err(Error::invalid("striping needs at least one device"));
        }
        let mut g = 1;
        for c in ctxs {
            g = g.max(PhysicalMemory::builder(c).granularity()?.minimum);
        }
        let stripe = round_up(stripe, g)?;
        let len = round_up(size, stripe)?;
        let reservation = Reservation::new(&ctxs[0], len)?;
        let mut mappings = Vec::with_capacity(len / stripe);
        for i in 0..len / stripe {
            let ctx = &ctxs[i % ctxs.len()];
            let phys = PhysicalMemory::builder(ctx).create(stripe)?;
            mappings.push(reservation.map(i * stripe, &phys, 0, stripe)?);
        }
        let devices: Vec<Device> = ctxs.iter().map(Context::device).collect();
        let grants: Vec<(Device, Access)> = devices.iter().map(|d| (*d, Access::ReadWrite)).collect();
        reservation.set_access(0, len, &grants)?;
        Ok(Striped {
            mappings,
            reservation,
            devices,
            stripe,
            len,
            order: crate::stream::order::Tracker::new(),
        })
    }

    /// First address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.reservation.base()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a striped range holds at least one chunk.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Chunk size in bytes.
    pub fn stripe(&self) -> usize {
        self.stripe
    }

    /// The device whose memory backs byte `offset` (offsets past the end wrap to the last chunk's owner).
    pub fn owner(&self, offset: usize) -> Device {
        let i = (offset.min(self.len - 1)) / self.stripe;
        self.devices[i % self.devices.len()]
    }

    /// The whole range as `T`s (a trailing partial element is left out).
    pub fn as_slice<T: DeviceCopy>(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the range is mapped and accessible to every device while self lives.
        unsafe { DeviceSlice::tracked(self.ptr(), self.len / std::mem::size_of::<T>().max(1), &self.order) }
    }

    /// The whole range as writable `T`s.
    pub fn as_mut_slice<T: DeviceCopy>(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as above; `&mut self` makes the view unique.
        unsafe {
            DeviceSliceMut::tracked(self.ptr(), self.len / std::mem::size_of::<T>().max(1), &self.order)
        }
    }

    /// The mappings, one per chunk, in address order.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    /// The reservation.
    pub fn reservation(&self) -> &Reservation {
        &self.reservation
    }
}
