//! Sharing a growing vector: [`VmmVec::share_growth`] and the exporting side's bookkeeping (the
//! vector's growth and shrink tell it, as the followers of its range) and [`GrowableImport`],
//! which follows the vector from another process.
//!
//! The importer reserves the exporter's whole reservation once, when the connection opens, and
//! maps each chunk, as it is announced, at the offset it has in the exporter's vector. Nothing it
//! mapped is ever remapped, and its address space never grows: unlike an importer that reserves
//! room for the largest possible growth anew with every segment it imports (PyTorch issue 186213
//! describes the address space running out that way), one connection reserves exactly one
//! region of the size the exporter announces, bounded by a limit the importer sets.

use super::region::{RegionLayout, RegionRefusal, Step};
use super::shared::{host_read, host_write, import_and_map, local_granularity, range_at};
use super::socket::{recv_message, send_message, Credentials, FrameReader, PeerPolicy};
use super::wire::{Grow, HandleType, Message, Region, WireHandle};
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::order::{Tracker, Use};
use crate::vmm::{Access, Followers, HandleTypes, Location, Mapping, PhysicalBuilder, Reservation, VmmVec};
use std::any::Any;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The importers of one growing vector and what every message to them carries. The vector's
/// range holds it as its followers, and tells it of each growth and shrink.
pub(crate) struct Exports {
    importers: Vec<OwnedFd>,
    handle: HandleType,
    granularity: u64,
    device_uuid: [u8; 16],
    /// The grow messages of a growth not committed yet, their handles exported.
    pending: Outgoing,
}

/// A message for every importer, with the fd it carries.
type Outgoing = Vec<(Message, Option<OwnedFd>)>;

/// How long the exporter waits for an importer's socket to take a message, unless the socket
/// came with a send timeout of its own: a few thousand messages fit in a socket's buffer, so an
/// importer reading at all never waits this long.
pub const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

impl Exports {
    /// For chunks made by `phys`, of the given granularity. Refuses chunks that cannot be exported.
    pub(crate) fn new(phys: &PhysicalBuilder, granularity: usize) -> Result<Exports> {
        let Location::Device(dev) = phys.get_location() else {
            return Err(Error::unsupported(
                "sharing host-located memory",
                "only device memory is shared by this crate",
            ));
        };
        let types = phys.get_handle_types();
        let handle = if types.contains(HandleTypes::FABRIC) {
            HandleType::Fabric
        } else if types.contains(HandleTypes::POSIX_FD) {
            HandleType::PosixFd
        } else {
            return Err(Error::invalid(
                "the vector's chunks cannot be exported: build it with handle_types(HandleTypes::POSIX_FD) \
                 (or FABRIC) to share it",
            ));
        };
        Ok(Exports {
            importers: Vec::new(),
            handle,
            granularity: granularity as u64,
            device_uuid: dev.uuid()?.0,
            pending: Vec::new(),
        })
    }

    /// The grow message for `chunk`, its handle exported.
    fn grow(&self, chunk: &Mapping) -> Result<(Message, Option<OwnedFd>)> {
        let phys = chunk.physical();
        let (handle, fd) = match self.handle {
            HandleType::PosixFd => (WireHandle::PosixFd, Some(phys.export_fd()?)),
            HandleType::Fabric => (WireHandle::Fabric(phys.export_fabric()?), None),
        };
        let g = Grow::new(
            handle,
            phys.size() as u64,
            self.granularity,
            chunk.offset() as u64,
            self.device_uuid,
            0,
        )?;
        Ok((Message::Grow(g), fd))
    }

