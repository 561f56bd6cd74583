//! The socket transport on the CPU: fds over socketpairs, malformed messages, fd leaks, peers of
//! another uid.

mod common;

use cuvmm::ipc::wire::{Grow, HandleType, Header, Message, Region, WireHandle, HEADER_LEN};
use cuvmm::ipc::{recv_message, recv_message_deadline, send_message, FrameReader, Incoming, PeerPolicy};
use cuvmm::{Error, ErrorKind, Refusal};
use nix::sys::socket::{sendmsg, setsockopt, sockopt, ControlMessage, MsgFlags};
use std::io::{IoSlice, Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// fd counts are per process: these tests must not run concurrently.
static SERIAL: Mutex<()> = Mutex::new(());

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd(content: &[u8]) -> OwnedFd {
    let fd =
        nix::sys::memfd::memfd_create(c"cuvmm-test", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).unwrap();
    let mut f = std::fs::File::from(fd);
    f.write_all(content).unwrap();
    f.into()
}

/// Sends the share `h`, as `ipc::share` does.
fn send(sock: BorrowedFd<'_>, h: &Header, fd: Option<BorrowedFd<'_>>) -> cuvmm::Result<()> {
    send_message(sock, &Message::Share(*h), fd)
}

/// Receives one message, which must come before the end of the stream.
fn recv(sock: BorrowedFd<'_>, policy: PeerPolicy) -> cuvmm::Result<Incoming> {
    recv_message(sock, policy).map(|m| m.expect("a message before the end of the stream"))
}

/// [`recv`] with a deadline.
fn recv_deadline(sock: BorrowedFd<'_>, policy: PeerPolicy, deadline: Instant) -> cuvmm::Result<Incoming> {
    recv_message_deadline(sock, policy, deadline).map(|m| m.expect("a message before the end of the stream"))
}

fn header(handle: WireHandle) -> Header {
    Header::new(handle, 4 << 20, 2 << 20, 0, 4 << 20, [3; 16], 77).unwrap()
}

fn raw_send(sock: &UnixStream, bytes: &[u8], fds: &[i32]) {
    let cmsgs = if fds.is_empty() { vec![] } else { vec![ControlMessage::ScmRights(fds)] };
    sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(bytes)], &cmsgs, MsgFlags::empty(), None).unwrap();
}

#[test]
fn a_memfd_travels_with_its_header_and_arrives_close_on_exec() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    let fd = memfd(b"shared bytes");
    let h = header(WireHandle::PosixFd);
    send(a.as_fd(), &h, Some(fd.as_fd())).unwrap();
    let r = recv(b.as_fd(), PeerPolicy::SameUid).unwrap();
    assert_eq!(*r.share().unwrap(), h);
    assert_eq!(r.peer().pid, std::process::id() as i32);
    assert!(r.fd().is_some());
    let (_, got, _) = r.into_parts();
    let got = got.expect("an fd");
    let flags = nix::fcntl::fcntl(got.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
    assert!(flags & libc::FD_CLOEXEC != 0);
    let mut f = std::fs::File::from(got);
    f.rewind().unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "shared bytes");
    // Fabric messages carry no fd.
    let fh = header(WireHandle::Fabric([5; 64]));
    send(a.as_fd(), &fh, None).unwrap();
    let r = recv(b.as_fd(), PeerPolicy::AnyUid).unwrap();
    assert_eq!(*r.share().unwrap(), fh);
    assert!(r.fd().is_none());
    // The sender refuses a header whose fd count does not match.
    assert!(matches!(send(a.as_fd(), &fh, Some(fd.as_fd())), Err(Error::InvalidArgument(_))));
    assert!(matches!(send(a.as_fd(), &h, None), Err(Error::InvalidArgument(_))));
}

