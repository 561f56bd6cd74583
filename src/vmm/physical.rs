//! Physical memory: `cuMemCreate` behind a builder, released on drop.

use super::layout::{check_aligned, round_up};
use crate::caps::{cached_granularity, granularity_of, Granularity, ImexStatus};
use crate::context::Context;
use crate::device::Device;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use std::ops::BitOr;
use std::sync::{Arc, Mutex, OnceLock};

/// Where physical memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// On a device.
    Device(Device),
    /// Pinned host memory (devices reporting host VMM support).
    Host,
    /// Pinned host memory on one NUMA node (devices reporting host-NUMA VMM support).
    HostNuma(i32),
}

impl Location {
    pub(crate) fn raw(self) -> CUmemLocation {
        match self {
            Location::Device(d) => CUmemLocation { type_: CUmemLocationType::DEVICE, id: d.raw() },
            Location::Host => CUmemLocation { type_: CUmemLocationType::HOST, id: 0 },
            Location::HostNuma(n) => CUmemLocation { type_: CUmemLocationType::HOST_NUMA, id: n },
        }
    }
}

/// The shareable handle types an allocation is created for (a bit set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct HandleTypes(u32);

impl HandleTypes {
    /// Not exportable.
    pub const NONE: HandleTypes = HandleTypes(0);
    /// Exportable as a POSIX file descriptor.
    pub const POSIX_FD: HandleTypes = HandleTypes(CUmemAllocationHandleType::POSIX_FILE_DESCRIPTOR.0 as u32);
    /// Exportable as a fabric handle (needs an IMEX channel).
    pub const FABRIC: HandleTypes = HandleTypes(CUmemAllocationHandleType::FABRIC.0 as u32);

    /// Whether every type in `other` is in `self`.
    pub fn contains(self, other: HandleTypes) -> bool {
        self.0 & other.0 == other.0
    }

    pub(crate) fn raw(self) -> CUmemAllocationHandleType {
        CUmemAllocationHandleType(self.0 as i32)
    }

    pub(crate) fn from_raw(raw: CUmemAllocationHandleType) -> HandleTypes {
        HandleTypes(raw.0 as u32)
    }
}

impl BitOr for HandleTypes {
    type Output = HandleTypes;
    fn bitor(self, rhs: HandleTypes) -> HandleTypes {
        HandleTypes(self.0 | rhs.0)
    }
}

/// Describes physical memory to create: location, handle types, compression, GPUDirect RDMA.
///
/// ```no_run
/// # fn main() -> cuvmm::Result<()> {
/// use cuvmm::vmm::{HandleTypes, PhysicalMemory};
/// let ctx = cuvmm::Context::for_ordinal(0)?;
/// let builder = PhysicalMemory::builder(&ctx).handle_types(HandleTypes::POSIX_FD);
/// let size = builder.round_up(3 << 20)?; // 4 MiB with a 2 MiB granularity
/// let phys = builder.create(size)?;
/// assert_eq!(phys.size(), size);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PhysicalBuilder {
    ctx: Context,
    location: Location,
    handles: HandleTypes,
    compression: bool,
    rdma: bool,
    /// Granularity and support checks depend only on the fields above: computed once, kept until
    /// a setter changes a field (setters start from a fresh cache).
    cache: OnceLock<Granularity>,
    checked: OnceLock<()>,
}

impl PhysicalBuilder {
    fn changed(mut self) -> Self {
        self.cache = OnceLock::new();
        self.checked = OnceLock::new();
        self
    }

    /// Where the memory lives; the default is the context's device.
    pub fn location(mut self, location: Location) -> Self {
        self.location = location;
        self.changed()
    }

    /// Which shareable handles it can be exported as; the default is none.
    pub fn handle_types(mut self, handles: HandleTypes) -> Self {
        self.handles = handles;
        self.changed()
    }