    /// Connects an importer: sends it the region (`capacity` bytes, `tag`) and a grow message for
    /// each chunk mapped so far. On failure the socket is closed and nothing else changes. A
    /// socket without a send timeout gets [`SEND_TIMEOUT`]: an importer that stops reading is
    /// disconnected then, instead of stalling the exporter's growth until it exits.
    pub(crate) fn add(&mut self, sock: OwnedFd, capacity: usize, tag: u64, chunks: &[Mapping]) -> Result<()> {
        use nix::sys::socket::{getsockopt, setsockopt, sockopt::SendTimeout};
        let none = nix::sys::time::TimeVal::new(0, 0);
        if getsockopt(&sock, SendTimeout)
            .map_err(|errno| Error::Os { call: "getsockopt(SO_SNDTIMEO)", errno })?
            == none
        {
            let t = nix::sys::time::TimeVal::new(
                SEND_TIMEOUT.as_secs() as i64,
                SEND_TIMEOUT.subsec_micros() as i64,
            );
            setsockopt(&sock, SendTimeout, &t)
                .map_err(|errno| Error::Os { call: "setsockopt(SO_SNDTIMEO)", errno })?;
        }
        let region = Region::new(self.handle, capacity as u64, self.granularity, self.device_uuid, tag)?;
        send_message(sock.as_fd(), &Message::Region(region), None)?;
        for chunk in chunks {
            let (m, fd) = self.grow(chunk)?;
            send_message(sock.as_fd(), &m, fd.as_ref().map(AsFd::as_fd))?;
        }
        self.importers.push(sock);
        Ok(())
    }

    /// Sends `messages` to every importer, in order. An importer that cannot be sent to (it
    /// exited, or its socket's send timeout expired: it stopped reading) is disconnected: its
    /// socket is closed, and it keeps what it has mapped.
    fn send(&mut self, messages: &[(Message, Option<OwnedFd>)]) {
        self.importers.retain(|sock| {
            messages.iter().all(|(m, fd)| send_message(sock.as_fd(), m, fd.as_ref().map(AsFd::as_fd)).is_ok())
        });
    }
}

impl Followers for Exports {
    /// The grow messages for `fresh` chunks, their handles exported before the growth is
    /// committed, so that an export that fails fails the growth rather than leaving importers
    /// behind. Nothing is exported while no importer is connected.
    fn prepare(&mut self, fresh: &[Mapping]) -> Result<()> {
        self.pending = if self.importers.is_empty() {
            Vec::new()
        } else {
            fresh.iter().map(|c| self.grow(c)).collect::<Result<_>>()?
        };
        Ok(())
    }

    fn grew(&mut self) {
        let announce = std::mem::take(&mut self.pending);
        self.send(&announce);
    }

    fn shrank(&mut self, length: usize) {
        self.send(&[(Message::Shrink { length: length as u64, tag: 0 }, None)]);
    }