#[test]
fn extra_missing_and_malformed_messages_are_refused_without_leaking_fds() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    let (m1, m2) = (memfd(b"1"), memfd(b"2"));
    let good = header(WireHandle::PosixFd).encode().unwrap();
    let before = open_fds();
    // Two fds where one is announced.
    raw_send(&a, &good, &[m1.as_raw_fd(), m2.as_raw_fd()]);
    assert!(matches!(recv(b.as_fd(), PeerPolicy::SameUid), Err(e) if e.is_protocol()));
    // None where one is announced.
    raw_send(&a, &good, &[]);
    assert!(matches!(recv(b.as_fd(), PeerPolicy::SameUid), Err(e) if e.is_protocol()));
    // An fd with a fabric message.
    raw_send(&a, &header(WireHandle::Fabric([1; 64])).encode().unwrap(), &[m1.as_raw_fd()]);
    assert!(matches!(recv(b.as_fd(), PeerPolicy::SameUid), Err(e) if e.is_protocol()));
    // Wrong magic, wrong version, each with an fd that must be closed.
    let mut bad = good;
    bad[0] = b'Z';
    raw_send(&a, &bad, &[m1.as_raw_fd()]);
    assert!(matches!(recv(b.as_fd(), PeerPolicy::SameUid), Err(e) if e.is_protocol()));
    let mut bad = good;
    bad[8] = 9;
    raw_send(&a, &bad, &[m1.as_raw_fd()]);
    assert!(matches!(recv(b.as_fd(), PeerPolicy::SameUid), Err(e) if e.is_protocol()));
    // Many fds: more than a message may carry.
    let many: Vec<OwnedFd> = (0..12).map(|_| memfd(b"x")).collect();
    let raws: Vec<i32> = many.iter().map(|f| f.as_raw_fd()).collect();
    let before_many = open_fds();
    raw_send(&a, &good, &raws);
    assert!(recv(b.as_fd(), PeerPolicy::SameUid).is_err());
    assert_eq!(open_fds(), before_many, "received fds were not all closed");
    drop(many);
    assert_eq!(open_fds(), before, "received fds were not all closed");
    // A header cut short by the peer closing.
    raw_send(&a, &good[..HEADER_LEN / 2], &[]);
    drop(a);
    let r = recv(b.as_fd(), PeerPolicy::SameUid);
    assert!(
        matches!(r, Err(Error::PeerClosed { received, expected: HEADER_LEN }) if received == HEADER_LEN / 2),
        "{r:?}"
    );
}

fn grow(handle: WireHandle, offset: u64) -> Message {
    Message::Grow(Grow::new(handle, 2 << 20, 2 << 20, offset, [3; 16], 0).unwrap())
}

#[test]
fn growth_messages_travel_with_exactly_their_fds_and_a_close_between_messages_is_no_error() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    let fd = memfd(b"chunk");
    let before = open_fds();
    let region = Message::Region(Region::new(HandleType::PosixFd, 1 << 30, 2 << 20, [3; 16], 5).unwrap());
    let sent = [
        (region, None),
        (grow(WireHandle::PosixFd, 0), Some(fd.as_fd())),
        (Message::Shrink { length: 0, tag: 1 }, None),
        (Message::Note { tag: 42 }, None),
    ];
    for (m, f) in &sent {
        send_message(a.as_fd(), m, *f).unwrap();
    }
    for (m, f) in &sent {
        let got = recv_message(b.as_fd(), PeerPolicy::SameUid).unwrap().expect("a message");
        assert_eq!(got.message(), m);
        assert_eq!(got.fd().is_some(), f.is_some(), "{m:?}");
        assert_eq!(got.peer().pid, std::process::id() as i32);
        if let Some(fd) = got.fd() {
            let mut file = std::fs::File::from(fd.try_clone_to_owned().unwrap());
            file.rewind().unwrap();
            let mut s = String::new();
            file.read_to_string(&mut s).unwrap();
            assert_eq!(s, "chunk", "the chunk's fd arrives with its grow message");
        }
    }
    assert_eq!(open_fds(), before, "every received fd was closed with its message");
    // The sender refuses an fd a message does not announce, or a missing one.
    let refused = |m: &Message, f| matches!(send_message(a.as_fd(), m, f), Err(Error::InvalidArgument(_)));
    assert!(refused(&region, Some(fd.as_fd())), "a region carries no fd");
    assert!(refused(&grow(WireHandle::PosixFd, 0), None));
    assert!(refused(&grow(WireHandle::Fabric([1; 64]), 0), Some(fd.as_fd())));
    assert!(refused(&Message::Note { tag: 0 }, Some(fd.as_fd())));
    // The peer closing between messages is the end of the stream, not an error.
    drop(a);
    assert!(recv_message(b.as_fd(), PeerPolicy::SameUid).unwrap().is_none());
}

