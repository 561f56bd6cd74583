//! Blocks of a [`StreamAllocator`] handed to other processes, as PyTorch's CUDA IPC hands over
//! tensors, without `pidfd_getfd` or privileges: the sender offers a block and gives the
//! [`Ticket`] to a receiver by any means (a pipe, a queue, a pickle); the receiver takes it and
//! maps the block's pages, zero copy.
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::alloc::StreamAllocator;
//! use cuvmm::ipc::handoff::{Receiver, Sender, Ticket};
//! use cuvmm::{Context, Stream};
//! use std::time::Duration;
//!
//! let ctx = Context::for_ordinal(0)?;
//! let (alloc, stream) = (StreamAllocator::new(&ctx)?, Stream::new(&ctx)?);
//! let block = alloc.allocate(256 << 20, &stream)?;
//! // Sender: the block stays allocated (whatever this process frees) until the receiver lets go.
//! let ticket = Sender::global()?.offer(&alloc, block.ptr(), None)?;
//! let bytes = ticket.to_bytes(); // travels to the receiver
//!
//! // Receiver:
//! let ticket = Ticket::from_bytes(&bytes)?;
//! let lease = Receiver::global()?.take(&ctx, &ticket, &[], Duration::from_secs(60))?;
//! // ... kernels on `stream` read and write lease.ptr() ...
//! lease.release_after(&stream)?; // the sender is told once that work is done
//! # Ok(()) }
//! ```
//!
//! What each side keeps and when memory goes back:
//!
//! * **The sender** answers on a thread of its own, over an abstract `SOCK_SEQPACKET` socket that
//!   only processes of its effective uid may use. A block offered stays out of every later
//!   allocation until its receiver lets go, or until the receiving process has exited (its pidfd
//!   says so, after the kernel closed its descriptors): a connection that merely ends lets go of
//!   nothing while its process may still run work on the memory.
//! * **The receiver** keeps one connection per sending process, read by the library's own thread.
//!   It keeps the mappings it made while their sender keeps the pages: the same block handed over
//!   again is claimed with one message and no descriptor. When the sender gives pages back to the
//!   device (an `empty_cache`, a sleep, an idle page released) it revokes them, and the receiver
//!   unmaps every mapping of them nobody uses, so the memory is back on the device at once.
//! * **A mirror.** A receiver's first take from a sender (on one device, no peers named) asks it to
//!   place its large pages: each page the sender maps from then on is told to the receiver, whose
//!   thread maps it at the same place in a mirror of the sender's address space. A later first
//!   hand-off of blocks on those pages maps nothing: the driver's calls were made when the sender
//!   mapped the pages, not while anyone waits for the tensors. The mirror's pages go as kept
//!   mappings do, once the sender unmaps or releases them and no lease uses them.
//! * **A release** is told only after the work that used the memory is done: the streams named
//!   at [`Lease::release_after`] (an event recorded on each, waited for on the library's release
//!   thread), or the whole device for a lease dropped without naming any. If that wait fails, the
//!   memory stays held and mapped for good rather than reused under running work.
//!
//! The messages are specified in `docs/WIRE.md` ("The hand-off").

mod frame;
mod link;
mod receiver;
mod sender;
mod ticket;

pub use frame::{Frame, Placement, Refusal, Token};
pub use receiver::{Lease, ReceiverStats, ALONG_FOR};
pub use sender::SenderStats;
pub use ticket::Ticket;

use crate::alloc::{BlockImport, DevicePtr, StreamAllocator};
use crate::context::Context;
use crate::device::Device;
use crate::driver::sys::CUstream;
use crate::error::{record_drop, Error, Result};
use crate::stream::{Event, Stream};
use crate::vmm::{Access, Mapping, PhysicalMemory, Reservation};
use receiver::{Mapped, Place, Placed, Settle};
use sender::Shared;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Fills `buf` with random bytes from the kernel.
fn random(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled part of `buf`.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n < 0 {
            let errno = nix::errno::Errno::last();
            if errno != nix::errno::Errno::EINTR {
                return Err(Error::Os { call: "getrandom", errno });
            }
            continue;
        }
        filled += n as usize;
    }
    Ok(())
}

/// Per-process state that a forked child must not share: the parent's threads are not there,
/// and a lock one of them held at the fork stays held.
struct PerProcess<T> {
    slot: Mutex<Option<(u32, Arc<T>)>>,
}

impl<T> PerProcess<T> {
    const fn new() -> PerProcess<T> {
        PerProcess { slot: Mutex::new(None) }
    }

    /// This process's, if made.
    fn current(&self) -> Option<Arc<T>> {
        let s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        s.as_ref().filter(|(p, _)| *p == std::process::id()).map(|(_, t)| t.clone())
    }

    fn get(&self, make: impl FnOnce() -> Result<Arc<T>>) -> Result<Arc<T>> {
        let pid = std::process::id();
        let mut s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((p, t)) = s.as_ref() {
            if *p == pid {
                return Ok(t.clone());
            }
            // The parent's, copied by a fork: never touched, never dropped (its threads are gone).
            std::mem::forget(s.take());
        }
        let t = make()?;
        *s = Some((pid, t.clone()));
        Ok(t)
    }
}

