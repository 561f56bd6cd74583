//! The allocator's [`Backend`] on the driver: pages are `cuMemCreate` allocations of one
//! granule-multiple each, mapped and unmapped one by one inside reservations this backend owns.

use super::backup::{self, BackupKind, BackupOptions, Copier, Mover, Staged};
use super::core::Backend;
use super::ids::{Handle, StreamId, LEGACY, SYNTHETIC};
use super::lazy::LazyBackups;
use super::Tag;
use crate::context::Context;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use crate::host::{KernelLane, PinnedBuffer, Staging};
use crate::kernels::Kernels;
use crate::memory::{DeviceSlice, DeviceSliceMut};
use crate::stream::{Event, Stream};
use crate::vmm::{placements, HandleTypes, PhysicalBuilder, PhysicalMemory, Reservation};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

pub(crate) struct DriverBackend {
    ctx: Context,
    page: usize,
    builder: PhysicalBuilder,
    /// For pages of at least `fabric_above` bytes (0: none): exportable as fabric handles too,
    /// until the driver refuses one (no IMEX channel), after which `builder` makes them.
    fabric: Option<PhysicalBuilder>,
    fabric_above: usize,
    reservations: Vec<Reservation>,
    /// Whether each page is exported as it is made (see `StreamAllocator::export_pages_ahead`).
    exports_ahead: Arc<AtomicBool>,
    /// The device's UUID, for the placements of its pages (none if the driver did not say).
    uuid: Option<[u8; 16]>,
    /// Two streams for sleep's and wake's copies, made at first use.
    lanes: Vec<Stream>,
    /// The thread that runs staged backups' copies through the staging ring, made at first use.
    mover: Option<Mover>,
    /// The mover being made on a thread of its own ([`Backend::host_prepare`]), for the first
    /// sleep to take.
    making: Option<JoinHandle<Result<Mover>>>,
    /// Pageable backups released lazily at their wakes, for later sleeps.
    lazy: LazyBackups,
    /// Marks of copies (see `Backend::mark_copies`) not waited for yet: each with an event per
    /// lane recorded after the copies it marks.
    marks: Vec<(u64, Vec<Event>)>,
    next_mark: u64,
}

/// A sleeping tag's backup on the driver.
pub(crate) enum HostBackup {
    /// Pinned host memory, copied to and from on the two lanes.
    Pinned { buf: PinnedBuffer<u8>, options: BackupOptions },
    /// Pageable host memory or a file, through the staging ring.
    Staged(Staged),
}

impl HostBackup {
    fn options(&self) -> &BackupOptions {
        match self {
            HostBackup::Pinned { options, .. } => options,
            HostBackup::Staged(s) => &s.options,
        }
    }

    fn len(&self) -> u64 {
        match self {
            HostBackup::Pinned { buf, .. } => buf.len() as u64,
            HostBackup::Staged(s) => s.store.len(),
        }
    }
}

/// The staging ring and a stream of its own, for the mover's thread.
struct StagedCopier {
    staging: Staging,
    stream: Stream,
    /// The kernel lane's kernels, loading on a thread of their own (the first sleep need not wait
    /// for the driver to compile them); the ring takes them on once they are there.
    loading: Option<Receiver<Result<(Kernels, KernelLane)>>>,
}

impl StagedCopier {
    /// Gives the ring its kernel lane if the kernels have loaded; without them (a load that
    /// failed) the ring keeps to the copy engines.
    fn take_lane(&mut self) -> Result<()> {
        let Some(rx) = &self.loading else { return Ok(()) };
        match rx.try_recv() {
            Err(TryRecvError::Empty) => Ok(()),
            Ok(Ok(lane)) => {
                self.loading = None;
                self.staging.set_kernel_lane(Some(lane))
            }
            Ok(Err(_)) | Err(TryRecvError::Disconnected) => {
                self.loading = None;
                Ok(())
            }
        }
    }
}