#[test]
fn growth_messages_with_the_wrong_fds_and_shares_expected_elsewhere_are_refused_without_leaks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    let m1 = memfd(b"1");
    let before = open_fds();
    let region = Message::Region(Region::new(HandleType::PosixFd, 1 << 30, 2 << 20, [3; 16], 5).unwrap())
        .encode()
        .unwrap();
    let posix_grow = grow(WireHandle::PosixFd, 0).encode().unwrap();
    let fabric_grow = grow(WireHandle::Fabric([1; 64]), 0).encode().unwrap();
    let note = Message::Note { tag: 1 }.encode().unwrap();
    for (what, bytes, fds) in [
        ("a region with an fd", &region, &[m1.as_raw_fd()][..]),
        ("a POSIX grow without its fd", &posix_grow, &[][..]),
        ("a POSIX grow with two fds", &posix_grow, &[m1.as_raw_fd(), m1.as_raw_fd()][..]),
        ("a fabric grow with an fd", &fabric_grow, &[m1.as_raw_fd()][..]),
        ("a note with an fd", &note, &[m1.as_raw_fd()][..]),
    ] {
        raw_send(&a, bytes, fds);
        match recv_message(b.as_fd(), PeerPolicy::SameUid) {
            Err(e) if e.is_protocol() => {}
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(open_fds(), before, "{what}: a received fd was left open");
    }
    // A valid grow arrives with its fd, which closes with it.
    send_message(a.as_fd(), &grow(WireHandle::PosixFd, 0), Some(m1.as_fd())).unwrap();
    let m = recv(b.as_fd(), PeerPolicy::SameUid).unwrap();
    assert!(matches!(m.message(), Message::Grow(_)) && m.share().is_none() && m.fd().is_some());
    drop(m);
    assert_eq!(open_fds(), before, "the grow's fd was left open");
    // A version-1 share, as an older sender writes it, is still received.
    let mut v1 = header(WireHandle::PosixFd).encode().unwrap();
    v1[8] = 1;
    raw_send(&a, &v1, &[m1.as_raw_fd()]);
    assert_eq!(*recv(b.as_fd(), PeerPolicy::SameUid).unwrap().share().unwrap(), header(WireHandle::PosixFd));
    assert_eq!(open_fds(), before);
    // A frame cut short is an error, not the end of the stream.
    raw_send(&a, &note[..70], &[]);
    drop(a);
    match recv_message(b.as_fd(), PeerPolicy::SameUid) {
        Err(Error::PeerClosed { received: 70, expected: 144 }) => {}
        other => panic!("a cut frame: {other:?}"),
    }
}

/// The receiver of a socket pair with SO_PASSCRED set: the kernel then puts the sender's
/// credentials into the control data, before any fds.
fn pair_passing_credentials() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    setsockopt(&b, sockopt::PassCred, &true).unwrap();
    (a, b)
}

#[test]
fn with_credentials_passed_every_fd_count_up_to_the_maximum_is_closed_or_kept_never_leaked() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devnull: Vec<std::fs::File> = (0..253).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
    let raws: Vec<i32> = devnull.iter().map(|f| f.as_raw_fd()).collect();
    let (a, b) = pair_passing_credentials();
    let good = header(WireHandle::PosixFd);
    let before = open_fds();
    let counts = [0, 1, 2, 252, 253].into_iter().chain(std::iter::repeat_n(253, 10));
    for n in counts {
        raw_send(&a, &good.encode().unwrap(), &raws[..n]);
        match (n, recv(b.as_fd(), PeerPolicy::SameUid)) {
            (1, Ok(m)) => {
                assert_eq!(*m.share().unwrap(), good);
                assert!(m.fd().is_some());
                assert_eq!(open_fds(), before + 1, "the one fd is kept, nothing else");
            }
            (1, Err(e)) => panic!("a valid message with credentials was refused: {e}"),
            (_, Err(e)) if e.is_protocol() => {}
            (_, other) => panic!("{n} fds: expected a protocol error, got {other:?}"),
        }
        assert_eq!(open_fds(), before, "{n} fds: received descriptors were left open");
    }
}

