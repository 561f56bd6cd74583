//! Page-locked host memory: allocated pinned buffers, and registration of memory the caller owns.

use crate::context::Context;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Refusal, Result};
use crate::memory::DeviceCopy;
use crate::vmm::bytes_for;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of every [`PinnedBuffer`] alive in the process.
static PINNED: AtomicU64 = AtomicU64::new(0);

/// Bytes of host memory pinned by cuvmm's [`PinnedBuffer`]s alive now (staging rings and pinned
/// sleep backups among them; memory a caller registers with [`Registered`] is not counted).
pub fn pinned_bytes() -> u64 {
    PINNED.load(Ordering::Relaxed)
}

/// Flags of [`PinnedBuffer::with_flags`] (`cuMemHostAlloc`). The default is none of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedFlags {
    /// Pinned for every context, not only the allocating one.
    pub portable: bool,
    /// Mapped into the device's address space ([`PinnedBuffer::device_ptr`]).
    pub device_mapped: bool,
    /// Write-combined: fast for the host to write and the device to read, very slow for the host
    /// to read. Never the default.
    pub write_combined: bool,
}

impl PinnedFlags {
    fn raw(self) -> u32 {
        (self.portable as u32 * CU_MEMHOSTALLOC_PORTABLE)
            | (self.device_mapped as u32 * CU_MEMHOSTALLOC_DEVICEMAP)
            | (self.write_combined as u32 * CU_MEMHOSTALLOC_WRITECOMBINED)
    }
}

/// `len` elements of pinned host memory, zero-initialised, usable as `[T]`.
///
/// Copies between pinned memory and the device run at full bus speed and truly asynchronously.
/// Pinning too much starves the rest of the system of pageable memory.
pub struct PinnedBuffer<T: DeviceCopy> {
    ctx: Context,
    ptr: NonNull<T>,
    len: usize,
    flags: PinnedFlags,
    /// For a large buffer: the anonymous mapping (address, length) that holds it, registered
    /// with the driver; `None` for `cuMemHostAlloc` memory.
    mapping: Option<(usize, usize)>,
}

/// From this size on, a pinned buffer without write-combining is mapped by the process,
/// faulted in by several threads (with transparent huge pages where the system allows) and then
/// registered: far faster than `cuMemHostAlloc`, which faults in and locks the pages on
/// one thread (docs/PERFORMANCE.md, "Figures behind the defaults").
const MAPPED_FROM: usize = 64 << 20;

/// Huge-page size the mapping is aligned to.
const HUGE: usize = 2 << 20;