impl Copier for StagedCopier {
    fn to_host(&mut self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: `src` is a mapped range of a tag's pages, which stay mapped until the copy has
        // returned (the allocator waits for the mover before unmapping).
        let from = unsafe { DeviceSlice::<u8>::from_raw_parts(src, dst.len()) };
        self.staging.set_host_copy(backup::backup_host_copy());
        self.staging.to_host(&self.stream, from, dst)
    }

    fn to_device(&mut self, src: &[u8], dst: u64) -> Result<()> {
        // SAFETY: as in `to_host`; nothing else writes the range during a wake.
        let to = unsafe { DeviceSliceMut::<u8>::from_raw_parts(dst, src.len()) };
        self.take_lane()?;
        self.staging.set_host_copy(backup::backup_host_copy());
        self.staging.to_device(&self.stream, src, to)
    }
}

impl DriverBackend {
    pub(crate) fn new(
        ctx: &Context,
        page: usize,
        fabric_above: usize,
        exports_ahead: Arc<AtomicBool>,
    ) -> DriverBackend {
        // Pages are made exportable as POSIX descriptors wherever the device allows it, so that any
        // live block can be shared with another process after the fact (`StreamAllocator::export`).
        let mut builder = PhysicalMemory::builder(ctx);
        if ctx.device().flag(CUdevice_attribute::HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED).unwrap_or(false)
        {
            builder = builder.handle_types(HandleTypes::POSIX_FD);
        }
        let fabric = (fabric_above != 0
            && ctx.device().flag(CUdevice_attribute::HANDLE_TYPE_FABRIC_SUPPORTED).unwrap_or(false))
        .then(|| builder.clone().handle_types(builder.get_handle_types() | HandleTypes::FABRIC));
        DriverBackend {
            ctx: ctx.clone(),
            page,
            lanes: Vec::new(),
            builder,
            fabric,
            fabric_above,
            reservations: Vec::new(),
            exports_ahead,
            uuid: ctx.device().uuid().ok().map(|u| u.0),
            mover: None,
            making: None,
            lazy: LazyBackups::default(),
            marks: Vec::new(),
            next_mark: 0,
        }
    }

    fn stream(s: Handle) -> CUstream {
        s.0 as usize as CUstream
    }

    /// Unmaps each (address, size) page after waiting for all queued work of the context
    /// (teardown only).
    pub(crate) fn unmap_all(&mut self, pages: impl Iterator<Item = (u64, u64)>) {
        let _ = self.ctx.synchronize();
        for (a, n) in pages {
            let _ = self.unmap(a, n);
        }
    }

    fn create(&mut self, size: u64) -> Result<PhysicalMemory> {
        if let Some(fabric) = self.fabric.as_ref().filter(|_| size as usize >= self.fabric_above) {
            match fabric.create(size as usize) {
                Ok(p) => return Ok(p),
                Err(e) if e.is_out_of_memory() => return Err(e),
                // No IMEX channel (or another refusal of the handle type): POSIX descriptors only.
                Err(_) => self.fabric = None,
            }
        }
        self.builder.create(size as usize)
    }

    fn mover(&mut self) -> Result<&Mover> {
        if self.mover.is_none() {
            // One being made is waited for; should it have failed, it is made again here, so
            // that the error the sleep reports is its own.
            let made = self.making.take().and_then(|t| t.join().ok()).and_then(Result::ok);
            self.mover = Some(match made {
                Some(m) => m,
                None => make_mover(&self.ctx)?,
            });
        }
        Ok(self.mover.as_ref().expect("made above"))
    }

    /// Starts making the mover on a thread of its own, unless it is there or on its way: its
    /// ring's pinned slots cost a first sleep tens of milliseconds (pinning runs at a few GB/s).
    fn make_mover_ahead(&mut self) {
        if self.mover.is_some() || self.making.is_some() {
            return;
        }
        let ctx = self.ctx.clone();
        // Without a thread the first sleep makes it, as before.
        self.making =
            std::thread::Builder::new().name("cuvmm-backup-ring".into()).spawn(move || make_mover(&ctx)).ok();
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
        let page = self.create(size)?;
        if self.exports_ahead.load(Ordering::Relaxed)
            && self.builder.get_handle_types().contains(HandleTypes::POSIX_FD)
        {
            // Kept with the page for the hand-offs to come. A refusal here is met again, and
            // reported, by the export a hand-off asks for; the page itself is good.
            drop(page.export_fd_kept());
        }
        Ok(page)
    }

