//! Virtual address reservations, mappings into them, and per-device access.

use super::layout::{check_aligned, round_up};
use super::physical::PhysicalMemory;
use crate::caps::device_granularity;
use crate::context::Context;
use crate::device::Device;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

/// What a device may do with a mapped range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Nothing: an access faults.
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl Access {
    fn raw(self) -> CUmemAccess_flags {
        match self {
            Access::None => CUmemAccess_flags::PROT_NONE,
            Access::Read => CUmemAccess_flags::PROT_READ,
            Access::ReadWrite => CUmemAccess_flags::PROT_READWRITE,
        }
    }

    fn from_raw(flags: u64) -> Access {
        match flags {
            3 => Access::ReadWrite,
            1 => Access::Read,
            _ => Access::None,
        }
    }
}

/// A range of device virtual addresses (`cuMemAddressReserve`), shared by cloning.
///
/// Every [`Mapping`] into it holds a clone, so the range is freed (`cuMemAddressFree`) only after
/// the last mapping has been unmapped: the release order the CUDA guide prescribes (synchronise,
/// unmap, release the physical memory, free the addresses) follows from ownership.
#[derive(Clone)]
pub struct Reservation {
    inner: Arc<ResInner>,
}

struct ResInner {
    ctx: Context,
    base: CUdeviceptr,
    size: usize,
    granularity: usize,
    /// Live mappings as (offset, length), sorted by offset, never overlapping. A vector rather
    /// than a `BTreeMap`: a reservation holds few mappings, and once it has held one, mapping and
    /// unmapping allocate nothing (inserting into a `BTreeMap` was most of `map`'s own cost).
    mapped: Mutex<Vec<(usize, usize)>>,
    /// Every device granted access to any part of the range: synchronised before an unmap.
    accessors: Mutex<Vec<Context>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Reservation {
    /// Reserves at least `size` bytes, rounded up to the device's allocation granularity.
    pub fn new(ctx: &Context, size: usize) -> Result<Reservation> {
        Reservation::with_options(ctx, size, 0, None)
    }

    /// Reserves at least `size` bytes (rounded up to the granularity) aligned to `alignment`
    /// (0 for the default, else a power of two), preferably at `hint` (the driver may place the
    /// range elsewhere; [`base`](Self::base) says where it is).
    pub fn with_options(
        ctx: &Context,
        size: usize,
        alignment: usize,
        hint: Option<u64>,
    ) -> Result<Reservation> {
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(Error::invalid(format!("alignment {alignment} is not a power of two")));
        }
        let granularity = device_granularity(&ctx.device(), CUmemAllocationHandleType::NONE)?.minimum;
        let size = round_up(size, granularity)?;
        ctx.bind()?;
        // Size and alignment checked above; the hint is only a hint.
        let base = result::mem::address_reserve(driver()?.api(), size, alignment, hint.unwrap_or(0))?;
        Ok(Reservation {
            inner: Arc::new(ResInner {
                ctx: ctx.clone(),
                base,
                size,
                granularity,
                mapped: Mutex::new(Vec::new()),
                accessors: Mutex::new(Vec::new()),
            }),
        })
    }