    /// Asks for generic compressible memory. The driver may still decline:
    /// [`PhysicalMemory::properties`] says what was granted.
    pub fn compression(mut self, on: bool) -> Self {
        self.compression = on;
        self.changed()
    }

    /// Marks the memory as usable for GPUDirect RDMA.
    pub fn gpu_direct_rdma(mut self, on: bool) -> Self {
        self.rdma = on;
        self.changed()
    }

    /// The configured location.
    pub fn get_location(&self) -> Location {
        self.location
    }

    /// The configured handle types.
    pub fn get_handle_types(&self) -> HandleTypes {
        self.handles
    }

    /// The context the memory is created in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub(crate) fn prop(&self) -> CUmemAllocationProp {
        CUmemAllocationProp {
            type_: CUmemAllocationType::PINNED,
            requestedHandleTypes: self.handles.raw(),
            location: self.location.raw(),
            allocFlags: CUmemAllocFlags {
                compressionType: if self.compression { CU_MEM_ALLOCATION_COMP_GENERIC } else { 0 },
                gpuDirectRDMACapable: self.rdma as u8,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The granularity of such allocations.
    pub fn granularity(&self) -> Result<Granularity> {
        if let Some(g) = self.cache.get() {
            return Ok(*g);
        }
        let prop = self.prop();
        // Asked of the driver once per process (see `caps::granularity_of`): a fresh builder for
        // the same kind of memory binds nothing and calls nothing.
        let g = match cached_granularity(&prop) {
            Some(g) => g,
            None => {
                self.ctx.bind()?;
                granularity_of(&prop, Some(&self.ctx.device()))?
            }
        };
        Ok(*self.cache.get_or_init(|| g))
    }

    /// `size` rounded up to the minimum granularity: what [`create`](Self::create) accepts.
    pub fn round_up(&self, size: usize) -> Result<usize> {
        round_up(size, self.granularity()?.minimum)
    }

    fn check_supported(&self) -> Result<()> {
        if self.checked.get().is_some() {
            return Ok(());
        }
        // The attributes asked below are what the device can do, which does not change while the
        // process runs: a combination found supported once is not asked about again, even by a
        // fresh builder. Refusals are not remembered.
        static SUPPORTED: Mutex<Vec<SupportKey>> = Mutex::new(Vec::new());
        let key = SupportKey {
            device: self.ctx.device().raw(),
            location: match self.location {
                Location::Device(_) => 0,
                Location::Host => 1,
                Location::HostNuma(_) => 2,
            },
            handles: self.handles,
            compression: self.compression,
            rdma: self.rdma,
        };
        let lock = || SUPPORTED.lock().unwrap_or_else(|e| e.into_inner());
        if !lock().contains(&key) {
            self.check_supported_uncached()?;
            let mut known = lock();
            if !known.contains(&key) {
                known.push(key);
            }
        }
        let _ = self.checked.set(());
        Ok(())
    }

    fn check_supported_uncached(&self) -> Result<()> {
        use CUdevice_attribute as A;
        let dev = self.ctx.device();
        let need = |attr, what: &str| -> Result<()> {
            if dev.flag(attr)? {
                Ok(())
            } else {
                Err(Error::unsupported(what, format!("device {} does not support it", dev.ordinal())))
            }
        };
        need(A::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management")?;
        match self.location {
            Location::Host => need(A::HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "host-located VMM memory")?,
            Location::HostNuma(_) => {
                need(A::HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "host-NUMA-located VMM memory")?
            }
            Location::Device(_) => {}
        }
        if self.handles.contains(HandleTypes::POSIX_FD) {
            need(A::HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "POSIX fd handles")?;
        }
        if self.handles.contains(HandleTypes::FABRIC) {
            need(A::HANDLE_TYPE_FABRIC_SUPPORTED, "fabric handles")?;
        }
        if self.compression {
            need(A::GENERIC_COMPRESSION_SUPPORTED, "generic compression")?;
        }
        if self.rdma {
            need(A::GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, "GPUDirect RDMA with VMM")?;
        }
        Ok(())
    }

    /// Creates `size` bytes of physical memory. `size` must be a non-zero multiple of the minimum
    /// granularity ([`round_up`](Self::round_up) gives one): rounding is never silent.
    ///
    /// Fabric handles need an IMEX channel; without one the driver refuses with
    /// `CUDA_ERROR_NOT_PERMITTED`, returned here as [`Error::Unsupported`] naming what is missing.
    pub fn create(&self, size: usize) -> Result<PhysicalMemory> {
        let g = self.granularity()?;
        check_aligned("physical allocation size", size, g.minimum)?;
        self.check_supported()?;
        let api = driver()?.api();
        let prop = self.prop();
        self.ctx.bind()?;
        let created = result::mem::create(api, size, &prop);
        match created {
            Ok(handle) => {
                Ok(PhysicalMemory::from_parts(self.ctx.clone(), handle, size, self.location, self.handles))
            }
            Err(e)
                if self.handles.contains(HandleTypes::FABRIC)
                    && (e.is_code(CUresult::ERROR_NOT_PERMITTED)
                        || e.is_code(CUresult::ERROR_NOT_SUPPORTED)) =>
            {
                let why = ImexStatus::probe()
                    .missing()
                    .unwrap_or_else(|| "the IMEX daemon or channel refused the allocation".into());
                Err(Error::unsupported("fabric handles", format!("{why} ({e})")))
            }
            Err(e) => Err(e),
        }
    }
}

/// What [`PhysicalBuilder::check_supported`] asks the driver about.
#[derive(Clone, Copy, PartialEq, Eq)]
struct SupportKey {
    device: CUdevice,
    /// 0 device, 1 host, 2 host NUMA node (any node: the attribute is the same).
    location: u8,
    handles: HandleTypes,
    compression: bool,
    rdma: bool,
}

/// Physical memory from `cuMemCreate` (or imported from another process). Cloning shares it;
/// the last clone, including those held by mappings, releases it with `cuMemRelease`.
#[derive(Clone)]
pub struct PhysicalMemory {
    inner: Arc<PhysInner>,
}

struct PhysInner {
    ctx: Context,
    handle: CUmemGenericAllocationHandle,
    size: usize,
    /// Known from the builder for created memory; for imported memory asked of the driver the
    /// first time [`PhysicalMemory::location`] needs it, not on the import path.
    location: OnceLock<Location>,
    handles: HandleTypes,
    /// The POSIX descriptor of its first [`PhysicalMemory::export_fd_kept`], closed with it.
    kept_fd: OnceLock<std::os::fd::OwnedFd>,
    serial: u64,
    /// Whether a descriptor of it was ever made: its release is then told to
    /// [`released_exports`]' watcher.
    exported: std::sync::atomic::AtomicBool,
}

/// The next [`PhysicalMemory::serial`].
static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_serial() -> u64 {
    NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What the driver says of an allocation (`cuMemGetAllocationPropertiesFromHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationProperties {
    /// Location type and id as the driver reports them.
    pub location: CUmemLocation,
    /// The handle types it can be exported as.
    pub handle_types: HandleTypes,
    /// Whether generic compression was granted.
    pub compressed: bool,
    /// Whether it is GPUDirect-RDMA capable.
    pub gpu_direct_rdma: bool,
}

impl PhysicalMemory {
    /// A builder for memory on `ctx`'s device.
    pub fn builder(ctx: &Context) -> PhysicalBuilder {
        PhysicalBuilder {
            ctx: ctx.clone(),
            location: Location::Device(ctx.device()),
            handles: HandleTypes::NONE,
            compression: false,
            rdma: false,
            cache: OnceLock::new(),
            checked: OnceLock::new(),
        }
    }

    /// Takes ownership of a handle from `cuMemCreate` or an import.
    pub(crate) fn from_parts(
        ctx: Context,
        handle: CUmemGenericAllocationHandle,
        size: usize,
        location: Location,
        handles: HandleTypes,
    ) -> PhysicalMemory {
        let location = OnceLock::from(location);
        PhysicalMemory {
            inner: Arc::new(PhysInner {
                ctx,
                handle,
                size,
                location,
                handles,
                kept_fd: OnceLock::new(),
                serial: next_serial(),
                exported: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// A number that no other physical memory of this process had or will have (its clones share
    /// it): the same number names the same memory, unlike a driver handle, which the driver gives
    /// again once released.
    pub fn serial(&self) -> u64 {
        self.inner.serial
    }

    /// The driver's handle. It stays valid while `self` (or any clone) lives.
    pub fn handle(&self) -> CUmemGenericAllocationHandle {
        self.inner.handle
    }

    /// Where it lives. For imported memory the driver is asked the first time
    /// (`cuMemGetAllocationPropertiesFromHandle`); where it cannot say, or says the memory is not
    /// on a device, the importing context's device is assumed.
    pub fn location(&self) -> Location {
        if let Some(l) = self.inner.location.get() {
            return *l;
        }
        match self.imported_location() {
            Some(l) => *self.inner.location.get_or_init(|| l),
            // Not remembered: a later call (outside a host function, say) may learn the answer.
            None => Location::Device(self.inner.ctx.device()),
        }
    }

    /// The device the driver says imported memory lives on; `None` if the driver cannot answer
    /// now.
    fn imported_location(&self) -> Option<Location> {
        let ctx = &self.inner.ctx;
        ctx.bind().ok()?;
        let p = raw_properties(self.inner.handle).ok()?;
        let here = ctx.device();
        if p.location.type_ != CUmemLocationType::DEVICE || p.location.id == here.raw() {
            return Some(Location::Device(here));
        }
        let devices = crate::device::Device::all().ok()?;
        Some(Location::Device(devices.into_iter().find(|d| d.raw() == p.location.id).unwrap_or(here)))
    }

    /// The handle types it was created for.
    pub fn handle_types(&self) -> HandleTypes {
        self.inner.handles
    }

    /// The context it was created or imported in.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Exports the allocation as a POSIX file descriptor (it must have been created with
    /// [`HandleTypes::POSIX_FD`]). Another process imports it with [`PhysicalMemory::import_fd`];
    /// the memory stays alive while any process holds a handle or a mapping.
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        if !self.inner.handles.contains(HandleTypes::POSIX_FD) {
            return Err(Error::invalid("the allocation was not created with the POSIX-fd handle type"));
        }
        self.inner.ctx.bind()?;
        let fd = result::mem::export_fd(driver()?.api(), self.inner.handle)?;
        self.inner.exported.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(fd)
    }

    /// [`export_fd`](Self::export_fd), the first one kept for as long as this memory lives here:
    /// later calls hand out duplicates of it without asking the driver (an allocator that shares
    /// the same pages again and again pays the export once). A kept descriptor counts against the
    /// process's descriptor limit: past a quarter of it, exports are not kept.
    pub fn export_fd_kept(&self) -> Result<std::os::fd::OwnedFd> {
        if let Some(fd) = self.inner.kept_fd.get() {
            return fd.try_clone().map_err(|e| Error::invalid(format!("duplicating a kept descriptor: {e}")));
        }
        let fd = self.export_fd()?;
        if kept_fds::take() {
            let kept = fd.try_clone().ok().is_some_and(|copy| self.inner.kept_fd.set(copy).is_ok());
            if !kept {
                // Another thread kept one first, or no descriptor was left: nothing kept here.
                kept_fds::give_back();
            }
        }
        Ok(fd)
    }

    /// Exports the allocation as a 64-byte fabric handle (created with [`HandleTypes::FABRIC`]).
    pub fn export_fabric(&self) -> Result<[u8; 64]> {
        if !self.inner.handles.contains(HandleTypes::FABRIC) {
            return Err(Error::invalid("the allocation was not created with the fabric handle type"));
        }
        self.inner.ctx.bind()?;
        Ok(result::mem::export_fabric(driver()?.api(), self.inner.handle)?.data)
    }

    /// Imports an allocation another process exported as a POSIX fd. `size` is the exported
    /// allocation's size (from the message that carried the fd); the fd may be closed afterwards.
    pub fn import_fd(ctx: &Context, fd: std::os::fd::BorrowedFd<'_>, size: usize) -> Result<PhysicalMemory> {
        ctx.bind()?;
        let handle = result::mem::import_fd(driver()?.api(), fd)?;
        Ok(PhysicalMemory::imported(ctx, handle, size, HandleTypes::POSIX_FD))
    }

    /// Imports an allocation exported as a fabric handle.
    pub fn import_fabric(ctx: &Context, fabric: &[u8; 64], size: usize) -> Result<PhysicalMemory> {
        ctx.bind()?;
        let handle = result::mem::import_fabric(driver()?.api(), &CUmemFabricHandle { data: *fabric })?;
        Ok(PhysicalMemory::imported(ctx, handle, size, HandleTypes::FABRIC))
    }

    /// Takes ownership of an imported handle. Where the memory lives is left to
    /// [`location`](Self::location) to ask when needed: importing is on the path every sharing
    /// waits for, and the answer (a driver query and a device enumeration) serves only re-sharing.
    fn imported(
        ctx: &Context,
        handle: CUmemGenericAllocationHandle,
        size: usize,
        handles: HandleTypes,
    ) -> PhysicalMemory {
        let inner = PhysInner {
            ctx: ctx.clone(),
            handle,
            size,
            location: OnceLock::new(),
            handles,
            kept_fd: OnceLock::new(),
            serial: next_serial(),
            exported: std::sync::atomic::AtomicBool::new(false),
        };
        PhysicalMemory { inner: Arc::new(inner) }
    }

    /// Asks the driver what was granted (compression in particular).
    pub fn properties(&self) -> Result<AllocationProperties> {
        self.inner.ctx.bind()?;
        let prop = raw_properties(self.inner.handle)?;
        Ok(AllocationProperties {
            location: prop.location,
            handle_types: HandleTypes::from_raw(prop.requestedHandleTypes),
            compressed: prop.allocFlags.compressionType == CU_MEM_ALLOCATION_COMP_GENERIC,
            gpu_direct_rdma: prop.allocFlags.gpuDirectRDMACapable != 0,
        })
    }
}

/// `cuMemGetAllocationPropertiesFromHandle` (the caller has bound a context).
fn raw_properties(handle: CUmemGenericAllocationHandle) -> Result<CUmemAllocationProp> {
    result::mem::get_allocation_properties(driver()?.api(), handle)
}

impl std::fmt::Debug for PhysicalMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhysicalMemory")
            .field("handle", &self.inner.handle)
            .field("size", &self.inner.size)
            .field("location", &self.inner.location.get())
            .finish()
    }
}

impl Drop for PhysInner {
    fn drop(&mut self) {
        if self.kept_fd.take().is_some() {
            kept_fds::give_back();
        }
        if *self.exported.get_mut() {
            released_exports::tell(self.serial);
        }
        crate::driver::callback::release_in(&self.ctx, self.handle, |api, handle| {
            // SAFETY: the handle is ours and released once. Mappings hold a clone, so none is left.
            // A failure leaves nothing to retry: it is recorded for `take_drop_error`.
            crate::error::record_drop(unsafe { result::mem::release(api, handle) });
        });
    }
}

/// Who is told when memory this process exported is released here: the hand-off's sender
/// ([`crate::ipc::handoff`]), which asks the processes that keep mappings of it to let go, so
/// that the memory goes back to the device once this process gives it back.
pub(crate) mod released_exports {
    use std::sync::OnceLock;

    type Watcher = Box<dyn Fn(u64) + Send + Sync>;
    static WATCHER: OnceLock<Watcher> = OnceLock::new();

    /// Sets the process's one watcher; false if one was set already. It is called with the
    /// serial of each exported allocation released, on the releasing thread, possibly under an
    /// allocator's lock: it must not block or call back into cuvmm.
    pub(crate) fn watch(w: Watcher) -> bool {
        WATCHER.set(w).is_ok()
    }

    pub(super) fn tell(serial: u64) {
        if let Some(w) = WATCHER.get() {
            w(serial);
        }
    }
}

/// Where this process maps pages it exported ahead, told to the hand-off's sender
/// ([`crate::ipc::handoff`]) once a receiver has asked for them: it places the pages in that
/// receiver's mirror of this address space, so that a later hand-off of them maps nothing there.
pub(crate) mod placements {
    use super::PhysicalMemory;
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::OnceLock;

    /// A page mapped or unmapped.
    pub(crate) enum Event {
        /// A page now mapped at `addr`, with a descriptor of it, on the device with UUID `device`.
        Placed { device: [u8; 16], serial: u64, addr: u64, size: u64, fd: OwnedFd },
        /// The page mapped at `addr` is mapped there no more.
        Unplaced { device: [u8; 16], addr: u64 },
    }

    type Watcher = Box<dyn Fn(Event) + Send + Sync>;
    static WATCHER: OnceLock<Watcher> = OnceLock::new();
    static WANTED: AtomicBool = AtomicBool::new(false);

    /// Pages smaller than this are not placed: a receiver would pay an import for each small
    /// page whether it takes it or not, where large pages are what a first hand-off waits for.
    pub(crate) const SMALLEST: usize = 64 << 20;

    /// Sets the process's one watcher; false if one was set already. It is called on the
    /// mapping thread, possibly under an allocator's lock: it must not block or call back into
    /// cuvmm.
    pub(crate) fn watch(w: Watcher) -> bool {
        WATCHER.set(w).is_ok()
    }

    /// From now on, mappings of pages exported ahead are told (a receiver has asked).
    pub(crate) fn want() {
        WANTED.store(true, Ordering::Relaxed);
    }

    /// Whether mappings are told.
    pub(crate) fn wanted() -> bool {
        WANTED.load(Ordering::Relaxed)
    }

    /// `page`, exported ahead (its descriptor kept), is now mapped at `addr` on `device`.
    pub(crate) fn placed(device: [u8; 16], page: &PhysicalMemory, addr: u64) {
        let (Some(w), Some(kept)) = (WATCHER.get(), page.inner.kept_fd.get()) else { return };
        if page.size() < SMALLEST {
            return;
        }
        // Without a descriptor to spare, the page is simply not placed.
        if let Ok(fd) = kept.try_clone() {
            w(Event::Placed { device, serial: page.serial(), addr, size: page.size() as u64, fd });
        }
    }

    /// The page mapped at `addr` on `device` is unmapped.
    pub(crate) fn unplaced(device: [u8; 16], addr: u64, size: usize) {
        if let Some(w) = WATCHER.get().filter(|_| size >= SMALLEST) {
            w(Event::Unplaced { device, addr });
        }
    }
}

/// How many exported descriptors [`PhysicalMemory::export_fd_kept`] keeps in this process, held
/// under a quarter of the descriptor limit so that keeping them never makes an export fail.
mod kept_fds {
    use std::sync::atomic::{AtomicUsize, Ordering};

    static KEPT: AtomicUsize = AtomicUsize::new(0);

    /// Counts one more kept descriptor, unless that would pass the budget.
    pub(super) fn take() -> bool {
        let budget = budget();
        KEPT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < budget).then_some(n + 1)).is_ok()
    }

    pub(super) fn give_back() {
        KEPT.fetch_sub(1, Ordering::Relaxed);
    }

    /// A quarter of the soft descriptor limit as it is now (a process may raise it at any time).
    fn budget() -> usize {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit into the struct it is given, which lives here.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return 0;
        }
        usize::try_from(lim.rlim_cur / 4).unwrap_or(usize::MAX)
    }
}