/// Maps `bytes` of anonymous memory aligned to [`HUGE`], asks for huge pages, faults it in on
/// several threads and registers it with `flags` (`CU_MEMHOSTREGISTER_*`). Returns the buffer's
/// address and the mapping (address, length). The memory reads as zeros (fresh anonymous pages).
fn map_and_register(ctx: &Context, bytes: usize, flags: u32) -> Result<(NonNull<u8>, (usize, usize))> {
    let map_len = bytes.checked_add(HUGE).ok_or_else(|| Error::invalid("pinned buffer too large"))?;
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(Error::invalid(format!(
            "mmap of {map_len} bytes for a pinned buffer failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    let unmap = |reason: Error| {
        // SAFETY: the mapping made above, not registered and not referenced by anything.
        unsafe { libc::munmap(base, map_len) };
        reason
    };
    let start = (base as usize).next_multiple_of(HUGE);
    // SAFETY: [start, start + bytes) lies inside the mapping. The advice only affects how the
    // kernel backs the range; failure (no transparent huge pages) leaves ordinary pages.
    unsafe { libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
    fault_in(start, bytes);
    if let Err(e) = ctx.bind() {
        return Err(unmap(e));
    }
    // SAFETY: the range is mapped, readable and writable, and owned by the buffer being built.
    let r = unsafe { driver().and_then(|d| result::host::register(d.api(), start as *mut _, bytes, flags)) };
    if let Err(e) = r {
        return Err(unmap(e));
    }
    let ptr = NonNull::new(start as *mut u8).expect("mmap never returns a null mapping");
    Ok((ptr, (base as usize, map_len)))
}

/// Writes a zero into every page of `[start, start + bytes)` (fresh anonymous memory, so the
/// contents stay zero) from several threads: the kernel's page faults and zeroing, which take most
/// of the time of pinning, run in parallel.
fn fault_in(start: usize, bytes: usize) {
    let threads =
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(16).min(bytes / MAPPED_FROM).max(1);
    let per = bytes.div_ceil(threads).next_multiple_of(4096);
    std::thread::scope(|s| {
        for k in 0..threads {
            let (lo, hi) = (start + k * per, (start + (k + 1) * per).min(start + bytes));
            s.spawn(move || {
                for page in (lo..hi).step_by(4096) {
                    // SAFETY: inside the fresh mapping, which no reference covers yet; each
                    // thread writes only its own part.
                    unsafe { std::ptr::write_volatile(page as *mut u8, 0) };
                }
            });
        }
    });
}

// SAFETY: the buffer owns its memory exclusively, like a Box<[T]>; T: DeviceCopy is Send + Sync.
unsafe impl<T: DeviceCopy> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads, through &[T].
unsafe impl<T: DeviceCopy> Sync for PinnedBuffer<T> {}

impl<T: DeviceCopy> PinnedBuffer<T> {
    /// Zeroed pinned storage for `len` elements, no flags.
    pub fn new(ctx: &Context, len: usize) -> Result<Self> {
        PinnedBuffer::with_flags(ctx, len, PinnedFlags::default())
    }

    /// Zeroed pinned storage for `len` elements with `flags`.
    pub fn with_flags(ctx: &Context, len: usize, flags: PinnedFlags) -> Result<Self> {
        let bytes = bytes_for(len, std::mem::size_of::<T>())?;
        if bytes == 0 {
            return Err(Error::invalid("a pinned buffer needs at least one byte"));
        }
        if bytes >= MAPPED_FROM && !flags.write_combined {
            let reg = (flags.portable as u32 * CU_MEMHOSTREGISTER_PORTABLE)
                | (flags.device_mapped as u32 * CU_MEMHOSTREGISTER_DEVICEMAP);
            let (p, mapping) = map_and_register(ctx, bytes, reg)?;
            PINNED.fetch_add(bytes as u64, Ordering::Relaxed);
            // Fresh anonymous pages read as zeros: a valid T (DeviceCopy).
            return Ok(PinnedBuffer { ctx: ctx.clone(), ptr: p.cast(), len, flags, mapping: Some(mapping) });
        }
        ctx.bind()?;
        let p = result::host::alloc(driver()?.api(), bytes, flags.raw())?;
        let ptr =
            NonNull::new(p.cast::<T>()).ok_or_else(|| Error::invalid("cuMemHostAlloc returned null"))?;
        // SAFETY: the allocation holds `bytes` bytes; zero bytes are a valid T (DeviceCopy), and
        // writing them initialises the memory before any &[T] exists.
        unsafe { std::ptr::write_bytes(ptr.as_ptr().cast::<u8>(), 0, bytes) };
        PINNED.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(PinnedBuffer { ctx: ctx.clone(), ptr, len, flags, mapping: None })
    }

    /// A pinned copy of `data`.
    pub fn from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        let mut b = PinnedBuffer::new(ctx, data.len())?;
        b.copy_from_slice(data);
        Ok(b)
    }

    /// The allocation's base pointer, not derived from any reference: for code that hands
    /// disjoint parts of the buffer to asynchronous copies while no `&[T]` to those parts exists.
    pub fn base_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> PinnedFlags {
        self.flags
    }

    /// The device address of a `device_mapped` buffer.
    pub fn device_ptr(&self) -> Result<CUdeviceptr> {
        if !self.flags.device_mapped {
            return Err(Error::invalid("the buffer was not allocated with device_mapped"));
        }
        self.ctx.bind()?;
        result::host::get_device_pointer(driver()?.api(), self.ptr.as_ptr().cast())
    }
}

impl<T: DeviceCopy> Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised elements, owned by self, not mutated while &self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: DeviceCopy> DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and &mut self makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: DeviceCopy> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        PINNED.fetch_sub((self.len * std::mem::size_of::<T>()) as u64, Ordering::Relaxed);
        if let Some((base, map_len)) = self.mapping {
            let ptr = self.ptr.as_ptr() as usize;
            crate::driver::callback::release_in(
                &self.ctx,
                (ptr, base, map_len),
                |api, (ptr, base, map_len)| {
                    // SAFETY: registered by `map_and_register`; nothing uses the buffer any more (as
                    // below). The mapping is the buffer's own, referenced by nothing once it drops.
                    crate::error::record_drop(unsafe { result::host::unregister(api, ptr as *mut _) });
                    // SAFETY: as above.
                    unsafe { libc::munmap(base as *mut libc::c_void, map_len) };
                },
            );
            return;
        }
        crate::driver::callback::release_in(&self.ctx, self.ptr, |api, ptr| {
            // SAFETY: allocated by cuMemHostAlloc; asynchronous copies borrow the buffer only
            // inside a `scope`, which synchronises before the borrow ends, so nothing uses it any
            // more.
            crate::error::record_drop(unsafe { result::host::free(api, ptr.as_ptr().cast()) });
        });
    }
}