    /// Importers still connected, as far as the last message sent to them tells.
    fn count(&self) -> usize {
        self.importers.len()
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<T: DeviceCopy> VmmVec<T> {
    /// Shares this vector, and from now on every growth and shrink of it, with the process at the
    /// other end of `sock`, which follows it with [`GrowableImport`].
    ///
    /// Sends a region message (the reservation's size, to be reserved by the importer once, and
    /// `tag`) and a grow message for each chunk mapped so far; then each chunk the vector maps is
    /// exported and announced before the growth returns, and a shrink that unmaps chunks
    /// announces the new length. The vector must have been built with exportable chunks
    /// ([`VmmVecBuilder::handle_types`](crate::VmmVecBuilder::handle_types) with [`HandleTypes::POSIX_FD`] or
    /// [`FABRIC`](HandleTypes::FABRIC)), else [`Error::InvalidArgument`]. Call it again to add
    /// importers; a failure closes `sock` and leaves the others as they were.
    ///
    /// While an importer is connected the vector never moves: a growth past the reservation is
    /// refused with [`Error::InvalidArgument`] (and changes nothing), so reserve enough address
    /// space up front ([`VmmVecBuilder::reserve_address_space`](crate::VmmVecBuilder::reserve_address_space)). Once every importer has gone it
    /// may move again, and a later importer reserves the new size.
    ///
    /// Messages are sent on the caller's thread, blocking while an importer's socket buffer is
    /// full (after some hundreds of messages it has not read), for at most the socket's send
    /// timeout: its own `SO_SNDTIMEO`, or [`SEND_TIMEOUT`] where
    /// it had none. An importer that cannot be sent to any more (it exited, or stopped reading) is
    /// disconnected, without failing the growth: its socket is closed and it keeps what it had
    /// mapped. [`importer_count`](Self::importer_count) says how many remain.
    ///
    /// The importer's memory stays valid whatever happens to this process: it holds its own
    /// handle on every chunk it has mapped, until it unmaps it (on a shrink) or drops the import.
    /// ```no_run
    /// # fn f(sock: std::os::unix::net::UnixStream) -> cuvmm::Result<()> {
    /// use cuvmm::vmm::HandleTypes;
    /// let ctx = cuvmm::Context::for_ordinal(0)?;
    /// let mut v = cuvmm::VmmVec::<f32>::builder(&ctx)
    ///     .handle_types(HandleTypes::POSIX_FD)
    ///     .reserve_address_space(16 << 30)
    ///     .build()?;
    /// v.share_growth(sock, 0)?;
    /// v.resize(1 << 28, 0.0)?; // 1 GiB: the importer maps each new chunk
    /// v.notify_importers(v.len() as u64)?;
    /// v.truncate(0);
    /// v.shrink_to_fit()?; // and unmaps them again
    /// # Ok(()) }
    /// ```
    pub fn share_growth(&mut self, sock: impl Into<OwnedFd>, tag: u64) -> Result<()> {
        let (exports, chunks, capacity) = self.raw_mut().follow(Exports::new)?;
        exports.add(sock.into(), capacity, tag, chunks)
    }

    /// Sends every importer a note with `tag` (the number of elements written, say), once all
    /// writes to the elements queued on streams the vector knows of have completed: an importer
    /// that receives it sees every chunk announced before it mapped, and the elements written
    /// before it. Disconnects importers that cannot be sent to, as growth does.
    pub fn notify_importers(&mut self, tag: u64) -> Result<()> {
        {
            let _turn = self.host(0, self.len(), Use::Read)?;
        }
        if let Some(e) = self.raw_mut().followers_as::<Exports>() {
            e.send(&[(Message::Note { tag }, None)]);
        }
        Ok(())
    }

    /// Processes following this vector's growth (see [`share_growth`](Self::share_growth)), as far
    /// as the last message sent to them tells.
    pub fn importer_count(&self) -> usize {
        self.raw().importers()
    }
}

/// What one message did to a [`GrowableImport`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    /// A chunk of `size` bytes is mapped at `offset`, where the mapped part ended.
    Grew {
        /// Its offset in the region.
        offset: usize,
        /// Its size.
        size: usize,
        /// The exporter's tag (cuvmm's `VmmVec` sends 0).
        tag: u64,
    },
    /// The chunks from `length` bytes on are unmapped.
    Shrank {
        /// Bytes still mapped.
        length: usize,
        /// The exporter's tag (cuvmm's `VmmVec` sends 0).
        tag: u64,
    },
    /// The exporter's note, received after everything it sent before it.
    Note {
        /// Its value.
        tag: u64,
    },
    /// The exporter closed the connection between two messages (it dropped the vector, exited or
    /// was killed). What is mapped stays mapped and usable for as long as the import lives.
    Closed,
}

/// Where a [`GrowableImport`]'s connection stands.
enum State {
    Open,
    Closed,
    /// The first error stays: later messages could only be judged against a layout that no
    /// longer says what the exporter believes is mapped.
    Failed(Error),
}

/// A vector another process grows, followed here: one reservation of the size the exporter
/// announces, made up front, and each chunk mapped at the offset it has in the exporter's vector
/// as its grow message arrives. The base address never changes and nothing is remapped; a shrink
/// unmaps the chunks past the new length.
///
/// Every message is checked against the layout so far ([`RegionLayout`]): a chunk must start
/// where the mapped part ends and end inside the reservation, a shrink must end on a chunk
/// boundary, and so on. After any error (a refused message, a driver failure, a connection cut
/// inside a message) the import receives nothing more, returns that error from every later
/// [`next_update`](Self::next_update), and keeps what it has mapped, usable as before. What it
/// maps stays valid when the exporter exits or is killed: the import holds its own handle on each
/// chunk, and the memory is freed when the last process unmaps it.
///
/// As with [`SharedMemory`](super::SharedMemory), the other process may write the memory at any
/// time, so this type hands out device pointers, device views and copies, never Rust references.
///
/// ```no_run
/// use cuvmm::ipc::{GrowableImport, PeerPolicy, Update};
/// use cuvmm::vmm::HandleTypes;
/// use cuvmm::VmmVec;
/// # fn f(exporter_sock: std::os::unix::net::UnixStream, importer_sock: std::os::unix::net::UnixStream) -> cuvmm::Result<()> {
/// let ctx = cuvmm::Context::for_ordinal(0)?;
/// // Exporting process: a vector whose chunks can be exported, with 1 GiB of address space.
/// let mut v = VmmVec::<u32>::builder(&ctx)
///     .handle_types(HandleTypes::POSIX_FD)
///     .reserve_address_space(1 << 30)
///     .build()?;
/// v.share_growth(exporter_sock, /* tag */ 7)?;
/// v.extend_from_slice(&[1, 2, 3])?; // the new chunk is announced
/// v.notify_importers(v.len() as u64)?; // "3 elements are written"
///
/// // Importing process: reserves 1 GiB (at most the 4 GiB it allows), then follows.
/// let mut import = GrowableImport::accept(&ctx, importer_sock, PeerPolicy::SameUid, 4 << 30, &[])?;
/// if let Some(written) = import.next_note()? {
///     let mut first = vec![0u32; written as usize];
///     import.copy_to_host(0, &mut first)?;
///     assert_eq!(first, [1, 2, 3]);
/// }
/// # Ok(()) }
/// ```
pub struct GrowableImport {
    // Field order is drop order: chunks are unmapped before the reservation is freed.
    chunks: Vec<Mapping>,
    reservation: Reservation,
    region: Region,
    layout: RegionLayout,
    sock: OwnedFd,
    /// A message begun and not complete yet, kept for the next call.
    reader: FrameReader,
    policy: PeerPolicy,
    grants: Vec<(Device, Access)>,
    peer: Credentials,
    state: State,
    /// Streams of this process that used the mapped part (see [`crate::stream::order`]).
    order: Tracker,
}

fn to_usize(x: u64) -> Result<usize> {
    usize::try_from(x).map_err(|_| Error::Protocol(format!("{x} does not fit this machine's usize")))
}

impl GrowableImport {
    /// Waits on `sock` for the exporter's region message, checks it (the peer against `policy`,
    /// the capacity against `max_capacity`, which bounds the address space this import may
    /// reserve) and reserves the region, aligned to its chunks' granularity. Chunks are mapped by the following calls to
    /// [`next_update`](Self::next_update); each is granted `grants` (read-write for `ctx`'s device
    /// if empty).
    ///
    /// A connection that closes first is an [`Error::Protocol`]; a first message that is anything
    /// but a region an [`Error::RegionRefused`]. The wait for the region honours the socket's mode and receive timeout
    /// as [`recv_message`] does: give the socket a receive timeout (`SO_RCVTIMEO`) to bound it.
    pub fn accept(
        ctx: &Context,
        sock: impl Into<OwnedFd>,
        policy: PeerPolicy,
        max_capacity: usize,
        grants: &[(Device, Access)],
    ) -> Result<GrowableImport> {
        let sock = sock.into();
        let mut layout = RegionLayout::new(max_capacity as u64, local_granularity(ctx)? as u64)?;
        let Some(first) = recv_message(sock.as_fd(), policy)? else {
            return Err(Error::Protocol("the peer closed the connection before sending its region".into()));
        };
        // A region carries no fd (`recv_message` checked), so nothing is dropped unseen here.
        let (message, _, peer) = first.into_parts();
        let Step::Open(region) = layout.apply(&message)? else {
            return Err(Error::UnexpectedMessage { got: message.kind(), expected: "a region was expected" });
        };
        // Aligned to the chunks' granularity, which may be coarser than ours: every chunk is
        // mapped at a multiple of it.
        let reservation = Reservation::with_options(
            ctx,
            to_usize(region.capacity())?,
            to_usize(region.granularity())?,
            None,
        )?;
        let grants =
            if grants.is_empty() { vec![(ctx.device(), Access::ReadWrite)] } else { grants.to_vec() };
        Ok(GrowableImport {
            chunks: Vec::new(),
            reservation,
            region,
            layout,
            sock,
            reader: FrameReader::new(),
            policy,
            grants,
            peer,
            state: State::Open,
            order: Tracker::new(),
        })
    }