static SENDER: PerProcess<sender::Inner> = PerProcess::new();
static RECEIVER: PerProcess<receiver::Inner> = PerProcess::new();

/// This process's sending side of the hand-off.
#[derive(Clone)]
pub struct Sender {
    inner: Arc<sender::Inner>,
}

impl Sender {
    /// The process's sender, listening from its first use on.
    pub fn global() -> Result<Sender> {
        let inner = SENDER.get(|| {
            let inner = sender::Inner::start()?;
            let weak = Arc::downgrade(&inner);
            // Exported pages given back here are revoked from the receivers that map them.
            crate::vmm::released_exports::watch(Box::new(move |serial| {
                if let Some(s) = weak.upgrade() {
                    if s.pid == std::process::id() {
                        s.released(serial);
                    }
                }
            }));
            // Pages mapped and unmapped here are placed in the mirrors of receivers that ask.
            let weak = Arc::downgrade(&inner);
            crate::vmm::placements::watch(Box::new(move |e| {
                if let Some(s) = weak.upgrade() {
                    if s.pid == std::process::id() {
                        s.placement(e);
                    }
                }
            }));
            Ok(inner)
        })?;
        Ok(Sender { inner })
    }

    /// Offers the live block of `alloc` holding `ptr` (anywhere inside it) to one receiver: the
    /// returned ticket takes it. From now until the receiver lets go (or exits), the block's memory
    /// stays out of every later allocation, even once this process frees it, and its tag does not
    /// sleep. Offers sharing a `group` go to the first receiver that fetches any of them together,
    /// in one answer (the tensors of one message).
    pub fn offer(&self, alloc: &StreamAllocator, ptr: u64, group: Option<u64>) -> Result<Ticket> {
        let device = alloc.context().device().uuid()?.0;
        let share = alloc.export_mark(DevicePtr::new(ptr))?;
        // A process that hands blocks over does so again: the pages made from now on carry their
        // descriptors ready.
        alloc.export_pages_ahead();
        let held = AllocShared { alloc: alloc.clone(), block: share.block, serials: share.pages.clone() };
        // Dropped (the block's mark let go) if the offer fails.
        let token = self.inner.offer(Box::new(held), group)?;
        Ok(Ticket { address: self.inner.address.clone(), pid: self.inner.pid, token, device, share })
    }

    /// The process's sender if it has started, without starting it.
    pub fn started() -> Option<Sender> {
        SENDER.current().map(|inner| Sender { inner })
    }

    /// Lets go of the offer of `ticket` if nobody has taken it yet; whether it did.
    pub fn withdraw(&self, ticket: &Ticket) -> bool {
        self.inner.withdraw(&ticket.token)
    }

    /// Bytes of the ticket of a block on `pages` pages.
    pub fn ticket_len(&self, pages: usize) -> usize {
        Ticket::len_for(pages, self.inner.address.len())
    }

    /// Lets go of offers not taken within `ttl` of being made (`None`, the default: kept until
    /// taken or this process exits).
    pub fn set_offer_ttl(&self, ttl: Option<Duration>) {
        self.inner.set_ttl(ttl);
    }

    /// Its counters.
    pub fn stats(&self) -> SenderStats {
        self.inner.stats()
    }
}

/// One sharing of an allocator's block, ended when dropped.
struct AllocShared {
    alloc: StreamAllocator,
    block: DevicePtr,
    serials: Vec<u64>,
}

impl Shared for AllocShared {
    fn descriptors(&self) -> Result<Vec<OwnedFd>> {
        self.alloc.exported_fds(self.block)
    }

    fn serials(&self) -> &[u64] {
        &self.serials
    }
}

impl Drop for AllocShared {
    fn drop(&mut self) {
        record_drop(self.alloc.unexport(self.block));
    }
}

/// This process's receiving side of the hand-off.
#[derive(Clone)]
pub struct Receiver {
    inner: Arc<receiver::Inner>,
}

impl Receiver {
    /// The process's receiver.
    pub fn global() -> Result<Receiver> {
        Ok(Receiver { inner: RECEIVER.get(receiver::Inner::start)? })
    }

    /// Takes the offer of `ticket` and maps the block on `ctx`'s device (the ticket's, by UUID),
    /// granting access to `peers` too (devices this process uses that reach it). Waits at most
    /// `timeout` for the sender. A block whose pages this process maps already (handed over
    /// before and kept) costs one message and no wait.
    pub fn take(&self, ctx: &Context, ticket: &Ticket, peers: &[Device], timeout: Duration) -> Result<Lease> {
        let here = ctx.device().uuid()?.0;
        if here != ticket.device {
            return Err(Error::invalid(format!(
                "the ticket's memory lives on another device than device {}",
                ctx.device().ordinal()
            )));
        }
        let page = ticket.share.page;
        let peers = peers.to_vec();
        // The mirror grants this device alone: a take that names peers maps its own.
        let place = peers.is_empty().then(|| Box::new(MirrorPlacer::new(ctx)) as Box<dyn Place>);
        self.inner.take(
            ticket,
            timeout,
            |fds| {
                let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                let import = BlockImport::import(ctx, &borrowed, page, &peers)?;
                Ok(Box::new(Imported { import, ctx: ctx.clone() }) as Box<dyn Mapped>)
            },
            place,
        )
    }

