//! The hand-off's transport: abstract `SOCK_SEQPACKET` Unix sockets (one record per message, its
//! descriptors with it), every socket and received descriptor close-on-exec, and each peer known
//! by a pidfd as well as its credentials, so that what it holds is let go only once it is gone.

use super::frame::{Frame, FDS_PER_MESSAGE, MAX_MESSAGE};
use crate::error::{Error, Result};
use nix::errno::Errno;
use nix::sys::socket::{
    self, getsockopt, sockopt::PeerCredentials, AddressFamily, Backlog, ControlMessage, ControlMessageOwned,
    MsgFlags, SockFlag, SockType, UnixAddr,
};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

fn os(call: &'static str) -> impl Fn(Errno) -> Error {
    move |errno| Error::Os { call, errno }
}

/// A new listening socket at the abstract `name` (a name in no filesystem, gone with the
/// process), non-blocking.
pub(crate) fn listen(name: &[u8]) -> Result<OwnedFd> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(os("socket"))?;
    let addr = UnixAddr::new_abstract(name).map_err(os("the hand-off's address"))?;
    socket::bind(fd.as_raw_fd(), &addr).map_err(os("bind"))?;
    // Deep enough for every process of a host connecting at once; a full backlog only delays a
    // connect (see `connect`).
    socket::listen(&fd, Backlog::new(256).unwrap_or(Backlog::MAXCONN)).map_err(os("listen"))?;
    Ok(fd)
}

/// The next connection waiting on `listener`, non-blocking; `None` when there is none.
pub(crate) fn accept(listener: BorrowedFd<'_>) -> Result<Option<OwnedFd>> {
    match socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK) {
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        Ok(fd) => Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) })),
        Err(Errno::EAGAIN | Errno::ECONNABORTED | Errno::EINTR) => Ok(None),
        Err(e) => Err(Error::Os { call: "accept4", errno: e }),
    }
}

/// A connection to the abstract `name`, made by `deadline`. A listener whose backlog is full (any
/// local user can fill it) delays the connection, it does not fail it.
pub(crate) fn connect(name: &[u8], deadline: Instant) -> Result<OwnedFd> {
    let addr = UnixAddr::new_abstract(name).map_err(os("the hand-off's address"))?;
    let mut pause = Duration::from_micros(50);
    loop {
        let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
            .map_err(os("socket"))?;
        // Blocking, for as long as is left: a Unix-socket connect to a full backlog waits for
        // room up to the socket's send timeout, then says EAGAIN.
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let tv = nix::sys::time::TimeVal::new(left.as_secs() as _, left.subsec_micros() as _);
        socket::setsockopt(&fd, socket::sockopt::SendTimeout, &tv).map_err(os("setsockopt(SO_SNDTIMEO)"))?;
        match socket::connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                socket::setsockopt(&fd, socket::sockopt::SndBuf, &(1 << 20)).ok();
                nonblocking(fd.as_fd())?;
                return Ok(fd);
            }
            Err(Errno::EAGAIN | Errno::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_millis(5));
            }
            Err(Errno::EAGAIN) => return Err(Error::Timeout { received: 0, expected: 1 }),
            Err(e) => return Err(Error::Os { call: "connect to the sending process", errno: e }),
        }
    }
}

fn nonblocking(fd: BorrowedFd<'_>) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(os("fcntl"))?);
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(os("fcntl"))?;
    Ok(())
}

/// Who is at the other end of a connection, and a pidfd that says when that process is gone.
#[derive(Debug)]
pub(crate) struct Peer {
    /// Its pid, as this process sees it.
    pub pid: i32,
    /// Readable once the process has exited (after the kernel closed its descriptors).
    pub pidfd: OwnedFd,
}

/// Checks the process at the other end of `sock`: it runs as this process's effective uid, is
/// visible in this PID namespace (a pid of 0 means it is not, and nothing else could vouch for
/// it), and, when `expect` is given, is the process that names itself so (its own pid). Returns
/// it with a pidfd.
pub(crate) fn peer(sock: BorrowedFd<'_>, expect: Option<u32>) -> Result<Peer> {
    let c = getsockopt(&sock, PeerCredentials).map_err(os("getsockopt(SO_PEERCRED)"))?;
    let (pid, uid) = (c.pid(), c.uid());
    let me = nix::unistd::geteuid().as_raw();
    if uid != me || pid <= 0 {
        return Err(Error::Protocol(format!(
            "refusing the peer pid {pid} running as uid {uid}: only a process of uid {me} visible in this PID \
             namespace takes part in a hand-off"
        )));
    }
    // The kernel's own pidfd of the peer (Linux 6.5) names the process that connected, whatever
    // became of its pid since; older kernels get one by pid, which a pid reused in between (the
    // peer gone at once, its number given to another process) would misname.
    let pidfd = match peer_pidfd(sock)? {
        Some(fd) => fd,
        None => pidfd_open(pid)?,
    };
    if !alive(pidfd.as_fd()) {
        return Err(Error::Protocol(format!("the peer pid {pid} exited while it connected")));
    }
    if let Some(want) = expect {
        let own = own_pid(pid);
        if own != want as i32 {
            return Err(Error::Protocol(format!(
                "refusing the hand-off: its address is answered by pid {pid} (pid {own} in its own namespace), \
                 not by the sending process {want} (it exited, and another took its address?)"
            )));
        }
    }
    Ok(Peer { pid, pidfd })
}