    /// Waits for the next message and applies it: maps an announced chunk, unmaps what a shrink
    /// cuts, or returns a note. `Ok(Update::Closed)` once the exporter has closed the connection
    /// between messages, then again at every call.
    ///
    /// Waits as the socket's mode says. A blocking socket without a receive timeout waits until
    /// a message arrives; to wait with `poll` or an event loop instead, poll this value's fd
    /// ([`AsFd`]) for input first, or make the socket non-blocking. On a non-blocking socket a
    /// call that finds no whole message returns [`Error::Os`] with `EAGAIN`
    /// ([`Error::is_would_block`]); with a receive timeout (`SO_RCVTIMEO`), one that waits that
    /// long with nothing arriving returns `EAGAIN` too, and one that waits that long inside a
    /// message returns [`Error::Timeout`]. In every such case the import goes on: the part of a
    /// message that arrived, and its descriptor, are kept, and the next call continues it.
    /// [`next_update_until`](Self::next_update_until) bounds the wait explicitly. Any other error
    /// ends the import, and every later call returns it.
    pub fn next_update(&mut self) -> Result<Update> {
        self.update(None)
    }

    /// [`next_update`](Self::next_update), giving up at `deadline` with [`Error::Timeout`]
    /// whatever the socket's mode; the import goes on, and a message begun is kept for the next
    /// call. A peer that sends part of a message and falls silent holds this call no longer than
    /// the deadline.
    pub fn next_update_until(&mut self, deadline: std::time::Instant) -> Result<Update> {
        self.update(Some(deadline))
    }