#[test]
fn a_split_message_with_credentials_passed_still_arrives() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair_passing_credentials();
    let fd = memfd(b"split");
    let h = header(WireHandle::PosixFd);
    let bytes = h.encode().unwrap();
    let before = open_fds();
    raw_send(&a, &bytes[..10], &[fd.as_raw_fd()]);
    raw_send(&a, &bytes[10..], &[]);
    let m = recv(b.as_fd(), PeerPolicy::SameUid).unwrap();
    assert_eq!(*m.share().unwrap(), h);
    assert_eq!(open_fds(), before + 1);
    drop(m);
    assert_eq!(open_fds(), before);
}

/// `SO_PASSPIDFD` (Linux 6.5): the kernel then installs a pidfd of the sender with every message.
const SO_PASSPIDFD: libc::c_int = 76;

/// Linux's version as (major, minor), from uname.
fn kernel_version() -> (u32, u32) {
    // SAFETY: utsname is plain data; uname fills it, NUL-terminated.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a live utsname.
    assert_eq!(unsafe { libc::uname(&mut u) }, 0);
    // SAFETY: uname NUL-terminates the release.
    let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned();
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

#[test]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    ignore = "SO_PASSPIDFD has another number on this architecture"
)]
fn a_pidfd_the_kernel_attaches_is_closed_not_counted() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair_passing_credentials();
    let on: libc::c_int = 1;
    // SAFETY: `on` is a live c_int and the length says so; `b` is an open socket.
    let rc = unsafe {
        libc::setsockopt(
            b.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PASSPIDFD,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        // Only a kernel older than 6.5 lacks it; the checks below then run with credentials alone
        // (the control-data walk's unit test covers the pidfd itself).
        let err = std::io::Error::last_os_error();
        assert_eq!(err.raw_os_error(), Some(libc::ENOPROTOOPT), "{err}");
        assert!(kernel_version() < (6, 5), "Linux {:?} refused SO_PASSPIDFD", kernel_version());
    }
    let fd = memfd(b"pid");
    let h = header(WireHandle::PosixFd);
    let before = open_fds();
    for _ in 0..3 {
        send(a.as_fd(), &h, Some(fd.as_fd())).unwrap();
        let m = recv(b.as_fd(), PeerPolicy::SameUid).unwrap();
        assert_eq!(open_fds(), before + 1, "only the message's fd is kept");
        drop(m);
        assert_eq!(open_fds(), before, "the pidfd leaked");
        // Refused messages close it too.
        raw_send(&a, &h.encode().unwrap(), &[]);
        assert!(matches!(recv(b.as_fd(), PeerPolicy::SameUid), Err(e) if e.is_protocol()));
        assert_eq!(open_fds(), before, "the pidfd leaked");
    }
}

/// Runs `f` on a thread of its own and returns what it returned, or fails the test when it has not
/// returned within `limit`: a receive that hangs is a failure, not a hung test run.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("still waiting after {limit:?}: the receive hangs"))
}

fn with_receive_timeout(sock: &UnixStream, t: Duration) {
    sock.set_read_timeout(Some(t)).unwrap();
}

fn timed_out(r: &cuvmm::Result<impl std::fmt::Debug>, bytes: usize) -> bool {
    matches!(r, Err(Error::Timeout { received, expected: HEADER_LEN }) if *received == bytes)
}

