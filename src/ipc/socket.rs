//! Passing messages over Unix-domain sockets: the frame as data, the fd as SCM_RIGHTS ancillary
//! data, the peer's credentials checked with SO_PEERCRED.

use super::wire::{Header, Message, HEADER_LEN};
use crate::error::{Error, Refusal, Result};
use nix::sys::socket::{getsockopt, recvmsg, sendmsg, sockopt::PeerCredentials, ControlMessage, MsgFlags};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Instant;

pub use crate::error::values::PeerPolicy;

/// The peer's credentials at connection time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// The peer's credentials, checked against `policy`: [`Error::PeerRefused`] when it refuses them.
pub fn check_peer(sock: BorrowedFd<'_>, policy: PeerPolicy) -> Result<Credentials> {
    let c = getsockopt(&sock, PeerCredentials)
        .map_err(|errno| Error::Os { call: "getsockopt(SO_PEERCRED)", errno })?;
    let creds = Credentials { pid: c.pid(), uid: c.uid(), gid: c.gid() };
    let allowed = match policy {
        // SO_PEERCRED gives the peer's effective uid: compare like with like (a set-uid program
        // runs with real and effective uids apart).
        PeerPolicy::SameUid => creds.uid == nix::unistd::geteuid().as_raw(),
        PeerPolicy::Uid(u) => creds.uid == u,
        PeerPolicy::AnyUid => true,
    };
    if !allowed {
        return Err(Error::PeerRefused { pid: creds.pid, uid: creds.uid, policy });
    }
    Ok(creds)
}

/// Sends any message, with `fd` as SCM_RIGHTS when the message says one travels. Refuses, before
/// sending anything, an fd the message does not announce or a missing one
/// ([`Error::InvalidArgument`]). A peer that has gone is an [`Error::Os`] (`EPIPE`), never a
/// signal.
pub fn send_message(sock: BorrowedFd<'_>, message: &Message, fd: Option<BorrowedFd<'_>>) -> Result<()> {
    if message.fd_count() != usize::from(fd.is_some()) {
        return Err(Error::invalid(format!(
            "the {} message announces {} fd(s), {} given",
            message.kind(),
            message.fd_count(),
            usize::from(fd.is_some())
        )));
    }
    let bytes = message.encode()?;
    let mut sent = 0;
    while sent < bytes.len() {
        // The fd goes with the first byte only.
        match send_chunk(sock, &bytes[sent..], if sent == 0 { fd } else { None }) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(errno) => return Err(Error::Os { call: "sendmsg", errno }),
        }
    }
    Ok(())
}

/// One `sendmsg` of `bytes`, with `fd` as SCM_RIGHTS if given (`MSG_NOSIGNAL`: a peer that has
/// gone is `EPIPE`, never a signal).
fn send_chunk(sock: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> nix::Result<usize> {
    let raw = fd.map(|fd| [fd.as_raw_fd()]);
    let rights = raw.as_ref().map(|raw| ControlMessage::ScmRights(raw));
    sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(bytes)], rights.as_slice(), MsgFlags::MSG_NOSIGNAL, None)
}

/// `SCM_PIDFD` (Linux 6.5): a pidfd of the sender, installed in the receiver when it set
/// `SO_PASSPIDFD`. Not in every libc release, so spelled out here.
const SCM_PIDFD: libc::c_int = 4;

/// `CMSG_ALIGN`: control messages and their data start on `size_t` boundaries.
const fn cmsg_align(len: usize) -> usize {
    (len + std::mem::size_of::<usize>() - 1) & !(std::mem::size_of::<usize>() - 1)
}

/// `CMSG_LEN(0)`: where a control message's data starts.
const CMSG_HDR: usize = cmsg_align(std::mem::size_of::<libc::cmsghdr>());

/// `CMSG_SPACE(len)`.
const fn cmsg_space(len: usize) -> usize {
    CMSG_HDR + cmsg_align(len)
}