    fn update(&mut self, deadline: Option<std::time::Instant>) -> Result<Update> {
        match &self.state {
            State::Failed(e) => return Err(e.clone()),
            State::Closed => return Ok(Update::Closed),
            State::Open => {}
        }
        let r = self.receive(deadline);
        match &r {
            Err(e) if e.is_would_block() || e.is_timeout() => {}
            Err(e) => self.state = State::Failed(e.clone()),
            Ok(Update::Closed) => self.state = State::Closed,
            Ok(_) => {}
        }
        r
    }

    /// Applies updates until the next note and returns its value; `None` if the connection
    /// closes first.
    pub fn next_note(&mut self) -> Result<Option<u64>> {
        loop {
            match self.next_update()? {
                Update::Note { tag } => return Ok(Some(tag)),
                Update::Closed => return Ok(None),
                Update::Grew { .. } | Update::Shrank { .. } => {}
            }
        }
    }

    fn receive(&mut self, deadline: Option<std::time::Instant>) -> Result<Update> {
        let Some(incoming) = self.reader.recv(self.sock.as_fd(), self.policy, deadline)? else {
            return Ok(Update::Closed);
        };
        let (message, fd, _) = incoming.into_parts();
        match self.layout.check(&message)? {
            Step::Map(g) => {
                let (offset, size) = (to_usize(g.offset())?, to_usize(g.size())?);
                // The layout is changed only once the chunk is mapped and accessible: on failure
                // the mapping is dropped, and the layout still says what is mapped.
                let chunk = import_and_map(&self.reservation, offset, g.handle(), fd, size)?;
                chunk.set_access(&self.grants)?;
                self.layout.apply(&message)?;
                self.chunks.push(chunk);
                Ok(Update::Grew { offset, size, tag: g.tag() })
            }
            Step::Unmap { keep, length } => {
                self.layout.apply(&message)?;
                // Dropping a mapping waits for the work queued on it, then unmaps.
                self.chunks.truncate(keep);
                Ok(Update::Shrank { length: to_usize(length)?, tag: message.tag() })
            }
            Step::Note(tag) => Ok(Update::Note { tag }),
            // `check` opens a region only before the first one.
            Step::Open(_) => Err(Error::RegionRefused(RegionRefusal::SecondRegion)),
        }
    }