    fn map(&mut self, addr: u64, page: &PhysicalMemory, size: u64) -> Result<()> {
        if page.size() as u64 != size {
            return Err(Error::invalid("page of the wrong size"));
        }
        self.ctx.bind()?;
        // SAFETY: `addr` is an aligned page of a reservation this backend owns, unmapped (the
        // allocator's page table says so); the handle is live and `size` bytes long.
        unsafe { result::mem::map(driver()?.api(), addr, size as usize, 0, page.handle())? };
        if let Some(uuid) = self.uuid.filter(|_| placements::wanted()) {
            placements::placed(uuid, page, addr);
        }
        Ok(())
    }

    fn unmap(&mut self, addr: u64, size: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the page was mapped by `map` with this size and no queued work uses it (the
        // allocator unmaps only pages of blocks whose last use has completed, or after a
        // synchronisation).
        unsafe { result::mem::unmap(driver()?.api(), addr, size as usize)? };
        if let Some(uuid) = self.uuid.filter(|_| placements::wanted()) {
            placements::unplaced(uuid, addr, size as usize);
        }
        Ok(())
    }

    fn set_access(&mut self, addr: u64, len: u64) -> Result<()> {
        let desc = CUmemAccessDesc {
            location: crate::vmm::Location::Device(self.ctx.device()).raw(),
            flags: CUmemAccess_flags::PROT_READWRITE,
        };
        self.ctx.bind()?;
        // SAFETY: the range is mapped (the pages were just mapped) and `desc` outlives the call.
        unsafe { result::mem::set_access(driver()?.api(), addr, len as usize, &[desc]) }
    }

    fn new_event(&mut self) -> Result<Event> {
        Event::without_timing(&self.ctx)
    }

    fn record(&mut self, event: &Event, stream: Handle) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is live; the stream is the one the call under way passes, which its
        // caller keeps alive for the call.
        unsafe { result::event::record(driver()?.api(), event.raw(), Self::stream(stream)) }
    }

    fn query(&mut self, event: &Event) -> Result<bool> {
        event.is_complete()
    }