impl<T: DeviceCopy + std::fmt::Debug> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer").field("len", &self.len).field("flags", &self.flags).finish()
    }
}

/// Flags of [`Registered::with`] (`cuMemHostRegister`). The default is none of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegisterFlags {
    /// Pinned for every context.
    pub portable: bool,
    /// Mapped into the device's address space.
    pub device_mapped: bool,
    /// The device will only read it (needs device support).
    pub read_only: bool,
}

impl RegisterFlags {
    /// Flags from raw `CU_MEMHOSTREGISTER_*` bits; bits this crate does not handle are an error.
    pub fn from_bits(bits: u32) -> Result<RegisterFlags> {
        let known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY;
        if bits & !known != 0 {
            return Err(Error::invalid(format!("unknown host-register flag bits {:#x}", bits & !known)));
        }
        Ok(RegisterFlags {
            portable: bits & CU_MEMHOSTREGISTER_PORTABLE != 0,
            device_mapped: bits & CU_MEMHOSTREGISTER_DEVICEMAP != 0,
            read_only: bits & CU_MEMHOSTREGISTER_READ_ONLY != 0,
        })
    }

    fn raw(self) -> u32 {
        (self.portable as u32 * CU_MEMHOSTREGISTER_PORTABLE)
            | (self.device_mapped as u32 * CU_MEMHOSTREGISTER_DEVICEMAP)
            | (self.read_only as u32 * CU_MEMHOSTREGISTER_READ_ONLY)
    }
}

/// Memory the caller owns, page-locked while a closure runs (`cuMemHostRegister`).
///
/// The way to speed up code whose allocations cannot change. Registration is
/// reachable only through [`Registered::with`], which registers the slice, hands the closure a
/// `&mut Registered` (usable as `[T]`, for copies in a [`scope`](crate::scope()) for example) and
/// unregisters before it returns, also when the closure panics.
///
/// # Why a closure and not a guard
///
/// The CUDA documentation requires registered memory to be unregistered (`cuMemHostUnregister`)
/// before it is freed: until then the driver keeps the pages locked and mapped for the device
/// and treats their addresses as registered. A guard that unregisters in `Drop` can be passed to
/// `std::mem::forget` in safe code; the borrow of the slice then ends while the registration
/// lives on, and the memory can be freed and its addresses reused under a registration the driver
/// still holds. Inside `with` the closure sees only a `&mut Registered`, which it can neither
/// move nor forget, and the unregistration belongs to `with` itself:
///
/// ```compile_fail,E0507
/// # fn f(ctx: &cuvmm::Context) -> cuvmm::Result<()> {
/// use cuvmm::host::{RegisterFlags, Registered};
/// let mut legacy = vec![0u8; 1 << 20];
/// Registered::with(ctx, &mut legacy, RegisterFlags::default(), |reg| {
///     std::mem::forget(*reg); // error: cannot move out of `*reg`
/// })?;
/// # Ok(()) }
/// ```
///
/// The slice stays borrowed mutably for the whole call, so the memory can be neither freed,
/// reallocated nor touched except through the handle while it is registered:
///
/// ```compile_fail,E0499
/// # fn f(ctx: &cuvmm::Context) -> cuvmm::Result<()> {
/// use cuvmm::host::{RegisterFlags, Registered};
/// let mut legacy = vec![0u8; 1 << 20];
/// Registered::with(ctx, &mut legacy, RegisterFlags::default(), |reg| {
///     legacy.clear(); // error: `legacy` is borrowed by the registration
///     reg.len()
/// })?;
/// # Ok(()) }
/// ```
///
/// ```no_run
/// # fn main() -> cuvmm::Result<()> {
/// use cuvmm::host::{RegisterFlags, Registered};
/// use cuvmm::{scope, Context, DeviceBuffer, Stream};
/// let ctx = Context::for_ordinal(0)?;
/// let stream = Stream::non_blocking(&ctx)?;
/// let mut legacy = vec![1u32; 1 << 20];
/// let mut dev = DeviceBuffer::<u32>::new(&ctx, legacy.len())?;
/// Registered::with(&ctx, &mut legacy, RegisterFlags::default(), |reg| {
///     scope(|s| s.copy_to_device(&stream, reg, dev.as_mut_slice()))
/// })??;
/// # Ok(()) }
/// ```
pub struct Registered<'a, T: DeviceCopy> {
    data: &'a mut [T],
    flags: RegisterFlags,
}