    /// First address.
    pub fn base(&self) -> CUdeviceptr {
        self.inner.base
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The granularity offsets and lengths must be multiples of.
    pub fn granularity(&self) -> usize {
        self.inner.granularity
    }

    /// The context it was reserved in.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// `x` modulo the granularity: a mask for the powers of two every driver reports, no division.
    fn misalignment(&self, x: usize) -> usize {
        let g = self.inner.granularity;
        if g.is_power_of_two() {
            x & (g - 1)
        } else {
            x % g
        }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        if len == 0 || self.misalignment(len) != 0 {
            return check_aligned("length", len, self.inner.granularity);
        }
        if self.misalignment(offset) != 0 {
            return Err(Error::invalid(format!(
                "offset {offset} is not a multiple of the granularity ({})",
                self.inner.granularity
            )));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.size => Ok(()),
            _ => Err(Error::invalid(format!(
                "range {offset}+{len} is past the end of the {}-byte reservation",
                self.inner.size
            ))),
        }
    }

    /// Whether `[offset, offset + len)` is entirely covered by live mappings.
    pub fn is_mapped(&self, offset: usize, len: usize) -> bool {
        let mapped = lock(&self.inner.mapped);
        let mut at = offset;
        let end = offset.saturating_add(len);
        let before_end = mapped.partition_point(|&(o, _)| o < end);
        for &(o, l) in &mapped[..before_end] {
            if o + l <= at {
                continue;
            }
            if o > at {
                return false;
            }
            at = o + l;
            if at >= end {
                return true;
            }
        }
        at >= end
    }

    /// Maps `len` bytes of `phys`, from `phys_offset`, at `offset` in this range.
    ///
    /// The mapping keeps both the physical memory and this reservation alive. Misaligned or
    /// out-of-range arguments and ranges that overlap a live mapping are [`Error::InvalidArgument`]s.
    /// The new mapping is not accessible by any device until [`Mapping::set_access`].
    pub fn map(
        &self,
        offset: usize,
        phys: &PhysicalMemory,
        phys_offset: usize,
        len: usize,
    ) -> Result<Mapping> {
        self.check_range(offset, len)?;
        if self.misalignment(phys_offset) != 0
            || phys_offset.checked_add(len).map_or(true, |end| end > phys.size())
        {
            return Err(Error::invalid(format!(
                "physical range {phys_offset}+{len} is misaligned or past the end of the {}-byte allocation",
                phys.size()
            )));
        }
        let mut mapped = lock(&self.inner.mapped);
        let end = offset + len;
        // Mappings before `at` start before the end of the new one; only the last of them can
        // reach into it, and the new one goes right after it.
        let at = mapped.partition_point(|&(o, _)| o < end);
        if let Some(&(o, l)) = at.checked_sub(1).map(|i| &mapped[i]) {
            if o + l > offset {
                return Err(Error::invalid(format!(
                    "range {offset}+{len} overlaps the live mapping at {o}+{l}: unmap it first"
                )));
            }
        }
        let api = driver()?.api();
        let ptr = self.inner.base + offset as u64;
        // SAFETY: the range lies inside our reservation and overlaps no live mapping; the physical
        // range lies inside a live allocation; both are granularity-aligned.
        let map = || unsafe { result::mem::map(api, ptr, len, phys_offset, phys.handle()) };
        // cuMemMap names everything it works on (a process-wide address range, an allocation
        // handle), so it does not re-bind a context cuvmm last bound on this thread: that cost a
        // cuCtxSetCurrent per map. If code outside cuvmm left no usable context current since
        // (none at all, or one it destroyed), the driver may refuse: then the context is bound
        // and the map tried again.
        self.inner.ctx.bind_unless_last()?;
        match map() {
            Err(e)
                if e.is_code(CUresult::ERROR_INVALID_CONTEXT)
                    || e.is_code(CUresult::ERROR_CONTEXT_IS_DESTROYED) =>
            {
                self.inner.ctx.bind()?;
                map()
            }
            r => r,
        }?;
        mapped.insert(at, (offset, len));
        Ok(Mapping { res: self.clone(), phys: phys.clone(), offset, len, idle: false })
    }

    /// Maps the whole of `phys` at `offset`.
    pub fn map_all(&self, offset: usize, phys: &PhysicalMemory) -> Result<Mapping> {
        self.map(offset, phys, 0, phys.size())
    }

    /// Grants each listed device its access to `[offset, offset + len)`, which must be mapped
    /// (by one or several mappings). Devices not listed keep what they had.
    pub fn set_access(&self, offset: usize, len: usize, grants: &[(Device, Access)]) -> Result<()> {
        self.check_range(offset, len)?;
        if grants.is_empty() {
            return Err(Error::invalid("no devices to grant access to"));
        }
        if !self.is_mapped(offset, len) {
            return Err(Error::invalid(format!("range {offset}+{len} is not entirely mapped")));
        }
        let descs: Vec<CUmemAccessDesc> = grants
            .iter()
            .map(|(d, a)| CUmemAccessDesc { location: super::Location::Device(*d).raw(), flags: a.raw() })
            .collect();
        // Record the devices first: an unmap must wait for them even if the driver call below
        // fails part-way.
        {
            let mut acc = lock(&self.inner.accessors);
            for (d, _) in grants {
                if *d != self.inner.ctx.device() && !acc.iter().any(|c| c.device() == *d) {
                    acc.push(Context::new(*d)?);
                }
            }
        }
        self.inner.ctx.bind()?;
        // SAFETY: the range is inside the reservation and fully mapped.
        unsafe { result::mem::set_access(driver()?.api(), self.inner.base + offset as u64, len, &descs) }
    }

    /// The access `device` has at `offset` (`cuMemGetAccess`).
    pub fn access(&self, offset: usize, device: Device) -> Result<Access> {
        if offset >= self.inner.size {
            return Err(Error::invalid(format!("offset {offset} is past the end of the reservation")));
        }
        let loc = super::Location::Device(device).raw();
        self.inner.ctx.bind()?;
        let flags = result::mem::get_access(driver()?.api(), &loc, self.inner.base + offset as u64)?;
        Ok(Access::from_raw(flags))
    }

    /// Waits for every device that may touch this range; the reservation's own context last, so
    /// that it is the one left current for the unmap that follows.
    /// Waits for every device granted access; whether every wait succeeded (a failure is
    /// recorded for [`take_drop_error`](crate::error::take_drop_error)).
    fn synchronize_users(&self) -> bool {
        // Not under the lock: a host function on one of those devices' streams may be waiting
        // for it (in `set_access`), and the synchronisation waits for that host function.
        let users = lock(&self.inner.accessors).clone();
        let mut ok = true;
        for c in users.iter().chain(std::iter::once(&self.inner.ctx)) {
            if let Err(e) = c.synchronize() {
                crate::error::record_drop::<()>(Err(e));
                ok = false;
            }
        }
        ok
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("base", &format_args!("{:#x}", self.inner.base))
            .field("size", &self.inner.size)
            .finish()
    }
}

impl Drop for ResInner {
    fn drop(&mut self) {
        crate::driver::callback::release_in(&self.ctx, (self.base, self.size), |api, (base, size)| {
            // SAFETY: every mapping holds a clone of the reservation, so none is left; the range is
            // ours.
            crate::error::record_drop(unsafe { result::mem::address_free(api, base, size) });
        });
    }
}

/// Physical memory mapped into a reservation. Dropping it waits for every device that was granted
/// access to the reservation, then unmaps.
pub struct Mapping {
    res: Reservation,
    phys: PhysicalMemory,
    offset: usize,
    len: usize,
    /// No work that uses it is queued or running (see [`Mapping::assume_idle`]).
    idle: bool,
}

impl Mapping {
    /// The mapped address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.res.base() + self.offset as u64
    }