/// Room for everything the kernel may attach to one message: the most fds Linux passes at once
/// (SCM_MAX_FD, 253), credentials (`SO_PASSCRED`), a pidfd (`SO_PASSPIDFD`), then as much again
/// for a security label (`SO_PASSSEC`) and whatever a later kernel adds. A smaller buffer is what
/// let descriptors leak: with credentials first, only 246 of 253 fds fitted, and the truncated
/// control data was then not walked at all.
const CONTROL_LEN: usize = 2
    * (cmsg_space(253 * std::mem::size_of::<RawFd>())
        + cmsg_space(std::mem::size_of::<libc::ucred>())
        + cmsg_space(std::mem::size_of::<RawFd>()));

/// What one `recvmsg` brought.
struct Chunk {
    bytes: usize,
    control_truncated: bool,
}

/// Takes ownership of every descriptor in `control` (the control data the kernel wrote): the
/// SCM_RIGHTS fds go to `fds`; a SCM_PIDFD pidfd, which is no part of the message, is closed.
/// Walks whatever headers are present, truncated or not, and never reads past `control`.
fn own_descriptors(control: &[u8], fds: &mut Vec<OwnedFd>) {
    let mut at: usize = 0;
    while let Some(hdr_bytes) =
        at.checked_add(std::mem::size_of::<libc::cmsghdr>()).and_then(|end| control.get(at..end))
    {
        // SAFETY: `hdr_bytes` holds size_of::<cmsghdr>() bytes, and cmsghdr is integers only, so
        // any bytes are a valid value; read_unaligned needs no alignment.
        let hdr: libc::cmsghdr = unsafe { std::ptr::read_unaligned(hdr_bytes.as_ptr().cast()) };
        let len = hdr.cmsg_len as usize;
        if len < CMSG_HDR {
            break; // malformed: it would not advance
        }
        // A message cut short by truncation holds what fitted; never look beyond the buffer.
        let data = &control[(at + CMSG_HDR).min(control.len())..at.saturating_add(len).min(control.len())];
        let socket_level = hdr.cmsg_level == libc::SOL_SOCKET;
        let rights = socket_level && hdr.cmsg_type == libc::SCM_RIGHTS;
        if rights || (socket_level && hdr.cmsg_type == SCM_PIDFD) {
            for raw in data.chunks_exact(std::mem::size_of::<RawFd>()) {
                let raw = RawFd::from_ne_bytes(raw.try_into().expect("chunks of an fd's size"));
                // SAFETY: the kernel installed this descriptor in this process for this message
                // and listed it here; nothing else knows of it, so we are its only owner.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                if rights {
                    fds.push(fd);
                } // else the pidfd is dropped, and so closed, here
            }
        }
        // `at` is aligned, so aligning the end aligns the length.
        match at.checked_add(len).and_then(|end| end.checked_next_multiple_of(std::mem::size_of::<usize>())) {
            Some(next) => at = next,
            None => break,
        }
    }
}

/// Room for the control data of one `recvmsg`, its length its capacity: nix hands the kernel the
/// whole capacity, and [`own_descriptors`] walks all of it.
fn control_buffer() -> Vec<u8> {
    let mut control = vec![0; CONTROL_LEN];
    control.resize(control.capacity(), 0);
    control
}

/// One `recvmsg` into `buf` (close-on-exec descriptors, `flags` added), owning every descriptor
/// that came with it before returning, whatever else happened. `control` is a
/// [`control_buffer`].
fn recv_chunk(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    control: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    flags: MsgFlags,
) -> nix::Result<Chunk> {
    // The control data is walked here, not by nix's iterator: that refuses truncated control data
    // outright, leaving the descriptors that did arrive unowned, and hands a pidfd over as an
    // opaque message that nobody could close. nix does not say how much the kernel wrote; the
    // walk stops at the first header of length zero, so the buffer is zeroed for every call.
    control.fill(0);
    let mut iov = [IoSliceMut::new(buf)];
    let got = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(control), MsgFlags::MSG_CMSG_CLOEXEC | flags)
        .map(|m| Chunk { bytes: m.bytes, control_truncated: m.flags.contains(MsgFlags::MSG_CTRUNC) });
    own_descriptors(control, fds);
    got
}

