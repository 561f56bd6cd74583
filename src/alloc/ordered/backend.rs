//! The allocator's [`Backend`] on the driver: pages are `cuMemCreate` allocations of one
//! granule-multiple each, mapped and unmapped one by one inside reservations this backend owns.

use super::core::Backend;
use crate::context::Context;
use crate::driver::{driver, sys::*};
use crate::error::{Error, Result};
use crate::host::PinnedBuffer;
use crate::stream::{Event, Stream, StreamInner};
use crate::vmm::{HandleTypes, PhysicalBuilder, PhysicalMemory, Reservation};
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) struct DriverBackend {
    ctx: Context,
    page: usize,
    builder: PhysicalBuilder,
    reservations: Vec<Reservation>,
    /// Two streams for sleep's and wake's copies, made at first use.
    lanes: Vec<Stream>,
    /// Streams of the safe API kept alive while the allocator may still record events on them.
    kept: HashMap<u64, Arc<StreamInner>>,
}

impl DriverBackend {
    pub(crate) fn new(ctx: &Context, page: usize) -> DriverBackend {
        // Pages are made exportable as POSIX descriptors wherever the device allows it, so that any
        // live block can be shared with another process after the fact (`StreamAllocator::export`).
        let mut builder = PhysicalMemory::builder(ctx);
        if ctx.device().flag(CUdevice_attribute::HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED).unwrap_or(false)
        {
            builder = builder.handle_types(HandleTypes::POSIX_FD);
        }
        DriverBackend {
            ctx: ctx.clone(),
            page,
            lanes: Vec::new(),
            builder,
            reservations: Vec::new(),
            kept: HashMap::new(),
        }
    }

    /// Keeps `stream` alive until the allocator forgets it.
    pub(crate) fn keep(&mut self, stream: &Stream) {
        self.kept.entry(stream.raw() as u64).or_insert_with(|| stream.inner().clone());
    }

    fn stream(s: u64) -> CUstream {
        s as usize as CUstream
    }

    /// Unmaps each (address, size) page after waiting for all queued work of the context
    /// (teardown only).
    pub(crate) fn unmap_all(&mut self, pages: impl Iterator<Item = (u64, u64)>) {
        let _ = self.ctx.synchronize();
        for (a, n) in pages {
            let _ = self.unmap(a, n);
        }
    }

    fn lane(&mut self, i: usize) -> Result<&Stream> {
        while self.lanes.len() <= i {
            self.lanes.push(Stream::non_blocking(&self.ctx)?);
        }
        Ok(&self.lanes[i])
    }
}

impl Backend for DriverBackend {
    type Page = PhysicalMemory;
    type Event = Event;

    fn reserve(&mut self, size: u64) -> Result<u64> {
        let r = Reservation::with_options(&self.ctx, size as usize, self.page, None)?;
        let base = r.base();
        self.reservations.push(r);
        Ok(base)
    }

    fn create_page(&mut self, size: u64) -> Result<PhysicalMemory> {
        self.builder.create(size as usize)
    }

    fn map(&mut self, addr: u64, page: &PhysicalMemory, size: u64) -> Result<()> {
        if page.size() as u64 != size {
            return Err(Error::invalid("page of the wrong size"));
        }
        self.ctx.bind()?;
        // SAFETY: `addr` is an aligned page of a reservation this backend owns, unmapped (the
        // allocator's page table says so); the handle is live and `size` bytes long.
        unsafe { driver()?.api().cuMemMap(addr, size as usize, 0, page.handle(), 0) }
    }