#[test]
fn one_byte_then_silence_times_out_on_a_socket_with_a_receive_timeout_and_closes_its_fd() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    with_receive_timeout(&b, Duration::from_millis(100));
    let fd = memfd(b"x");
    let bytes = header(WireHandle::PosixFd).encode().unwrap();
    let before = open_fds();
    // The descriptor comes with the one byte, as a real sender's would.
    raw_send(&a, &bytes[..1], &[fd.as_raw_fd()]);
    let (b, r, took) = within(Duration::from_secs(10), move || {
        let t = Instant::now();
        let r = recv_message(b.as_fd(), PeerPolicy::SameUid);
        (b, r, t.elapsed())
    });
    assert!(timed_out(&r, 1), "{r:?}");
    assert!(r.unwrap_err().is_timeout());
    assert!(took >= Duration::from_millis(90) && took < Duration::from_secs(5), "{took:?}");
    assert_eq!(open_fds(), before, "the partial frame's descriptor was left open");
    // `recv` the same way, with nothing at all first: that is "try again", consuming nothing.
    let (b, r) = within(Duration::from_secs(10), move || {
        let r = recv(b.as_fd(), PeerPolicy::SameUid);
        (b, r)
    });
    assert!(matches!(&r, Err(e) if e.is_would_block()), "{r:?}");
    raw_send(&a, &bytes[..70], &[]);
    let (_b, r) = within(Duration::from_secs(10), move || {
        let r = recv(b.as_fd(), PeerPolicy::SameUid);
        (b, r)
    });
    assert!(timed_out(&r, 70), "{r:?}");
    drop(a);
}

#[test]
fn a_partial_frame_on_a_non_blocking_socket_is_an_error_at_once_or_kept_by_a_frame_reader() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    b.set_nonblocking(true).unwrap();
    let fd = memfd(b"kept");
    let h = header(WireHandle::PosixFd);
    let bytes = h.encode().unwrap();
    let before = open_fds();
    // Nothing there: "try again".
    let r = recv_message(b.as_fd(), PeerPolicy::SameUid);
    assert!(matches!(&r, Err(e) if e.is_would_block()), "{r:?}");
    // A begun frame, through the stateless call: a timeout at once, the descriptor closed.
    raw_send(&a, &bytes[..1], &[fd.as_raw_fd()]);
    let (b, r) = within(Duration::from_secs(10), move || {
        let r = recv_message(b.as_fd(), PeerPolicy::SameUid);
        (b, r)
    });
    assert!(timed_out(&r, 1), "{r:?}");
    assert_eq!(open_fds(), before, "the partial frame's descriptor was left open");

    // Through a reader, the part is kept (with its descriptor) and the rest completes it.
    let mut reader = FrameReader::new();
    raw_send(&a, &bytes[..1], &[fd.as_raw_fd()]);
    let (b, mut reader, r) = within(Duration::from_secs(10), move || {
        let r = reader.recv(b.as_fd(), PeerPolicy::SameUid, None).map(|m| m.is_some());
        (b, reader, r)
    });
    assert!(matches!(&r, Err(e) if e.is_would_block()), "{r:?}");
    assert_eq!(reader.pending(), 1);
    assert_eq!(open_fds(), before + 1, "the reader holds the descriptor that came");
    raw_send(&a, &bytes[1..100], &[]);
    let r = reader.recv(b.as_fd(), PeerPolicy::SameUid, None);
    assert!(matches!(&r, Err(e) if e.is_would_block()), "{r:?}");
    assert_eq!(reader.pending(), 100);
    raw_send(&a, &bytes[100..], &[]);
    let m = reader.recv(b.as_fd(), PeerPolicy::SameUid, None).unwrap().expect("a message");
    assert_eq!(*m.message(), Message::Share(h));
    assert!(m.fd().is_some());
    assert_eq!(reader.pending(), 0);
    drop(m);
    assert_eq!(open_fds(), before);
    // A reader dropped inside a frame closes what it held.
    raw_send(&a, &bytes[..5], &[fd.as_raw_fd()]);
    let r = reader.recv(b.as_fd(), PeerPolicy::SameUid, None);
    assert!(matches!(&r, Err(e) if e.is_would_block()) && reader.pending() == 5, "{r:?}");
    drop(reader);
    assert_eq!(open_fds(), before, "a dropped reader left a descriptor open");
}