/// Any received message, validated on its own, with the fd it carried if any and its sender.
///
/// Only [`recv_message`] and [`FrameReader`] make one, so its message passed validation and it
/// holds exactly the descriptors the message announces; its parts can be read or taken, not
/// replaced:
///
/// ```compile_fail,E0451
/// use cuvmm::ipc::{Credentials, Incoming, Message};
/// fn forge(message: Message, peer: Credentials) -> Incoming {
///     Incoming { message, fd: None, peer } // error: private fields
/// }
/// ```
#[derive(Debug)]
pub struct Incoming {
    message: Message,
    fd: Option<OwnedFd>,
    peer: Credentials,
}

impl Incoming {
    /// The message.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// The share's header, if the message is a share.
    pub fn share(&self) -> Option<&Header> {
        match &self.message {
            Message::Share(h) => Some(h),
            _ => None,
        }
    }

    /// Who sent it.
    pub fn peer(&self) -> Credentials {
        self.peer
    }

    /// The fd a share or grow message with a POSIX-fd handle carried, close-on-exec.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// The message, the fd and the sender.
    pub fn into_parts(self) -> (Message, Option<OwnedFd>, Credentials) {
        (self.message, self.fd, self.peer)
    }
}

/// Receives one message of any kind: the peer checked against `policy`, exactly one frame read, every fd that arrived owned, and the message refused (its fds closed)
/// unless it is well formed and carries exactly the fds it announces. `Ok(None)` when the peer
/// closed the connection before the first byte of a frame: between messages, the end of the
/// stream. A frame cut short is an [`Error::PeerClosed`]; a peer the policy refuses, an
/// [`Error::PeerRefused`].
///
/// Waits as the socket's mode says, before a frame and inside one alike:
///
/// * a blocking socket without a receive timeout waits as long as it takes;
/// * with a receive timeout (`SO_RCVTIMEO`), nothing having arrived within it is an
///   [`Error::Os`] with `EAGAIN` ([`Error::is_would_block`]) that consumed nothing; a frame that
///   has begun and makes no progress for that long is an [`Error::Timeout`];
/// * on a non-blocking socket, nothing there is `EAGAIN`, consuming nothing; a frame begun and
///   not complete is an [`Error::Timeout`] at once.
///
/// After an [`Error::Timeout`] with `received > 0` the partial frame is discarded and its
/// descriptors closed: the connection is out of step and should be closed. To keep a partial
/// frame for a later call (an event loop on a non-blocking socket), receive with a
/// [`FrameReader`]. [`recv_message_deadline`] bounds the wait explicitly.
///
/// Checks each frame on its own (see [`Message::decode`]); whether it fits what came before on
/// the connection is for the receiver to check, as [`GrowableImport`](super::GrowableImport)
/// does with a [`RegionLayout`](super::RegionLayout); a share goes to
/// [`SharedMemory::import`](super::SharedMemory::import), which refuses any other kind.
///
/// Works with `SO_PASSCRED` or `SO_PASSPIDFD` set on `sock`: the credentials are ignored (the
/// peer is checked with `SO_PEERCRED`) and a pidfd that arrives is closed.
pub fn recv_message(sock: BorrowedFd<'_>, policy: PeerPolicy) -> Result<Option<Incoming>> {
    recv_once(sock, policy, None)
}

/// [`recv_message`], giving up at `deadline` whatever the socket's mode: [`Error::Timeout`] when
/// the deadline passes before a whole frame has arrived (`received` 0: nothing was consumed, and
/// the connection can be received from again; more: the partial frame is discarded, its
/// descriptors closed, and the connection should be closed). A deadline already past still takes
/// a frame that is there.
pub fn recv_message_deadline(
    sock: BorrowedFd<'_>,
    policy: PeerPolicy,
    deadline: Instant,
) -> Result<Option<Incoming>> {
    recv_once(sock, policy, Some(deadline))
}