    fn unmap(&mut self, addr: u64, size: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the page was mapped by `map` with this size and no queued work uses it (the
        // allocator unmaps only pages of blocks whose last use has completed, or after a
        // synchronisation).
        unsafe { driver()?.api().cuMemUnmap(addr, size as usize) }
    }

    fn set_access(&mut self, addr: u64, len: u64) -> Result<()> {
        let desc = CUmemAccessDesc {
            location: crate::vmm::Location::Device(self.ctx.device()).raw(),
            flags: CUmemAccess_flags::PROT_READWRITE,
        };
        self.ctx.bind()?;
        // SAFETY: the range is mapped (the pages were just mapped) and `desc` outlives the call.
        unsafe { driver()?.api().cuMemSetAccess(addr, len as usize, &desc, 1) }
    }

    fn new_event(&mut self) -> Result<Event> {
        Event::without_timing(&self.ctx)
    }

    fn record(&mut self, event: &Event, stream: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is live; the stream is one the caller handed to the allocator and
        // promised alive (C ABI) or that `kept` keeps alive (safe API).
        unsafe { driver()?.api().cuEventRecord(event.raw(), Self::stream(stream)) }
    }

    fn query(&mut self, event: &Event) -> Result<bool> {
        event.is_complete()
    }

    fn stream_idle(&mut self, stream: u64) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the stream is one the caller handed to the allocator and promised alive (C ABI)
        // or that `kept` keeps alive (safe API); it is not being captured (the caller asked).
        match unsafe { driver()?.api().cuStreamQuery(Self::stream(stream)) } {
            Ok(()) => Ok(true),
            Err(e) if e.is_code(CUresult::ERROR_NOT_READY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn wait(&mut self, event: &Event) -> Result<()> {
        event.synchronize()
    }

    fn capture_of(&mut self, stream: u64) -> Result<Option<u64>> {
        capture_of(Self::stream(stream))
    }

    fn relax(&mut self) -> Result<u32> {
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: the out/in pointer is a valid local.
        match unsafe { driver()?.api().cuThreadExchangeStreamCaptureMode(&mut mode) } {
            Ok(()) => Ok(mode as u32),
            // Drivers before 10.1 have no capture modes: nothing to relax.
            Err(Error::Unsupported { .. }) => Ok(CU_STREAM_CAPTURE_MODE_RELAXED as u32),
            Err(e) => Err(e),
        }
    }

    fn restore(&mut self, mode: u32) {
        let mut mode = mode as i32;
        if let Ok(d) = driver() {
            // SAFETY: as in `relax`; restoring the mode `relax` returned.
            let _ = unsafe { d.api().cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }

    fn forget(&mut self, stream: u64) {
        self.kept.remove(&stream);
    }

    type Host = PinnedBuffer<u8>;

    fn host_alloc(&mut self, bytes: u64) -> Result<PinnedBuffer<u8>> {
        PinnedBuffer::new(&self.ctx, bytes as usize)
    }

    fn host_len(host: &PinnedBuffer<u8>) -> u64 {
        host.len() as u64
    }

    fn copy_out(
        &mut self,
        host: &mut PinnedBuffer<u8>,
        offset: u64,
        src: u64,
        len: u64,
        lane: usize,
    ) -> Result<()> {
        check_host(host, offset, len)?;
        let dst = host.base_ptr().wrapping_add(offset as usize).cast();
        let stream = self.lane(lane)?.raw();
        self.ctx.bind()?;
        // SAFETY: the host range lies inside the pinned buffer (checked), which outlives the copy
        // (`finish_copies` runs before the allocator lets go of it) and nothing reads it
        // meanwhile; the device range is mapped.
        unsafe { driver()?.api().cuMemcpyDtoHAsync(dst, src, len as usize, stream) }
    }

    fn copy_in(
        &mut self,
        dst: u64,
        host: &PinnedBuffer<u8>,
        offset: u64,
        len: u64,
        lane: usize,
    ) -> Result<()> {
        check_host(host, offset, len)?;
        let src = host.base_ptr().wrapping_add(offset as usize).cast_const().cast();
        let stream = self.lane(lane)?.raw();
        self.ctx.bind()?;
        // SAFETY: as in `copy_out`, the other way; nothing writes the buffer meanwhile.
        unsafe { driver()?.api().cuMemcpyHtoDAsync(dst, src, len as usize, stream) }
    }

    fn finish_copies(&mut self) -> Result<()> {
        for s in &self.lanes {
            s.synchronize()?;
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.ctx.synchronize()
    }
}

fn check_host(host: &PinnedBuffer<u8>, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= host.len() as u64 => Ok(()),
        _ => Err(Error::invalid("copy past the end of the host backup")),
    }
}

/// The capture under way on `stream` (its id), if any. The legacy default stream is never
/// captured; the per-thread default stream is refused by the callers.
pub(crate) fn capture_of(stream: CUstream) -> Result<Option<u64>> {
    if stream.is_null() || stream as usize == CU_STREAM_LEGACY {
        return Ok(None);
    }
    let api = driver()?.api();
    // Asked on every allocation: the plain question first (19.3-21.6 ns a call on an H100 host,
    // against 21.5-23.5 for the one that also gives the capture's id), the id only when it is yes.
    let mut status = 0;
    // SAFETY: the out-pointer is a valid local.
    match unsafe { api.cuStreamIsCapturing(stream, &mut status) } {
        Ok(()) if status == CU_STREAM_CAPTURE_STATUS_NONE => return Ok(None),
        Ok(()) | Err(Error::Unsupported { .. }) => {}
        Err(e) => return Err(e),
    }
    let (mut status, mut id) = (0, 0u64);
    // SAFETY: the out-pointers are valid locals; the optional ones may be null.
    let r = unsafe {
        api.cuStreamGetCaptureInfo(
            stream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    match r {
        Ok(())
            if status == CU_STREAM_CAPTURE_STATUS_ACTIVE
                || status == CU_STREAM_CAPTURE_STATUS_INVALIDATED =>
        {
            Ok(Some(id))
        }
        Ok(()) => Ok(None),
        Err(Error::Unsupported { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}