/// A peer that sends a frame a byte at a time, each byte with descriptors, parked up to 143 x 253
/// of them in the receiver's partial frame before it completed. No message carries more than one:
/// more are refused, and closed, as they arrive.
#[test]
fn descriptors_beyond_what_a_message_carries_are_refused_as_they_arrive() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    b.set_nonblocking(true).unwrap();
    let fds: Vec<OwnedFd> = (0..4).map(|_| memfd(b"x")).collect();
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let bytes = header(WireHandle::PosixFd).encode().unwrap();
    let before = open_fds();
    let mut reader = FrameReader::new();
    // One descriptor with the first byte: what a share carries, kept.
    raw_send(&a, &bytes[..1], &raw[..1]);
    let r = reader.recv(b.as_fd(), PeerPolicy::SameUid, None);
    assert!(matches!(&r, Err(e) if e.is_would_block()), "{r:?}");
    assert_eq!((reader.pending(), open_fds()), (1, before + 1));
    // Three more with the next byte: refused at once, every one closed, the frame discarded.
    raw_send(&a, &bytes[1..2], &raw[1..]);
    let r = reader.recv(b.as_fd(), PeerPolicy::SameUid, None);
    assert!(matches!(&r, Err(e) if e.kind() == ErrorKind::Refused(Refusal::TooManyDescriptors)), "{r:?}");
    assert_eq!((reader.pending(), open_fds()), (0, before));
}

#[test]
fn an_explicit_deadline_bounds_a_blocking_socket_and_a_timeout_before_a_frame_consumes_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    let fd = memfd(b"d");
    let h = header(WireHandle::PosixFd);
    let bytes = h.encode().unwrap();
    let before = open_fds();
    // Silence from the start: a timeout with nothing consumed, and the connection goes on.
    let (b, r, took) = within(Duration::from_secs(10), move || {
        let t = Instant::now();
        let r = recv_message_deadline(b.as_fd(), PeerPolicy::SameUid, t + Duration::from_millis(100));
        (b, r, t.elapsed())
    });
    assert!(timed_out(&r, 0), "{r:?}");
    assert!(took >= Duration::from_millis(100) && took < Duration::from_secs(5), "{took:?}");
    send(a.as_fd(), &h, Some(fd.as_fd())).unwrap();
    // A deadline already past still takes a frame that is there.
    let m = recv_deadline(b.as_fd(), PeerPolicy::SameUid, Instant::now()).unwrap();
    assert_eq!(*m.share().unwrap(), h);
    drop(m);
    // One byte and its descriptor, then silence.
    raw_send(&a, &bytes[..1], &[fd.as_raw_fd()]);
    let (b, r, took) = within(Duration::from_secs(10), move || {
        let t = Instant::now();
        let r = recv_deadline(b.as_fd(), PeerPolicy::SameUid, t + Duration::from_millis(100));
        (b, r, t.elapsed())
    });
    assert!(timed_out(&r, 1), "{r:?}");
    assert!(took >= Duration::from_millis(100) && took < Duration::from_secs(5), "{took:?}");
    assert_eq!(open_fds(), before, "the partial frame's descriptor was left open");
    // A reader with a deadline keeps the part; the rest, sent later, completes it.
    raw_send(&a, &bytes[..1], &[fd.as_raw_fd()]);
    let (b, mut reader, r) = within(Duration::from_secs(10), move || {
        let mut reader = FrameReader::new();
        let d = Instant::now() + Duration::from_millis(50);
        let r = reader.recv(b.as_fd(), PeerPolicy::SameUid, Some(d)).map(|m| m.is_some());
        (b, reader, r)
    });
    assert!(timed_out(&r, 1), "{r:?}");
    raw_send(&a, &bytes[1..], &[]);
    let d = Instant::now() + Duration::from_secs(5);
    let m = reader.recv(b.as_fd(), PeerPolicy::SameUid, Some(d)).unwrap().expect("a message");
    assert_eq!((*m.message(), m.fd().is_some()), (Message::Share(h), true));
    drop(m);
    assert_eq!(open_fds(), before);
}