    fn stream_idle(&mut self, stream: Handle) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the stream is the one the call under way passes, alive for the call; it is not
        // being captured (the caller asked).
        unsafe { result::stream::query(driver()?.api(), Self::stream(stream)) }
    }

    fn capture_of(&mut self, stream: Handle) -> Result<Option<u64>> {
        capture_of(Self::stream(stream))
    }

    fn stream_id(&mut self, stream: Handle) -> Option<StreamId> {
        stream_id(Self::stream(stream))
    }

    fn relax(&mut self) -> Result<u32> {
        match result::stream::exchange_capture_mode(driver()?.api(), CU_STREAM_CAPTURE_MODE_RELAXED) {
            Ok(mode) => Ok(mode as u32),
            // Drivers before 10.1 have no capture modes: nothing to relax.
            Err(Error::Unsupported { .. }) => Ok(CU_STREAM_CAPTURE_MODE_RELAXED as u32),
            Err(e) => Err(e),
        }
    }

    fn restore(&mut self, mode: u32) {
        // Restoring the mode `relax` returned.
        if let Ok(d) = driver() {
            let _ = result::stream::exchange_capture_mode(d.api(), mode as i32);
        }
    }

    type Host = HostBackup;

    fn host_alloc(&mut self, tag: Tag, bytes: u64, old: Option<HostBackup>) -> Result<HostBackup> {
        let options = backup::options_of(tag);
        match old {
            Some(h) if h.options() == &options && h.len() >= bytes => return Ok(h),
            Some(h) => self.host_release(h),
            None => {}
        }
        if options.kind == BackupKind::Pinned {
            let buf = PinnedBuffer::new(
                &self.ctx,
                usize::try_from(bytes).map_err(|_| Error::invalid("backup too large"))?,
            )?;
            return Ok(HostBackup::Pinned { buf, options });
        }
        self.mover()?;
        if let Some(s) = self.lazy.take(bytes, &options) {
            return Ok(HostBackup::Staged(s));
        }
        Ok(HostBackup::Staged(Staged::new(bytes, options)?))
    }

    fn host_retained(host: &HostBackup) -> bool {
        host.options().retain
    }

    fn host_prepare(&mut self, tag: Tag, bytes: u64) -> bool {
        let kind = backup::options_of(tag).kind;
        // Pageable memory and files go through the ring; a pinned backup does not.
        if kind != BackupKind::Pinned {
            self.make_mover_ahead();
        }
        // Only pageable memory faults in at first use; a pinned backup or a file is made at the
        // sleep as before.
        kind == BackupKind::Pageable && self.lazy.prepare(bytes)
    }

    fn host_prepared(&self) -> bool {
        self.lazy.settled() && self.making.as_ref().map_or(true, JoinHandle::is_finished)
    }

    fn host_release(&mut self, host: HostBackup) {
        // Pageable memory is kept, released lazily, for the next sleep to write into.
        let host = match host {
            HostBackup::Staged(s) => match self.lazy.keep(s) {
                Some(rest) => HostBackup::Staged(rest),
                None => return,
            },
            pinned => pinned,
        };
        // Unmapping, unpinning or unlinking gigabytes takes milliseconds the caller need not wait
        // for: done on a thread of its own where one can be started.
        // Should no thread start, the closure and the backup are dropped here.
        let _ = std::thread::Builder::new().name("cuvmm-backup-release".into()).spawn(move || drop(host));
    }

    fn copy_out(
        &mut self,
        host: &mut HostBackup,
        offset: u64,
        src: u64,
        len: u64,
        lane: usize,
    ) -> Result<()> {
        let buf = match host {
            HostBackup::Staged(s) => return self.mover()?.queue(true, src, &s.store, offset, len),
            HostBackup::Pinned { buf, .. } => buf,
        };
        check_host(buf, offset, len)?;
        let dst = buf.base_ptr().wrapping_add(offset as usize).cast();
        let stream = self.lane(lane)?.raw();
        self.ctx.bind()?;
        // SAFETY: the host range lies inside the pinned buffer (checked), which outlives the copy
        // (`finish_copies` runs before the allocator lets go of it) and nothing reads it
        // meanwhile; the device range is mapped.
        unsafe { result::mem::memcpy_dtoh_async(driver()?.api(), dst, src, len as usize, stream) }
    }

    fn copy_in(&mut self, dst: u64, host: &HostBackup, offset: u64, len: u64, lane: usize) -> Result<()> {
        let buf = match host {
            HostBackup::Staged(s) => return self.mover()?.queue(false, dst, &s.store, offset, len),
            HostBackup::Pinned { buf, .. } => buf,
        };
        check_host(buf, offset, len)?;
        let src = buf.base_ptr().wrapping_add(offset as usize).cast_const().cast();
        let stream = self.lane(lane)?.raw();
        self.ctx.bind()?;
        // SAFETY: as in `copy_out`, the other way; nothing writes the buffer meanwhile.
        unsafe { result::mem::memcpy_htod_async(driver()?.api(), dst, src, len as usize, stream) }
    }

    fn mark_copies(&mut self) -> Result<u64> {
        let mark = self.next_mark;
        self.next_mark += 1;
        let mut events = Vec::with_capacity(self.lanes.len());
        for s in &self.lanes {
            let e = Event::without_timing(&self.ctx)?;
            e.record(s)?;
            events.push(e);
        }
        if let Some(m) = &self.mover {
            m.mark(mark)?;
        }
        self.marks.push((mark, events));
        Ok(mark)
    }

    fn wait_copies(&mut self, mark: u64) -> Result<bool> {
        let upto = self.marks.iter().take_while(|(m, _)| *m <= mark).count();
        for (_, events) in self.marks.drain(..upto) {
            for e in events {
                e.synchronize()?;
            }
        }
        match &self.mover {
            Some(m) => m.reached(mark),
            None => Ok(true),
        }
    }

    fn finish_copies(&mut self) -> Result<()> {
        // Every mark is over once the copies are.
        self.marks.clear();
        // Both kinds are waited for, whatever failed first: nothing may still be copying when
        // the allocator unmaps or lets go of a backup.
        let mut r = Ok(());
        for s in &self.lanes {
            r = r.and(s.synchronize());
        }
        if let Some(m) = &self.mover {
            r = r.and(m.finish());
        }
        r
    }

    fn synchronize(&mut self) -> Result<()> {
        self.ctx.synchronize()
    }
}