fn recv_once(
    sock: BorrowedFd<'_>,
    policy: PeerPolicy,
    deadline: Option<Instant>,
) -> Result<Option<Incoming>> {
    let mut reader = FrameReader::new();
    match reader.recv(sock, policy, deadline) {
        Err(e) if e.is_would_block() && reader.pending() > 0 => {
            Err(Error::Timeout { received: reader.pending(), expected: HEADER_LEN })
        }
        // Dropping the reader closes the descriptors of a partial frame.
        other => other,
    }
}

/// The most descriptors any message of the wire format carries; a frame that brings more is
/// refused as soon as they arrive.
const MOST_FDS: usize = 1;

/// A receiver that keeps a partial frame, and the descriptors that came with it, from one call to
/// the next: for event loops on non-blocking sockets and for callers that retry after a timeout.
/// [`GrowableImport`](super::GrowableImport) receives through one.
///
/// Use one reader per connection. Dropping it closes the descriptors of a partial frame.
#[derive(Debug)]
pub struct FrameReader {
    buf: [u8; HEADER_LEN],
    got: usize,
    // Every descriptor that arrives lands here first, so it is owned on every path.
    fds: Vec<OwnedFd>,
    /// The control data of each `recvmsg` (see [`control_buffer`]).
    control: Vec<u8>,
}

impl Default for FrameReader {
    fn default() -> FrameReader {
        FrameReader::new()
    }
}

impl FrameReader {
    /// A reader between frames.
    pub fn new() -> FrameReader {
        FrameReader { buf: [0; HEADER_LEN], got: 0, fds: Vec::new(), control: control_buffer() }
    }

    /// Bytes of a begun frame held: 0 between frames.
    pub fn pending(&self) -> usize {
        self.got
    }

    /// Receives one message as [`recv_message`] does (with a `deadline`, as
    /// [`recv_message_deadline`] does), except that a frame not yet complete is kept: on a
    /// non-blocking socket the call returns [`Error::Os`] with `EAGAIN`
    /// ([`Error::is_would_block`]), and when the socket's receive timeout or the deadline passes
    /// it returns [`Error::Timeout`]; either way the next call continues the frame. Any other
    /// error discards the partial frame and closes its descriptors.
    pub fn recv(
        &mut self,
        sock: BorrowedFd<'_>,
        policy: PeerPolicy,
        deadline: Option<Instant>,
    ) -> Result<Option<Incoming>> {
        let r = self.receive(sock, policy, deadline);
        if matches!(&r, Err(e) if !e.is_would_block() && !e.is_timeout()) {
            self.got = 0;
            self.fds.clear();
        }
        r
    }