#[test]
fn a_frame_completed_after_a_pause_still_decodes_with_a_timeout_or_deadline_longer_than_the_pause() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = header(WireHandle::PosixFd);
    let bytes = h.encode().unwrap();
    for how in ["blocking", "receive timeout", "deadline"] {
        let (a, b) = UnixStream::pair().unwrap();
        if how == "receive timeout" {
            with_receive_timeout(&b, Duration::from_secs(2));
        }
        let fd = memfd(b"p");
        raw_send(&a, &bytes[..10], &[fd.as_raw_fd()]);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            raw_send(&a, &bytes[10..100], &[]);
            std::thread::sleep(Duration::from_millis(150));
            raw_send(&a, &bytes[100..], &[]);
            a
        });
        let r = within(Duration::from_secs(10), move || {
            let r = if how == "deadline" {
                recv_deadline(b.as_fd(), PeerPolicy::SameUid, Instant::now() + Duration::from_secs(2))
            } else {
                recv(b.as_fd(), PeerPolicy::SameUid)
            };
            r.map(|m| (*m.share().unwrap(), m.fd().is_some()))
        });
        assert_eq!(r.unwrap(), (h, true), "{how}");
        drop(writer.join().unwrap());
    }
}

const CHILD_ENV: &str = "CUVMM_TEST_UID_CHILD_SOCKET";

#[test]
fn a_peer_of_another_uid_is_refused() {
    if let Some(path) = std::env::var_os(CHILD_ENV) {
        // The copy of this test that it started as another uid: connects and sends one message.
        let s = UnixStream::connect(path).unwrap();
        send(s.as_fd(), &header(WireHandle::Fabric([2; 64])), None).unwrap();
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let me = nix::unistd::getuid().as_raw();
    if me != 0 {
        // Not root: no process of another uid can be started, so check the policy against our own
        // uid seen as a stranger's.
        let (a, b) = UnixStream::pair().unwrap();
        send(a.as_fd(), &header(WireHandle::Fabric([2; 64])), None).unwrap();
        let r = recv(b.as_fd(), PeerPolicy::Uid(me + 1));
        assert!(matches!(r, Err(Error::PeerRefused { uid, .. }) if uid == me), "{r:?}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("cuvmm-uid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let path = dir.join("sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    for (policy, accept) in
        [(PeerPolicy::SameUid, false), (PeerPolicy::Uid(65534), true), (PeerPolicy::AnyUid, true)]
    {
        let mut child = common::rerun_this_test()
            .env(CHILD_ENV, &path)
            .uid(65534)
            .gid(65534)
            // The child is this test binary: its own report would mix into ours.
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (conn, _) = listener.accept().unwrap();
        let r = recv(conn.as_fd(), policy);
        assert!(child.wait().unwrap().success());
        match (r, accept) {
            (Ok(m), true) => assert_eq!(m.peer().uid, 65534),
            (Err(Error::PeerRefused { uid: 65534, policy: refused, .. }), false) => {
                assert_eq!(refused, policy)
            }
            (other, _) => panic!("policy {policy:?}: unexpected {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

const SETUID_CHILD_ENV: &str = "CUVMM_TEST_SETUID_CHILD";

/// The child of `same_uid_means_the_effective_uid_of_both_sides`, in the copy of it the test
/// started: as a set-uid-root program runs (real uid 65534, effective 0), receives a message from
/// a peer whose effective uid is 0.
fn setuid_child() {
    let (a, b) = UnixStream::pair().unwrap();
    nix::unistd::setresuid(65534.into(), 0.into(), 0.into()).unwrap();
    assert_eq!((nix::unistd::getuid().as_raw(), nix::unistd::geteuid().as_raw()), (65534, 0));
    send(a.as_fd(), &header(WireHandle::Fabric([2; 64])), None).unwrap();
    let m = recv(b.as_fd(), PeerPolicy::SameUid).expect("a peer of our effective uid is accepted");
    assert_eq!(m.peer().uid, 0);
    println!("setuid child: accepted");
}

/// Run as root: `.ci/run` runs it with `--ignored` when it is.
#[test]
#[ignore = "needs root, to set real and effective uids apart"]
fn same_uid_means_the_effective_uid_of_both_sides() {
    if std::env::var_os(SETUID_CHILD_ENV).is_some() {
        return setuid_child();
    }
    // The child's pipes are descriptors of this process too.
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(nix::unistd::geteuid().is_root(), "needs root, to set real and effective uids apart");
    let out = common::rerun_this_test().env(SETUID_CHILD_ENV, "1").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("setuid child: accepted"),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

use std::os::unix::process::CommandExt;