/// `SO_PEERPIDFD`: a pidfd of the socket's peer, or `None` where the kernel has no such option.
fn peer_pidfd(sock: BorrowedFd<'_>) -> Result<Option<OwnedFd>> {
    const SO_PEERPIDFD: libc::c_int = 77;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` and `len` are valid for writing an int and its length, as the option returns.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return match Errno::last() {
            Errno::ENOPROTOOPT | Errno::EINVAL => Ok(None),
            e => Err(Error::Os { call: "getsockopt(SO_PEERPIDFD)", errno: e }),
        };
    }
    // SAFETY: a new descriptor the kernel installed for this process.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; nothing is
    // passed by pointer. (No wrapper in libc or nix for this Linux 5.3 call.)
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Error::Os { call: "pidfd_open", errno: Errno::last() });
    }
    // SAFETY: a new descriptor that nothing else owns (pidfds are close-on-exec).
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the process behind `pidfd` is still running.
pub(crate) fn alive(pidfd: BorrowedFd<'_>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(pidfd, PollFlags::POLLIN)];
    !matches!(poll(&mut p, PollTimeout::ZERO), Ok(1))
}

/// The pid `pid` has in its own PID namespace (what it calls itself), from `/proc`.
fn own_pid(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("NSpid:"))
                .and_then(|l| l.split_whitespace().last()?.parse().ok())
        })
        .unwrap_or(pid)
}

/// Sends one message with its descriptors, without blocking: `Ok(false)` when the socket is full
/// (nothing sent). A peer that has gone is an error, never a signal.
pub(crate) fn send(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[RawFd]) -> Result<bool> {
    let iov = [IoSlice::new(bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
    loop {
        match socket::sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, flags, None) {
            Ok(_) => return Ok(true),
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => return Ok(false),
            Err(e) => return Err(Error::Os { call: "sendmsg", errno: e }),
        }
    }
}

/// One message received without blocking, decoded, with the descriptors that came with it
/// (close-on-exec, owned: closed if the message is refused). `Ok(None)`: nothing there. A peer
/// that closed its end is [`Error::PeerClosed`].
pub(crate) fn recv(sock: BorrowedFd<'_>) -> Result<Option<(Frame, Vec<OwnedFd>)>> {
    let mut buf = [0u8; MAX_MESSAGE + 1];
    let mut cmsg = nix::cmsg_space!([RawFd; FDS_PER_MESSAGE + 3]);
    let flags = MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT;
    let (n, fds, cut) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match socket::recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), flags) {
            Ok(m) => {
                let mut fds = Vec::new();
                for c in m.cmsgs().map_err(os("recvmsg"))? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: descriptors the kernel just installed for this process.
                        fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                    }
                }
                let cut = m.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                break (m.bytes, fds, cut);
            }
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => return Ok(None),
            Err(e) => return Err(Error::Os { call: "recvmsg", errno: e }),
        }
    };
    if n == 0 && fds.is_empty() && !cut {
        return Err(Error::PeerClosed { received: 0, expected: 0 });
    }
    if cut {
        return Err(Error::Protocol("a hand-off message or its descriptors were cut short".into()));
    }
    let frame = Frame::decode(&buf[..n], fds.len())?;
    Ok(Some((frame, fds)))
}

/// A pipe whose write end wakes a thread polling its read end.
pub(crate) struct Wake {
    read: OwnedFd,
    write: OwnedFd,
}

impl Wake {
    pub(crate) fn new() -> Result<Wake> {
        use nix::fcntl::OFlag;
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(os("pipe2"))?;
        Ok(Wake { read, write })
    }

    pub(crate) fn wake(&self) {
        // A full pipe wakes the thread as well as one more byte would.
        let _ = nix::unistd::write(&self.write, &[1]);
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }

    pub(crate) fn drain(&self) {
        let mut b = [0u8; 64];
        while matches!(nix::unistd::read(self.read.as_raw_fd(), &mut b), Ok(n) if n > 0) {}
    }
}

/// Slots the descriptor table is grown to ahead of a first hand-off.
const FD_SLOTS: i32 = 4096;

/// Raises the soft limit on open descriptors to the hard one (a hand-off of a large group holds
/// one descriptor per page for a moment), and grows the descriptor table to [`FD_SLOTS`] slots
/// or the limit. Linux grows the table of a process with several threads only after an RCU grace
/// period: a first hand-off that grew it several times on each side waited tens of milliseconds.
/// Called on the hand-off's own threads as they start, so that nobody waits for it; `any` is
/// any open descriptor.
pub(crate) fn make_fd_room(any: BorrowedFd<'_>) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    let soft =
        if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() { hard } else { soft };
    let slots = FD_SLOTS.min(i32::try_from(soft).unwrap_or(i32::MAX));
    // The lowest free descriptor at or above the last slot: the table grows to hold it.
    if let Ok(fd) = nix::fcntl::fcntl(any.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(slots - 1)) {
        let _ = nix::unistd::close(fd);
    }
}