/// The staging ring of `ctx`'s staged backups (pinned slots, copying threads, a stream), its
/// kernel lane loading on a thread of its own, and the thread that runs copies through it.
fn make_mover(ctx: &Context) -> Result<Mover> {
    let mut staging = Staging::with_config(ctx, backup::ring_config())?;
    staging.set_to_host_threads(backup::to_host_threads());
    let loading = backup::kernel_lane().and_then(|config| {
        let (tx, rx) = channel();
        let ctx = ctx.clone();
        let load = move || drop(tx.send(Kernels::load(&ctx).map(|k| (k, config))));
        std::thread::Builder::new().name("cuvmm-kernels".into()).spawn(load).ok().map(|_| rx)
    });
    let copier = StagedCopier { staging, stream: Stream::non_blocking(ctx)?, loading };
    Mover::new(copier)
}

fn check_host(host: &PinnedBuffer<u8>, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= host.len() as u64 => Ok(()),
        _ => Err(Error::invalid("copy past the end of the host backup")),
    }
}

/// The identity of `stream`, a live stream handle: the driver's stream id, unique for the life of
/// the process (handles are not: a destroyed stream's handle may be handed to a new stream).
/// `None` when the driver cannot say (before CUDA 12.0, and perhaps during a capture): the
/// allocator then makes one up.
pub(crate) fn stream_id(stream: CUstream) -> Option<StreamId> {
    if stream.is_null() || stream as usize == CU_STREAM_LEGACY {
        return Some(LEGACY);
    }
    // SAFETY: the caller passes a live stream.
    match unsafe { result::stream::get_id(driver().ok()?.api(), stream) } {
        Ok(id) if StreamId(id) < SYNTHETIC => Some(StreamId(id)),
        _ => None,
    }
}

/// The capture under way on `stream` (its id), if any. The legacy default stream is never
/// captured; the per-thread default stream is refused by the callers.
pub(crate) fn capture_of(stream: CUstream) -> Result<Option<u64>> {
    if stream.is_null() || stream as usize == CU_STREAM_LEGACY {
        return Ok(None);
    }
    let api = driver()?.api();
    // Asked on every allocation: the plain question first (the cheaper call), the capture's id
    // only when it is yes.
    // SAFETY: `stream` is the live stream of the call under way.
    match unsafe { result::stream::is_capturing(api, stream) } {
        Ok(status) if status == CU_STREAM_CAPTURE_STATUS_NONE => return Ok(None),
        Ok(_) | Err(Error::Unsupported { .. }) => {}
        Err(e) => return Err(e),
    }
    // SAFETY: as above.
    match unsafe { result::stream::capture_info(api, stream) } {
        Ok((status, id))
            if status == CU_STREAM_CAPTURE_STATUS_ACTIVE
                || status == CU_STREAM_CAPTURE_STATUS_INVALIDATED =>
        {
            Ok(Some(id))
        }
        Ok(_) | Err(Error::Unsupported { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}
