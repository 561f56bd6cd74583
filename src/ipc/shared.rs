//! Both ends of sharing one allocation: [`share`] exports and sends, [`SharedMemory::import`]
//! imports, reserves, maps and grants access.

use super::socket::{send_message, Incoming};
use super::wire::{Header, Message, WireHandle};
use crate::caps::device_granularity;
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Refusal, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::vmm::{Access, HandleTypes, Location, Mapping, PhysicalMemory, Reservation};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// Exports `phys` (as a fabric handle if it was created with one, else as a POSIX fd) and sends
/// it over `sock` with the range `[offset, offset + length)` and `tag`. Returns how it travelled.
pub fn share(
    sock: BorrowedFd<'_>,
    phys: &PhysicalMemory,
    offset: usize,
    length: usize,
    tag: u64,
) -> Result<WireHandle> {
    let Location::Device(dev) = phys.location() else {
        return Err(Error::unsupported(
            "sharing host-located memory",
            "only device memory is shared by this crate",
        ));
    };
    let granularity = device_granularity(&dev, phys.handle_types().raw())?.minimum;
    let header = |handle| {
        Header::new(
            handle,
            phys.size() as u64,
            granularity as u64,
            offset as u64,
            length as u64,
            dev.uuid()?.0,
            tag,
        )
    };
    // The range is checked (by building the header) before anything is exported.
    let posix = header(WireHandle::PosixFd)?;
    if phys.handle_types().contains(HandleTypes::FABRIC) {
        let fabric = header(WireHandle::Fabric(phys.export_fabric()?))?;
        send_message(sock, &Message::Share(fabric), None)?;
        Ok(fabric.handle())
    } else {
        let fd = phys.export_fd()?;
        send_message(sock, &Message::Share(posix), Some(fd.as_fd()))?;
        Ok(posix.handle())
    }
}

/// The minimum granularity of memory this process maps on `ctx`'s device.
pub(crate) fn local_granularity(ctx: &Context) -> Result<usize> {
    Ok(device_granularity(&ctx.device(), crate::driver::sys::CUmemAllocationHandleType::NONE)?.minimum)
}

/// Imports the `size`-byte allocation `handle` (and `fd`, for a POSIX-fd handle) names and maps
/// all of it at `offset` in `va`, which must be free there. Access is not granted yet.
pub(crate) fn import_and_map(
    va: &Reservation,
    offset: usize,
    handle: WireHandle,
    fd: Option<OwnedFd>,
    size: usize,
) -> Result<Mapping> {
    let ctx = va.context();
    let phys = match (handle, fd) {
        (WireHandle::PosixFd, Some(fd)) => PhysicalMemory::import_fd(ctx, fd.as_fd(), size)?,
        (WireHandle::Fabric(f), None) => PhysicalMemory::import_fabric(ctx, &f, size)?,
        _ => return Err(Error::Protocol("the message's fds do not match its handle type".into())),
    };
    // The driver refuses a mapping larger than the allocation (driver 580 says
    // CUDA_ERROR_NOT_SUPPORTED; INVALID_VALUE is accepted too): then the sender announced more
    // than it exported. Any other failure (out of memory, say) is passed on as it is.
    use crate::driver::sys::CUresult;
    va.map(offset, &phys, 0, size).map_err(|e| match e {
        Error::Driver { code, .. }
            if code == CUresult::ERROR_NOT_SUPPORTED || code == CUresult::ERROR_INVALID_VALUE =>
        {
            Error::refused(
                Refusal::BeyondTheExport,
                format_args!(
                    "cannot map {size} bytes of the imported allocation ({e}): is the announced size \
                 larger than what was exported?"
                ),
            )
        }
        other => other,
    })
}

/// A validated granularity (a power of two up to 1 GiB) as a reservation's alignment.
pub(crate) fn to_alignment(granularity: u64) -> Result<usize> {
    usize::try_from(granularity)
        .map_err(|_| Error::Protocol(format!("granularity {granularity} does not fit this machine")))
}

/// `bytes` at `byte_offset` of the `len`-byte range at `base`, as an address; refused past its end.
pub(crate) fn range_at(base: u64, len: usize, byte_offset: usize, bytes: usize) -> Result<u64> {
    match byte_offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(base + byte_offset as u64),
        _ => Err(Error::invalid(format!("{byte_offset}+{bytes} is past the {len}-byte shared range"))),
    }
}

/// Memory another process shared with this one, mapped here.
///
/// The other process may write it at any time, so this type never hands out Rust references to
/// its contents: only device pointers, device views and copies. The memory stays valid after the
/// exporter exits, for as long as this value lives.
///
/// # Aliasing
///
/// cuvmm never puts device memory behind a Rust reference: a [`DeviceSlice`] or
/// [`DeviceSliceMut`] is an address and a length, and the `T: DeviceCopy` bound makes every bit
/// pattern a valid `T`, so no write, however timed, can make a value invalid. Two writable views of
/// the same bytes in one process are therefore not undefined behaviour in Rust's sense. That
/// happens when a process imports what it exported itself: the exporter's own
/// `PeerAllocation::as_mut_slice` and this type's [`as_mut_slice`](Self::as_mut_slice) then name
/// the same memory, and `&mut self` on each makes only that view unique, not the memory. Device
/// writes through both race like any two writers to one buffer (order them with streams and
/// events, or the result is unspecified), and the other process may write at any time, as another
/// process may change a file under a memory map. (`memmap2` makes creating a map `unsafe` for
/// that reason, because it then hands out `&[u8]`; this type hands out no reference, so it needs
/// no such contract.) Host reads through [`copy_to_host`](Self::copy_to_host) copy whatever bytes
/// are there at the time.
pub struct SharedMemory {
    mapping: Mapping,
    header: Header,
    /// Streams of this process that used the range (see [`crate::stream::order`]).
    order: crate::stream::order::Tracker,
}