    fn receive(
        &mut self,
        sock: BorrowedFd<'_>,
        policy: PeerPolicy,
        deadline: Option<Instant>,
    ) -> Result<Option<Incoming>> {
        let peer = check_peer(sock, policy)?;
        while self.got < HEADER_LEN {
            let flags = match deadline {
                Some(d) => {
                    if !wait_readable(sock, d)? {
                        return Err(Error::Timeout { received: self.got, expected: HEADER_LEN });
                    }
                    // poll said readable; never block past the deadline if another reader won.
                    MsgFlags::MSG_DONTWAIT
                }
                None => MsgFlags::empty(),
            };
            let into = &mut self.buf[self.got..];
            let chunk = match recv_chunk(sock, into, &mut self.control, &mut self.fds, flags) {
                Ok(c) => c,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) if deadline.is_some() => continue,
                Err(errno @ nix::errno::Errno::EAGAIN) => {
                    if self.got == 0 || is_nonblocking(sock)? {
                        return Err(Error::Os { call: "recvmsg", errno });
                    }
                    // A blocking socket returns EAGAIN only once its receive timeout passed.
                    return Err(Error::Timeout { received: self.got, expected: HEADER_LEN });
                }
                Err(errno) => return Err(Error::Os { call: "recvmsg", errno }),
            };
            if chunk.control_truncated {
                return Err(Error::refused(
                    Refusal::TooManyDescriptors,
                    format_args!(
                        "more ancillary data arrived than a message may carry (the {} descriptors that \
                     fitted are closed)",
                        self.fds.len()
                    ),
                ));
            }
            if self.fds.len() > MOST_FDS {
                // Refused as they arrive, not when the frame completes: a peer sending a byte at a
                // time with a full load of descriptors would park 143 x 253 of them here.
                return Err(Error::refused(
                    Refusal::TooManyDescriptors,
                    format_args!(
                        "{} descriptors arrived for one message, which carries at most {MOST_FDS} (closed)",
                        self.fds.len()
                    ),
                ));
            }
            if chunk.bytes == 0 && self.got == 0 && self.fds.is_empty() {
                return Ok(None);
            }
            if chunk.bytes == 0 {
                return Err(Error::PeerClosed { received: self.got, expected: HEADER_LEN });
            }
            self.got += chunk.bytes;
        }
        self.got = 0;
        let mut fds = std::mem::take(&mut self.fds);
        let message = Message::decode(&self.buf)?;
        if fds.len() != message.fd_count() {
            return Err(Error::Protocol(format!(
                "the {} message announces {} fd(s) but carried {}",
                message.kind(),
                message.fd_count(),
                fds.len()
            )));
        }
        Ok(Some(Incoming { message, fd: fds.pop(), peer }))
    }
}

fn is_nonblocking(sock: BorrowedFd<'_>) -> Result<bool> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(sock.as_raw_fd(), FcntlArg::F_GETFL)
        .map_err(|errno| Error::Os { call: "fcntl(F_GETFL)", errno })?;
    Ok(OFlag::from_bits_retain(flags).contains(OFlag::O_NONBLOCK))
}