/// Unregisters what [`Registered::with`] registered, on return and on unwind. It keeps its own
/// pointer: whatever the closure does with its `&mut Registered` (swapping it with another one,
/// say), this undoes exactly the registration `with` made.
struct Unregister {
    ctx: Context,
    ptr: *mut std::ffi::c_void,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        if let Ok(d) = driver() {
            let _ = self.ctx.bind();
            // SAFETY: `ptr` was registered by `with`, whose borrow of the memory outlives this
            // guard; asynchronous copies borrow the memory only inside a `scope`, which has
            // synchronised before the closure could return.
            crate::error::record_drop(unsafe { result::host::unregister(d.api(), self.ptr) });
        }
    }
}

impl<'a, T: DeviceCopy> Registered<'a, T> {
    /// Page-locks `data`, runs `f` with it and unregisters it before returning (also when `f`
    /// panics); returns what `f` returned. Empty slices, flags the device does not support and
    /// memory that is already registered are errors, and `f` does not run then.
    pub fn with<R>(
        ctx: &Context,
        data: &'a mut [T],
        flags: RegisterFlags,
        f: impl FnOnce(&mut Registered<'a, T>) -> R,
    ) -> Result<R> {
        if std::mem::size_of_val(data) == 0 {
            return Err(Error::invalid("cannot register an empty slice"));
        }
        if flags.read_only && !ctx.device().flag(CUdevice_attribute::READ_ONLY_HOST_REGISTER_SUPPORTED)? {
            return Err(Error::unsupported("read-only host registration", "the device does not support it"));
        }
        ctx.bind()?;
        let ptr = data.as_mut_ptr().cast::<std::ffi::c_void>();
        // SAFETY: the slice is live and borrowed mutably for 'a, which outlives this call; the
        // guard below unregisters it before this call returns or unwinds.
        let r =
            unsafe { result::host::register(driver()?.api(), ptr, std::mem::size_of_val(data), flags.raw()) };
        match r {
            Ok(()) => {}
            Err(e) if e.is_code(CUresult::ERROR_HOST_MEMORY_ALREADY_REGISTERED) => {
                return Err(Error::refused(
                    Refusal::AlreadyRegistered,
                    format_args!("the memory is already registered ({e})"),
                ))
            }
            Err(e) => return Err(e),
        }
        let _unregister = Unregister { ctx: ctx.clone(), ptr };
        let mut reg = Registered { data, flags };
        Ok(f(&mut reg))
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> RegisterFlags {
        self.flags
    }
}

impl<T: DeviceCopy> Deref for Registered<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T: DeviceCopy> DerefMut for Registered<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.data
    }
}

impl<T: DeviceCopy + std::fmt::Debug> std::fmt::Debug for Registered<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered").field("len", &self.data.len()).field("flags", &self.flags).finish()
    }
}