    /// The process's receiver if it has started, without starting it.
    pub fn started() -> Option<Receiver> {
        RECEIVER.current().map(|inner| Receiver { inner })
    }

    /// Tells the sender of `ticket` that this process will not take it (it lets the block go).
    pub fn let_go(&self, ticket: &Ticket, timeout: Duration) -> Result<()> {
        self.inner.let_go(ticket, timeout)
    }

    /// Its counters.
    pub fn stats(&self) -> ReceiverStats {
        self.inner.stats()
    }
}

struct Imported {
    import: BlockImport,
    ctx: Context,
}

/// The span of a sender's address space one reservation of a mirror covers: a block whose
/// pages straddle two is mapped for its take instead.
const MIRROR_WINDOW: u64 = 1 << 40;

/// Maps a sender's pages on one device at the same place, relative to a window of
/// [`MIRROR_WINDOW`] bytes, as they lie in the sender: a block's pages side by side.
struct MirrorPlacer {
    ctx: Context,
    windows: HashMap<u64, Reservation>,
}

impl MirrorPlacer {
    fn new(ctx: &Context) -> MirrorPlacer {
        MirrorPlacer { ctx: ctx.clone(), windows: HashMap::new() }
    }
}

impl Place for MirrorPlacer {
    fn place(&mut self, fd: OwnedFd, addr: u64, size: u64) -> Result<Box<dyn Placed>> {
        let (window, offset) = (addr / MIRROR_WINDOW, addr % MIRROR_WINDOW);
        if offset + size > MIRROR_WINDOW {
            return Err(Error::invalid("a page across two windows of a mirror"));
        }
        let r = match self.windows.entry(window) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                e.insert(Reservation::with_options(&self.ctx, MIRROR_WINDOW as usize, 1 << 30, None)?)
            }
        };
        let phys = PhysicalMemory::import_fd(&self.ctx, fd.as_fd(), size as usize)?;
        let mapping = r.map_all(offset as usize, &phys)?;
        mapping.set_access(&[(self.ctx.device(), Access::ReadWrite)])?;
        Ok(Box::new(MirrorPage { mapping }))
    }

    fn settler(&self) -> Settle {
        let ctx = self.ctx.clone();
        Arc::new(move || ctx.synchronize())
    }
}

struct MirrorPage {
    mapping: Mapping,
}

impl Placed for MirrorPage {
    fn here(&self) -> u64 {
        self.mapping.ptr()
    }
}

impl Drop for MirrorPage {
    fn drop(&mut self) {
        // SAFETY: a mirror's page is dropped only once no lease uses it, every lease over it
        // released after the work it named (or the device's) was done.
        unsafe { self.mapping.assume_idle() };
    }
}

impl Mapped for Imported {
    fn base(&self) -> u64 {
        self.import.ptr()
    }

    fn settle(&self) -> Result<()> {
        self.ctx.synchronize()
    }

    unsafe fn assume_idle(&mut self) {
        // SAFETY: per this function's contract.
        unsafe { self.import.assume_idle() };
    }
}

impl Lease {
    /// Lets go of the block once the work queued on `stream` so far is done: an event recorded
    /// now, waited for on the library's release thread, then the sender told.
    pub fn release_after(self, stream: &Stream) -> Result<()> {
        // SAFETY: a live stream of cuvmm's.
        unsafe { self.release_after_raw(stream.context(), &[stream.raw()]) }
    }

    /// [`release_after`](Self::release_after) for streams known by their handles (PyTorch's):
    /// the release waits for the work queued on each of `streams` so far.
    ///
    /// # Safety
    /// Each handle must be a live stream of `ctx`, the null handle or `CU_STREAM_LEGACY`, for
    /// the duration of the call.
    pub unsafe fn release_after_raw(self, ctx: &Context, streams: &[CUstream]) -> Result<()> {
        let mut events = Vec::with_capacity(streams.len());
        for &s in streams {
            let e = Event::create(
                ctx,
                crate::driver::sys::CU_EVENT_DISABLE_TIMING | crate::driver::sys::CU_EVENT_BLOCKING_SYNC,
            )?;
            // SAFETY: per this function's contract.
            unsafe { e.record_raw(s)? };
            events.push(e);
        }
        self.release_after_wait(Box::new(move || {
            for e in &events {
                e.synchronize_relaxed()?;
            }
            Ok(())
        }));
        Ok(())
    }
}

#[cfg(test)]
#[path = "protocol_tests.rs"]
mod tests;
