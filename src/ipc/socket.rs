//! Passing shared-allocation messages over Unix-domain sockets: the header as data, the fd as
//! SCM_RIGHTS ancillary data, the peer's credentials checked with SO_PEERCRED.

use super::wire::{Header, HEADER_LEN};
use crate::error::{Error, Result};
use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt::PeerCredentials, ControlMessage, ControlMessageOwned, MsgFlags,
};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Whose messages a receiver accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only a peer running as this process's own user (the default).
    #[default]
    SameUid,
    /// Only a peer running as this user id.
    Uid(u32),
    /// Anyone who can reach the socket.
    AnyUid,
}

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

/// A received message: the validated header and the fd it carried, if any.
///
/// Only [`recv`] makes one, so a `Received` always holds a header that passed validation and
/// exactly the descriptors that header announces; its parts can be read or taken, not replaced:
///
/// ```compile_fail,E0451
/// use cuvmm::ipc::{Credentials, Header, Received};
/// fn forge(header: Header, peer: Credentials) -> Received {
///     Received { header, fd: None, peer } // error: private fields
/// }
/// ```
#[derive(Debug)]
pub struct Received {
    header: Header,
    fd: Option<OwnedFd>,
    peer: Credentials,
}

impl Received {
    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Who sent it.
    pub fn peer(&self) -> Credentials {
        self.peer
    }

    /// The allocation's fd (POSIX-fd messages), close-on-exec.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// The header, the fd and the sender, for callers that import the allocation themselves.
    pub fn into_parts(self) -> (Header, Option<OwnedFd>, Credentials) {
        (self.header, self.fd, self.peer)
    }
}

/// The peer's credentials, checked against `policy`.
pub fn check_peer(sock: BorrowedFd<'_>, policy: PeerPolicy) -> Result<Credentials> {
    let c = getsockopt(&sock, PeerCredentials)
        .map_err(|errno| Error::Os { call: "getsockopt(SO_PEERCRED)", errno })?;
    let creds = Credentials { pid: c.pid(), uid: c.uid(), gid: c.gid() };
    let allowed = match policy {
        PeerPolicy::SameUid => creds.uid == nix::unistd::getuid().as_raw(),
        PeerPolicy::Uid(u) => creds.uid == u,
        PeerPolicy::AnyUid => true,
    };
    if !allowed {
        return Err(Error::Protocol(format!(
            "peer pid {} runs as uid {}, which the policy {policy:?} refuses",
            creds.pid, creds.uid
        )));
    }
    Ok(creds)
}

/// Sends `header`, with `fd` as SCM_RIGHTS when the header says one travels.
pub fn send(sock: BorrowedFd<'_>, header: &Header, fd: Option<BorrowedFd<'_>>) -> Result<()> {
    if header.fd_count() != usize::from(fd.is_some()) {
        return Err(Error::invalid(format!(
            "the header announces {} fd(s), {} given",
            header.fd_count(),
            usize::from(fd.is_some())
        )));
    }
    let bytes = header.encode()?;
    let fds: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs = if fds.is_empty() { vec![] } else { vec![ControlMessage::ScmRights(&fds)] };
    let mut sent = 0;
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        // The fds go with the first byte only.
        let c: &[ControlMessage<'_>] = if sent == 0 { &cmsgs } else { &[] };
        match sendmsg::<()>(sock.as_raw_fd(), &iov, c, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(errno) => return Err(Error::Os { call: "sendmsg", errno }),
        }
    }
    Ok(())
}

/// Receives one message: checks the peer against `policy`, reads exactly one header, takes
/// ownership of every fd that arrived (close-on-exec), and refuses the message (closing them all)
/// unless it is well formed and carries exactly the fds it announces.
pub fn recv(sock: BorrowedFd<'_>, policy: PeerPolicy) -> Result<Received> {
    let peer = check_peer(sock, policy)?;
    let mut buf = [0u8; HEADER_LEN];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while got < HEADER_LEN {
        // Room for the most fds Linux passes in one message (SCM_MAX_FD): the control data is then
        // never truncated, so every fd that arrives is seen, owned and, if unexpected, closed.
        let mut cmsg = nix::cmsg_space!([RawFd; 253]);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let msg = match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(errno) => return Err(Error::Os { call: "recvmsg", errno }),
        };
        let (n, truncated) = (msg.bytes, msg.flags.contains(MsgFlags::MSG_CTRUNC));
        for c in msg.cmsgs().map_err(|errno| Error::Os { call: "recvmsg (control data)", errno })? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just installed these descriptors in this process for us;
                // nothing else owns them.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        if truncated {
            return Err(Error::Protocol("more file descriptors arrived than a message may carry".into()));
        }
        if n == 0 {
            return Err(Error::Protocol(format!(
                "the peer closed the socket after {got} of {HEADER_LEN} header bytes"
            )));
        }
        got += n;
    }
    let header = Header::decode(&buf)?;
    if fds.len() != header.fd_count() {
        return Err(Error::Protocol(format!(
            "the message announces {} fd(s) but carried {}",
            header.fd_count(),
            fds.len()
        )));
    }
    Ok(Received { header, fd: fds.pop(), peer })
}