/// Waits until `sock` has something to read (or has been closed), or `deadline` passes: `false`
/// then. A deadline already past still looks once.
fn wait_readable(sock: BorrowedFd<'_>, deadline: Instant) -> Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Rounded up, so that a wait never ends just before the deadline.
        let ms = PollTimeout::try_from(left.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX);
        match poll(&mut [PollFd::new(sock, PollFlags::POLLIN)], ms) {
            Ok(n) if n > 0 => return Ok(true),
            Ok(_) if Instant::now() >= deadline => return Ok(false),
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(errno) => return Err(Error::Os { call: "poll", errno }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    /// A control message as the kernel lays it out.
    fn cmsg(level: libc::c_int, kind: libc::c_int, data: &[u8]) -> Vec<u8> {
        cmsg_claiming(level, kind, data, CMSG_HDR + data.len())
    }

    /// A control message whose header claims `len` bytes, whatever it holds.
    fn cmsg_claiming(level: libc::c_int, kind: libc::c_int, data: &[u8], len: usize) -> Vec<u8> {
        // SAFETY: cmsghdr is plain data; all zeroes is a valid value.
        let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
        h.cmsg_len = len as _;
        h.cmsg_level = level;
        h.cmsg_type = kind;
        let mut out = vec![0u8; cmsg_space(data.len())];
        // SAFETY: `out` has room for a header; write_unaligned needs no alignment.
        unsafe { std::ptr::write_unaligned(out.as_mut_ptr().cast(), h) };
        out[CMSG_HDR..CMSG_HDR + data.len()].copy_from_slice(data);
        out
    }

    /// Fresh /dev/null descriptors, ownership given up (to the walk under test), and their bytes
    /// as SCM_RIGHTS data.
    fn raw_fds(n: usize) -> (Vec<RawFd>, Vec<u8>) {
        let raws: Vec<RawFd> =
            (0..n).map(|_| std::fs::File::open("/dev/null").unwrap().into_raw_fd()).collect();
        let bytes = raws.iter().flat_map(|r| r.to_ne_bytes()).collect();
        (raws, bytes)
    }

    fn is_open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD only asks about the number; it touches no descriptor's state.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        flags != -1
    }

    fn raw(fds: &[OwnedFd]) -> Vec<RawFd> {
        fds.iter().map(|f| f.as_raw_fd()).collect()
    }

    // Other tests of this binary open files concurrently, so these look at the descriptors by
    // number rather than counting /proc/self/fd.
    #[test]
    fn the_walk_owns_rights_closes_pidfds_and_survives_truncation_and_garbage() {
        let ucred = vec![0u8; std::mem::size_of::<libc::ucred>()];
        let (pid, pid_bytes) = raw_fds(1);
        let (rights, rights_bytes) = raw_fds(3);
        let mut control = cmsg(libc::SOL_SOCKET, libc::SCM_CREDENTIALS, &ucred);
        control.extend(cmsg(libc::SOL_SOCKET, SCM_PIDFD, &pid_bytes));
        control.extend(cmsg(libc::SOL_SOCKET, libc::SCM_RIGHTS, &rights_bytes));
        let mut fds = Vec::new();
        own_descriptors(&control, &mut fds);
        assert_eq!(raw(&fds), rights, "the rights are owned");
        assert!(!is_open(pid[0]), "the pidfd is closed");
        drop(fds);
        assert!(rights.iter().all(|&r| !is_open(r)));

        // Cut inside the rights: the header claims 4 fds, 2 and a half are present; the 2 whole
        // ones are owned. (The kernel never cuts fds in half; the walk must not care.)
        let (two, mut half) = raw_fds(2);
        half.extend([0xaa, 0xbb]);
        let claimed = CMSG_HDR + 4 * std::mem::size_of::<RawFd>();
        let mut cut = cmsg_claiming(libc::SOL_SOCKET, libc::SCM_RIGHTS, &half, claimed);
        cut.truncate(CMSG_HDR + half.len());
        let mut fds = Vec::new();
        own_descriptors(&cut, &mut fds);
        assert_eq!(raw(&fds), two);

        // Garbage: a zero length stops the walk; a partial header is ignored; other levels too;
        // a length running to the end of the address space ends it.
        let mut fds = Vec::new();
        own_descriptors(&[0u8; 40], &mut fds);
        own_descriptors(&[0xff; 7], &mut fds);
        own_descriptors(&cmsg(libc::IPPROTO_IP, libc::SCM_RIGHTS, &[1, 0, 0, 0]), &mut fds);
        own_descriptors(
            &cmsg_claiming(libc::SOL_SOCKET, libc::SCM_CREDENTIALS, &ucred, usize::MAX),
            &mut fds,
        );
        assert!(fds.is_empty());
    }

    #[test]
    fn the_control_buffer_is_as_long_as_the_room_the_kernel_is_given() {
        let control = control_buffer();
        // nix hands the kernel the capacity; the walk reads the length.
        assert_eq!(control.len(), control.capacity());
        assert!(control.len() >= CONTROL_LEN);
        assert!(control.iter().all(|&b| b == 0), "a zero header ends the walk");
    }

    #[test]
    fn the_control_buffer_holds_the_most_fds_with_credentials_and_a_pidfd() {
        let need = cmsg_space(253 * 4) + cmsg_space(std::mem::size_of::<libc::ucred>()) + cmsg_space(4);
        assert!(CONTROL_LEN >= need);
        // SAFETY: CMSG_SPACE is arithmetic on its argument.
        assert_eq!(cmsg_space(253 * 4), unsafe { libc::CMSG_SPACE(253 * 4) } as usize);
        // SAFETY: as above.
        assert_eq!(CMSG_HDR, unsafe { libc::CMSG_LEN(0) } as usize);
    }
}