impl SharedMemory {
    /// Imports what `msg` carries into `ctx`, maps all of it (in a reservation aligned to the
    /// message's granularity) and grants `grants` (read-write for `ctx`'s device if empty). The
    /// message's fd is closed once imported.
    ///
    /// Refuses a message that is not a share ([`Error::UnexpectedMessage`]; its fd is closed) and,
    /// with [`Error::Protocol`], one whose range does not lie inside what could be mapped, and one whose size is larger than
    /// the allocation that arrived.
    pub fn import(ctx: &Context, msg: Incoming, grants: &[(Device, Access)]) -> Result<SharedMemory> {
        let (m, fd, _peer) = msg.into_parts();
        let Message::Share(h) = m else {
            return Err(Error::UnexpectedMessage {
                got: m.kind(),
                expected: "a share message was expected (a growing vector is followed with GrowableImport)",
            });
        };
        // `recv_message` validated the header and no safe code can change it since; checked again so that
        // the bounds below never rest on one distant check alone.
        h.validate()?;
        let size = usize::try_from(h.size())
            .map_err(|_| Error::Protocol("size does not fit this machine".into()))?;
        let ours = local_granularity(ctx)?;
        if size % ours != 0 {
            return Err(Error::Protocol(format!(
                "size {size} is not a multiple of this device's granularity {ours}"
            )));
        }
        // Aligned to the allocation's granularity: the exporter's may be coarser than ours, and
        // the mapping must start on a multiple of it.
        let va = Reservation::with_options(ctx, size, to_alignment(h.granularity())?, None)?;
        let mapping = import_and_map(&va, 0, h.handle(), fd, size)?;
        // The driver reports no size for an imported handle, but the mapping above covers `size`
        // bytes of it and succeeds only if the allocation holds at least that many: so
        // `mapping.len()` bytes are really there. The shared range must lie inside them, or the
        // views and copies this value hands out would reach past the allocation.
        let mapped = mapping.len() as u64;
        match h.offset().checked_add(h.length()) {
            Some(end) if end <= mapped => {}
            _ => {
                return Err(Error::Protocol(format!(
                    "range {}+{} lies outside the {mapped} mapped bytes",
                    h.offset(),
                    h.length()
                )))
            }
        }
        let own = [(ctx.device(), Access::ReadWrite)];
        mapping.set_access(if grants.is_empty() { &own } else { grants })?;
        Ok(SharedMemory { mapping, header: h, order: crate::stream::order::Tracker::new() })
    }

    /// The header it arrived with.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Address of the shared range.
    pub fn ptr(&self) -> u64 {
        self.mapping.ptr() + self.header.offset()
    }

    /// Length of the shared range in bytes.
    pub fn len(&self) -> usize {
        self.header.length() as usize
    }

    /// Whether the range is empty (never: the wire format refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.header.length() == 0
    }

    /// The mapping (the whole imported allocation).
    pub fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// The range as `T`s, for kernels and copies.
    pub fn as_slice<T: DeviceCopy>(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the range is mapped and accessible while self lives; device views are never
        // dereferenced on the host.
        unsafe { DeviceSlice::tracked(self.ptr(), self.len() / std::mem::size_of::<T>().max(1), &self.order) }
    }

    /// The range as writable `T`s.
    pub fn as_mut_slice<T: DeviceCopy>(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as above.
        unsafe {
            DeviceSliceMut::tracked(self.ptr(), self.len() / std::mem::size_of::<T>().max(1), &self.order)
        }
    }

    /// Copies from byte `byte_offset` of the range into `out`.
    pub fn copy_to_host<T: DeviceCopy>(&self, byte_offset: usize, out: &mut [T]) -> Result<()> {
        let at = range_at(self.ptr(), self.len(), byte_offset, std::mem::size_of_val(out))?;
        host_read(self.mapping.reservation().context(), &self.order, at, out)
    }

    /// Copies `data` to byte `byte_offset` of the range.
    pub fn copy_from_host<T: DeviceCopy>(&self, byte_offset: usize, data: &[T]) -> Result<()> {
        let at = range_at(self.ptr(), self.len(), byte_offset, std::mem::size_of_val(data))?;
        host_write(self.mapping.reservation().context(), &self.order, at, data)
    }
}

/// Copies the bytes at device address `at` into `out`, after the streams `order` knows of that
/// write them.
pub(crate) fn host_read<T: DeviceCopy>(
    ctx: &Context,
    order: &crate::stream::order::Tracker,
    at: u64,
    out: &mut [T],
) -> Result<()> {
    let end = at + std::mem::size_of_val(out) as u64;
    let _turn = order.host_access(at, end, crate::stream::order::Use::Read)?;
    crate::stream::copy::dtoh(ctx, out, at, out.len())
}

/// Copies `data` to device address `at`, after the streams `order` knows of that use it.
pub(crate) fn host_write<T: DeviceCopy>(
    ctx: &Context,
    order: &crate::stream::order::Tracker,
    at: u64,
    data: &[T],
) -> Result<()> {
    let end = at + std::mem::size_of_val(data) as u64;
    let _turn = order.host_access(at, end, crate::stream::order::Use::Write)?;
    crate::stream::copy::htod(ctx, at, data, data.len())
}