    /// Mapped length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: mappings are at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Offset in the reservation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The physical memory behind it.
    pub fn physical(&self) -> &PhysicalMemory {
        &self.phys
    }

    /// The reservation it lives in.
    pub fn reservation(&self) -> &Reservation {
        &self.res
    }

    /// Grants access to this mapping's range (see [`Reservation::set_access`]).
    pub fn set_access(&self, grants: &[(Device, Access)]) -> Result<()> {
        self.res.set_access(self.offset, self.len, grants)
    }

    /// The access `device` has to this mapping.
    pub fn access(&self, device: Device) -> Result<Access> {
        self.res.access(self.offset, device)
    }

    /// Its drop unmaps at once, without waiting for the devices granted access.
    ///
    /// # Safety
    /// No work that uses the mapping may be queued or running when it is dropped (its users'
    /// work was waited for by other means, such as events recorded after it).
    pub(crate) unsafe fn assume_idle(&mut self) {
        self.idle = true;
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("len", &self.len)
            .field("phys", &self.phys)
            .finish()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // The physical memory stays alive (and mapped) until the release below has run.
        let (res, phys, offset, len, idle) =
            (self.res.clone(), self.phys.clone(), self.offset, self.len, self.idle);
        crate::driver::callback::release(move || {
            // Work still queued on any device may use these addresses: unmapping under it would
            // fault the context. Unlike cuMemFree, cuMemUnmap does not wait for it. Where that
            // wait failed, the work may still run: the range stays mapped, and reserved, for good.
            if !idle && !res.synchronize_users() {
                std::mem::forget(res);
                std::mem::forget(phys);
                return;
            }
            if let Ok(d) = driver() {
                // Bound by the synchronisation just above: no cuCtxSetCurrent of its own.
                let _ = res.inner.ctx.bind_unless_last();
                // SAFETY: this range was mapped by `Reservation::map` and is unmapped once, here.
                crate::error::record_drop(unsafe {
                    result::mem::unmap(d.api(), res.base() + offset as u64, len)
                });
            }
            {
                let mut mapped = lock(&res.inner.mapped);
                if let Ok(i) = mapped.binary_search_by_key(&offset, |&(o, _)| o) {
                    mapped.remove(i);
                }
            }
            drop(phys);
        });
    }
}