    /// The region as the exporter announced it.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The layout: the chunks mapped, in order.
    pub fn layout(&self) -> &RegionLayout {
        &self.layout
    }

    /// The exporter, as the socket reported it.
    pub fn peer(&self) -> Credentials {
        self.peer
    }

    /// Whether the exporter has closed the connection (see [`Update::Closed`]).
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    /// The first address of the region: the same for the import's whole life.
    pub fn ptr(&self) -> u64 {
        self.reservation.base()
    }

    /// Bytes mapped, from [`ptr`](Self::ptr) on.
    pub fn mapped(&self) -> usize {
        self.chunks.last().map_or(0, |c| c.offset() + c.len())
    }

    /// Bytes reserved: the region's capacity.
    pub fn capacity(&self) -> usize {
        self.reservation.size()
    }

    /// The mapped chunks, in address order.
    pub fn chunks(&self) -> &[Mapping] {
        &self.chunks
    }

    /// The mapped part as `T`s, for kernels and copies.
    pub fn as_slice<T: DeviceCopy>(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the first `mapped()` bytes are mapped and accessible while self lives, and
        // `&self` keeps `next_update` (which may unmap) from running meanwhile; device views are
        // never dereferenced on the host.
        unsafe {
            DeviceSlice::tracked(self.ptr(), self.mapped() / std::mem::size_of::<T>().max(1), &self.order)
        }
    }

    /// The mapped part as writable `T`s.
    pub fn as_mut_slice<T: DeviceCopy>(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as above.
        unsafe {
            DeviceSliceMut::tracked(self.ptr(), self.mapped() / std::mem::size_of::<T>().max(1), &self.order)
        }
    }

    /// Copies from byte `byte_offset` of the mapped part into `out`.
    pub fn copy_to_host<T: DeviceCopy>(&self, byte_offset: usize, out: &mut [T]) -> Result<()> {
        let at = range_at(self.ptr(), self.mapped(), byte_offset, std::mem::size_of_val(out))?;
        host_read(self.reservation.context(), &self.order, at, out)
    }

    /// Copies `data` to byte `byte_offset` of the mapped part.
    pub fn copy_from_host<T: DeviceCopy>(&self, byte_offset: usize, data: &[T]) -> Result<()> {
        let at = range_at(self.ptr(), self.mapped(), byte_offset, std::mem::size_of_val(data))?;
        host_write(self.reservation.context(), &self.order, at, data)
    }
}

impl AsFd for GrowableImport {
    /// The connection to the exporter, to poll for input.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl std::fmt::Debug for GrowableImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrowableImport")
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("mapped", &self.mapped())
            .field("capacity", &self.capacity())
            .field("chunks", &self.chunks.len())
            .field("closed", &self.is_closed())
            .finish()
    }
}
