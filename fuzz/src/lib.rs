//! The input layouts of the fuzz targets, decoded by the targets and encoded by the seed
//! generator, so that checked-in seeds always mean what their names say.
//!
//! Seeds live in `fuzz/seeds/TARGET`. They are generated, not edited: the test
//! `seeds::checked_in_seeds_are_current` fails when they differ from what [`seeds`] makes, and
//! `CUVMM_WRITE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml --lib` rewrites them.

use cuvmm::ipc::handoff::{Frame, Ticket};
use cuvmm::ipc::wire::{Grow, HandleType, Header, Message, Region, WireHandle, HEADER_LEN};
use cuvmm::ipc::{RegionLayout, Step};

/// The most descriptors Linux passes in one message (SCM_MAX_FD).
pub const MAX_FDS: usize = 253;

/// `SO_PASSPIDFD` (Linux 6.5) on x86-64 and Arm: the kernel then attaches a pidfd of the sender
/// to every message. Not in every libc release, so spelled out here.
pub const SO_PASSPIDFD: libc::c_int = 76;

/// One run of the `recv` target: what the sender does and how the receiver's socket is set up.
///
/// Byte layout (inputs shorter than 3 bytes read as if padded with zeroes):
///
/// | byte | meaning |
/// |---|---|
/// | 0 | number of descriptors sent, modulo 254 (0 to 253, the kernel's maximum) |
/// | 1 | flags: bit 0 `SO_PASSCRED` on the receiver; bit 1 send the stream in two `sendmsg` calls; bit 2 the descriptors travel with the second call instead of the first; bit 3 `SO_PASSPIDFD` on the receiver; bit 4 the sender pauses, silent, after the first call (the whole stream without bit 1) while the receiver tries once; bit 5 a receive timeout (`SO_RCVTIMEO`) of 1 ms on the receiver; bit 6 the receiver's socket is non-blocking; bit 7 the receiver gives a deadline 1 ms away (always, with bit 4 and neither bit 5 nor 6) |
/// | 2 | split point: with bit 1, the first call sends this many stream bytes (at most all) |
/// | 3.. | the stream bytes the receiver reads (a 144-byte frame of any kind, or anything) |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvInput {
    /// Descriptors sent (0..=253), all `/dev/null`.
    pub fds: usize,
    /// `SO_PASSCRED` on the receiving socket: the kernel adds credentials to the control data.
    pub pass_cred: bool,
    /// `SO_PASSPIDFD` on the receiving socket: the kernel adds a pidfd to the control data.
    pub pass_pidfd: bool,
    /// Two sends, the first of this many bytes; `None` for one send.
    pub split_at: Option<u8>,
    /// With a split, the descriptors go with the second send.
    pub fds_with_second: bool,
    /// The sender falls silent after its first send, connected, while the receiver tries once
    /// through a [`cuvmm::ipc::FrameReader`], bounded by the options below; then it sends the rest,
    /// closes, and the same reader receives again. Without it the sender sends everything and
    /// closes before the receiver starts.
    pub pause: bool,
    /// `SO_RCVTIMEO` of 1 ms on the receiving socket.
    pub receive_timeout: bool,
    /// `O_NONBLOCK` on the receiving socket.
    pub nonblocking: bool,
    /// The receiver gives a deadline 1 ms after it starts each call.
    pub deadline: bool,
    /// What the receiver reads.
    pub stream: Vec<u8>,
}

const PASS_CRED: u8 = 1 << 0;
const SPLIT: u8 = 1 << 1;
const FDS_WITH_SECOND: u8 = 1 << 2;
const PASS_PIDFD: u8 = 1 << 3;
const PAUSE: u8 = 1 << 4;
const RECEIVE_TIMEOUT: u8 = 1 << 5;
const NONBLOCKING: u8 = 1 << 6;
const DEADLINE: u8 = 1 << 7;

/// How long a bounded receive of the `recv` target waits: the receive timeout and the deadline.
pub const BOUND: std::time::Duration = std::time::Duration::from_millis(1);

impl RecvInput {
    /// A message sent in one piece, with `fds` descriptors, to a receiver with default options.
    pub fn new(stream: impl Into<Vec<u8>>, fds: usize) -> RecvInput {
        RecvInput {
            fds,
            pass_cred: false,
            pass_pidfd: false,
            split_at: None,
            fds_with_second: false,
            pause: false,
            receive_timeout: false,
            nonblocking: false,
            deadline: false,
            stream: stream.into(),
        }
    }

    /// Decodes any bytes (see the layout above).
    pub fn decode(data: &[u8]) -> RecvInput {
        let at = |i: usize| data.get(i).copied().unwrap_or(0);
        let flags = at(1);
        let split = flags & SPLIT != 0;
        let pause = flags & PAUSE != 0;
        let (receive_timeout, nonblocking) = (flags & RECEIVE_TIMEOUT != 0, flags & NONBLOCKING != 0);
        RecvInput {
            fds: usize::from(at(0)) % (MAX_FDS + 1),
            pass_cred: flags & PASS_CRED != 0,
            pass_pidfd: flags & PASS_PIDFD != 0,
            split_at: split.then(|| at(2)),
            fds_with_second: split && flags & FDS_WITH_SECOND != 0,
            pause,
            receive_timeout,
            nonblocking,
            // A paused sender is silent: the receiver must be bounded somehow.
            deadline: flags & DEADLINE != 0 || (pause && !receive_timeout && !nonblocking),
            stream: data.get(3..).unwrap_or_default().to_vec(),
        }
    }

    /// The bytes that decode to this input.
    ///
    /// # Panics
    ///
    /// With more than [`MAX_FDS`] descriptors, or a pause with no bound on the receiver.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.fds <= MAX_FDS, "at most {MAX_FDS} descriptors");
        assert!(
            !self.pause || self.deadline || self.receive_timeout || self.nonblocking,
            "a receiver waiting for a silent sender must be bounded"
        );
        let mut flags = 0;
        for (on, bit) in [
            (self.pass_cred, PASS_CRED),
            (self.split_at.is_some(), SPLIT),
            (self.fds_with_second, FDS_WITH_SECOND),
            (self.pass_pidfd, PASS_PIDFD),
            (self.pause, PAUSE),
            (self.receive_timeout, RECEIVE_TIMEOUT),
            (self.nonblocking, NONBLOCKING),
            (self.deadline, DEADLINE),
        ] {
            if on {
                flags |= bit;
            }
        }
        let mut out = vec![self.fds as u8, flags, self.split_at.unwrap_or(0)];
        out.extend_from_slice(&self.stream);
        out
    }

    /// The stream as the sender sends it: one part, or two.
    pub fn parts(&self) -> (&[u8], &[u8]) {
        let k = self.split_at.map_or(self.stream.len(), |k| usize::from(k).min(self.stream.len()));
        self.stream.split_at(k)
    }
}

/// Number of descriptors this process has open.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

/// What a receive of the `recv` target came to, for comparing runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A message was accepted, holding this many descriptors.
    Accepted(usize),
    /// The stream ended before a frame began.
    Closed,
    /// A protocol error.
    Refused,
    /// Any other error, as text.
    Failed(String),
}

impl Outcome {
    /// The outcome of a `run_recv` result.
    pub fn of(r: &cuvmm::Result<Option<usize>>) -> Outcome {
        match r {
            Ok(Some(n)) => Outcome::Accepted(*n),
            Ok(None) => Outcome::Closed,
            Err(e) if e.is_protocol() => Outcome::Refused,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// Runs one `recv` target input: sets the receiving end of a socket pair up, sends the stream
/// and the descriptors as the input says, and receives one message of any kind. Without a pause
/// the sending end is closed first and `recv_message` (or `recv_message_deadline`) receives;
/// with one, a [`cuvmm::ipc::FrameReader`] tries while the sender is silent, then again after
/// the rest and the close, and the input is run once more without the pause, which must come to
/// the same [`Outcome`]. Returns what the receive returned: the number of descriptors the
/// accepted message kept, or `None` when the stream ended before a frame began.
///
/// # Panics
///
/// If a refused message left a descriptor open, an accepted one holds other than exactly the
/// descriptors its message announces, a receive from a silent sender took more than a second,
/// or a paused sender's message came to something else than the same message sent at once.
/// Descriptors are counted for the whole process: run no other thread that opens or closes any
/// meanwhile.
pub fn run_recv(input: &RecvInput) -> cuvmm::Result<Option<usize>> {
    use cuvmm::ipc::{FrameReader, PeerPolicy};
    use nix::sys::socket::{sendmsg, setsockopt, sockopt, ControlMessage, MsgFlags};
    use std::io::IoSlice;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    let (a, b) = UnixStream::pair().expect("a socket pair");
    if input.pass_cred {
        setsockopt(&b, sockopt::PassCred, &true).expect("SO_PASSCRED");
    }
    if input.pass_pidfd {
        let on: libc::c_int = 1;
        // SAFETY: `on` is a live c_int and the length says so; `b` is an open socket. A kernel
        // without SO_PASSPIDFD refuses it, which only makes the input weaker.
        let _ = unsafe {
            libc::setsockopt(
                b.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PASSPIDFD,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    if input.receive_timeout {
        b.set_read_timeout(Some(BOUND)).expect("SO_RCVTIMEO");
    }
    b.set_nonblocking(input.nonblocking).expect("O_NONBLOCK");
    let devnull = std::fs::File::open("/dev/null").expect("/dev/null");
    // One descriptor named n times still arrives as n descriptors.
    let raw = vec![devnull.as_raw_fd(); input.fds];
    let rights = [ControlMessage::ScmRights(&raw)];
    let send = |part: &[u8], with_fds: bool| {
        // A stream socket sends nothing, descriptors included, for an empty part.
        if part.is_empty() {
            return;
        }
        let cmsgs: &[ControlMessage<'_>] = if with_fds && !raw.is_empty() { &rights } else { &[] };
        // Refusals (too many descriptors in flight, say) only make the input weaker.
        let _ = sendmsg::<()>(a.as_raw_fd(), &[IoSlice::new(part)], cmsgs, MsgFlags::empty(), None);
    };
    let (first, second) = input.parts();
    let deadline = || input.deadline.then(|| Instant::now() + BOUND);
    let policy = PeerPolicy::SameUid;
    let before = open_fds();
    let received = if input.pause {
        send(first, !input.fds_with_second);
        // The sender is connected and silent: the receive must end by itself.
        let mut reader = FrameReader::new();
        let started = Instant::now();
        let early = reader.recv(b.as_fd(), policy, deadline());
        assert!(started.elapsed() < Duration::from_secs(1), "a silent sender held the receiver");
        match early {
            Err(e) if e.is_would_block() || e.is_timeout() => {
                send(second, input.fds_with_second);
                a.shutdown(std::net::Shutdown::Write).expect("shutdown");
                reader.recv(b.as_fd(), policy, deadline())
            }
            done => done,
        }
    } else {
        send(first, !input.fds_with_second);
        send(second, input.fds_with_second);
        // The receiver sees the end of the stream after the bytes; the descriptor stays open, so
        // that the counts below are not off by one.
        a.shutdown(std::net::Shutdown::Write).expect("shutdown");
        match deadline() {
            Some(d) => cuvmm::ipc::recv_message_deadline(b.as_fd(), policy, d),
            None => cuvmm::ipc::recv_message(b.as_fd(), policy),
        }
    };
    let out = match received {
        Ok(Some(m)) => {
            let n = m.message().fd_count();
            assert_eq!(
                usize::from(m.fd().is_some()),
                n,
                "the message holds other descriptors than it announces"
            );
            assert_eq!(open_fds(), before + n, "the accepted message holds other descriptors");
            Ok(Some(n))
        }
        Ok(None) => {
            assert!(input.stream.is_empty(), "the end of a stream that held bytes");
            assert_eq!(open_fds(), before, "descriptors arrived with no message");
            Ok(None)
        }
        Err(e) => {
            assert_eq!(open_fds(), before, "a refused message left descriptors open");
            Err(e)
        }
    };
    assert_eq!(open_fds(), before, "descriptors outlived the message");
    drop((a, b));
    if input.pause {
        let at_once = run_recv(&RecvInput { pause: false, ..input.clone() });
        assert_eq!(Outcome::of(&out), Outcome::of(&at_once), "a pause changed what arrived");
    }
    out
}

/// One run of the `growth` target: the importer's limits and the frames its connection delivers.
///
/// Byte layout (inputs shorter than 2 bytes read as if padded with zeroes):
///
/// | byte | meaning |
/// |---|---|
/// | 0 | the importer's granularity: 2 to the power 12 + (byte mod 19), 4 KiB to 1 GiB |
/// | 1 | the importer's largest region: 2 to the power 20 + (byte mod 23), 1 MiB to 4 TiB |
/// | 2.. | frames, 144 bytes each (a shorter last one is a frame cut short) |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrowthInput {
    /// The importer's allocation granularity, a power of two.
    pub granularity: u64,
    /// The most address space the importer reserves for a region.
    pub max_capacity: u64,
    /// What the connection delivers.
    pub stream: Vec<u8>,
}

impl GrowthInput {
    /// Decodes any bytes (see the layout above).
    pub fn decode(data: &[u8]) -> GrowthInput {
        let at = |i: usize| u32::from(data.get(i).copied().unwrap_or(0));
        GrowthInput {
            granularity: 1 << (12 + at(0) % 19),
            max_capacity: 1 << (20 + at(1) % 23),
            stream: data.get(2..).unwrap_or_default().to_vec(),
        }
    }

    /// The bytes that decode to this input.
    ///
    /// # Panics
    ///
    /// If the granularity or limit is not one the layout can express.
    pub fn encode(&self) -> Vec<u8> {
        let shift = |x: u64, low: u32, n: u32| {
            assert!(x.is_power_of_two() && (low..low + n).contains(&x.trailing_zeros()), "{x}");
            (x.trailing_zeros() - low) as u8
        };
        let mut out = vec![shift(self.granularity, 12, 19), shift(self.max_capacity, 20, 23)];
        out.extend_from_slice(&self.stream);
        out
    }

    /// Its frames encoded one after the other.
    pub fn of(granularity: u64, max_capacity: u64, messages: &[Message]) -> GrowthInput {
        let stream = messages.iter().flat_map(|m| m.encode().expect("a valid message")).collect();
        GrowthInput { granularity, max_capacity, stream }
    }
}

/// What the `growth` target saw: how many frames were applied before the first refusal (or the
/// end), and whether one was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrowthRun {
    /// Frames decoded and applied.
    pub applied: usize,
    /// Whether a frame was refused (malformed, or not fitting the layout); nothing after it is
    /// read, as a `GrowableImport` reads nothing after an error.
    pub refused: bool,
}

/// Runs one `growth` target input: decodes each frame and applies it to a `RegionLayout`, as a
/// `GrowableImport` does between receiving a message and mapping what it asks for, and checks
/// what the layout promises after every step.
///
/// # Panics
///
/// If `check` and `apply` disagree, a refused message changed the layout, or the layout breaks
/// its invariants: chunks that do not follow each other from offset 0, a chunk off the
/// importer's granularity, a mapped part past the capacity, or a capacity past the importer's
/// limit.
pub fn run_growth(input: &GrowthInput) -> GrowthRun {
    let mut layout = RegionLayout::new(input.max_capacity, input.granularity).expect("a power of two");
    let mut applied = 0;
    for frame in input.stream.chunks(HEADER_LEN) {
        let before = layout.clone();
        let Ok(m) = Message::decode(frame) else { return GrowthRun { applied, refused: true } };
        let checked = layout.check(&m);
        assert_eq!(layout, before, "check changed the layout");
        let step = match (checked, layout.apply(&m)) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "check and apply disagree");
                b
            }
            (Err(_), Err(_)) => {
                assert_eq!(layout, before, "a refused message changed the layout");
                return GrowthRun { applied, refused: true };
            }
            (a, b) => panic!("check said {a:?}, apply {b:?}"),
        };
        match step {
            Step::Open(r) => assert!(before.region().is_none() && r.capacity() <= input.max_capacity),
            Step::Map(g) => assert_eq!(g.offset(), before.mapped(), "a chunk not at the end"),
            Step::Unmap { keep, length } => {
                assert_eq!((layout.chunks().len(), layout.mapped()), (keep, length));
                assert!(length <= before.mapped());
            }
            Step::Note(_) => assert_eq!(layout, before),
        }
        let capacity = layout.region().expect("a step after the region").capacity();
        assert!(capacity.is_multiple_of(input.granularity) && capacity <= input.max_capacity);
        let mut end = 0;
        for &(offset, size) in layout.chunks() {
            assert_eq!(offset, end, "chunks do not follow each other");
            assert!(size > 0 && size.is_multiple_of(input.granularity), "a chunk off the granularity");
            end = offset + size;
        }
        assert!(end == layout.mapped() && end <= capacity, "mapped past the capacity");
        applied += 1;
    }
    GrowthRun { applied, refused: false }
}

/// The largest hand-off message (docs/WIRE.md, "The hand-off"): a head and an answer of 256 offers.
pub const HANDOFF_MESSAGE_MOST: usize = 16 + 256 * 24;

/// One run of the `handoff` target: bytes that arrived as one hand-off message, with a number of
/// descriptors, and the same bytes read as a ticket.
///
/// Byte layout (an empty input reads as no descriptors and no bytes):
///
/// | byte | meaning |
/// |---|---|
/// | 0 | descriptors that came with the message (0 to 255) |
/// | 1.. | the bytes, decoded as a message (`Frame::decode`) and as a ticket (`Ticket::from_bytes`) |
///
/// Returns what each decoder made of them.
///
/// # Panics
///
/// If either decoder panics, or accepts bytes that do not encode back to themselves; if a
/// message accepted announces other descriptors than came, or is longer than
/// [`HANDOFF_MESSAGE_MOST`]; if a ticket accepted has no pages, no sender, or a block that does
/// not lie on its pages (from within the first, to within the last).
pub fn run_handoff(data: &[u8]) -> (Option<Frame>, Option<Ticket>) {
    let fds = usize::from(data.first().copied().unwrap_or(0));
    let bytes = data.get(1..).unwrap_or_default();
    let frame = Frame::decode(bytes, fds).ok();
    if let Some(f) = &frame {
        assert_eq!(f.encode().expect("a decoded message encodes"), bytes, "{f:?} encodes otherwise");
        assert_eq!(f.fd_count(), fds, "{f:?} announces other descriptors than came");
        assert!(bytes.len() <= HANDOFF_MESSAGE_MOST, "a message of {} bytes", bytes.len());
    }
    let ticket = Ticket::from_bytes(bytes).ok();
    if let Some(t) = &ticket {
        assert_eq!(t.to_bytes(), bytes, "{t:?} encodes otherwise");
        let pages = t.serials().len() as u64;
        assert!(pages > 0 && t.sender_pid() > 0 && !t.is_empty(), "{t:?}");
        assert!(t.offset() < t.page(), "{t:?} starts past its first page");
        let end = t.offset() + t.len();
        assert!(end <= t.page() * pages && end > t.page() * (pages - 1), "{t:?} is off its last page");
    }
    (frame, ticket)
}

/// Byte offsets of the header's fields (docs/WIRE.md), for seeds that break one of them.
pub mod field {
    /// Magic, 8 bytes.
    pub const MAGIC: usize = 0;
    /// Version, 2 bytes.
    pub const VERSION: usize = 8;
    /// Handle type, 2 bytes.
    pub const HANDLE_TYPE: usize = 10;
    /// Kind, 2 bytes (in version 1, the first half of the flags).
    pub const KIND: usize = 12;
    /// Flags, 2 bytes (4 in version 1, from `KIND` on).
    pub const FLAGS: usize = 14;
    /// Size, 8 bytes.
    pub const SIZE: usize = 16;
    /// Granularity, 8 bytes.
    pub const GRANULARITY: usize = 24;
    /// Offset, 8 bytes.
    pub const OFFSET: usize = 32;
    /// Length, 8 bytes.
    pub const LENGTH: usize = 40;
    /// Fd count, 4 bytes.
    pub const FD_COUNT: usize = 72;
    /// Reserved, 4 bytes.
    pub const RESERVED: usize = 76;
    /// Fabric handle, 64 bytes.
    pub const FABRIC: usize = 80;
}

/// The seeds of each target, named, as the target's input bytes.
pub mod seeds {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Named seeds of one target, each the target's input bytes.
    pub type Seeds = Vec<(&'static str, Vec<u8>)>;

    /// A valid POSIX-fd header: 64 MiB allocation, 2 MiB granularity, range 2 MiB + 4 MiB.
    pub fn posix() -> Header {
        Header::new(WireHandle::PosixFd, 64 * MIB, 2 * MIB, 2 * MIB, 4 * MIB, *b"0123456789abcdef", 7)
            .expect("a valid header")
    }

    /// A valid fabric header over the same range.
    pub fn fabric() -> Header {
        Header::new(WireHandle::Fabric([0x5a; 64]), 64 * MIB, 2 * MIB, 2 * MIB, 4 * MIB, [1; 16], 8)
            .expect("a valid header")
    }

    fn bytes(h: &Header) -> [u8; HEADER_LEN] {
        h.encode().expect("a valid header encodes")
    }

    /// `bytes` of `h` with the little-endian `value` written at `at`.
    fn patched(h: &Header, at: usize, value: &[u8]) -> Vec<u8> {
        let mut b = bytes(h).to_vec();
        b[at..at + value.len()].copy_from_slice(value);
        b
    }

    /// A frame of any message.
    fn frame(m: &Message) -> Vec<u8> {
        m.encode().expect("a valid message encodes").to_vec()
    }

    /// `frame` of `m` with `value` written at `at`.
    fn patched_frame(m: &Message, at: usize, value: &[u8]) -> Vec<u8> {
        let mut b = frame(m);
        b[at..at + value.len()].copy_from_slice(value);
        b
    }

    const UUID: [u8; 16] = *b"0123456789abcdef";

    /// A region of POSIX-fd chunks: 64 MiB, 2 MiB granularity.
    pub fn region() -> Message {
        Message::Region(Region::new(HandleType::PosixFd, 64 * MIB, 2 * MIB, UUID, 7).expect("a valid region"))
    }

    /// A POSIX-fd chunk of the region above.
    pub fn grow(offset: u64, size: u64) -> Message {
        Message::Grow(Grow::new(WireHandle::PosixFd, size, 2 * MIB, offset, UUID, 0).expect("a valid chunk"))
    }

    fn fabric_region() -> Message {
        Message::Region(
            Region::new(HandleType::Fabric, 64 * MIB, 2 * MIB, [1; 16], 8).expect("a valid region"),
        )
    }

    fn fabric_grow(offset: u64, size: u64) -> Message {
        Message::Grow(
            Grow::new(WireHandle::Fabric([0x5a; 64]), size, 2 * MIB, offset, [1; 16], 0).expect("a chunk"),
        )
    }

    fn shrink(length: u64) -> Message {
        Message::Shrink { length, tag: 0 }
    }

    /// A version-1 share: the POSIX header above as an older sender writes it.
    pub fn v1_posix() -> Vec<u8> {
        patched(&posix(), field::VERSION, &1u16.to_le_bytes())
    }

    /// Seeds of the `header` target: valid frames of every kind, from the smallest to the
    /// largest, and a version-1 share.
    pub fn header() -> Seeds {
        let h = |handle, size, g, off, len, tag| {
            bytes(&Header::new(handle, size, g, off, len, [0xee; 16], tag).expect("a valid header")).to_vec()
        };
        let max = cuvmm::ipc::wire::MAX_CAPACITY;
        vec![
            ("posix", bytes(&posix()).to_vec()),
            ("fabric", bytes(&fabric()).to_vec()),
            ("posix-smallest", h(WireHandle::PosixFd, 4096, 4096, 0, 1, 0)),
            ("posix-last-byte", h(WireHandle::PosixFd, 2 * MIB, 2 * MIB, 2 * MIB - 1, 1, u64::MAX)),
            (
                "fabric-largest",
                h(WireHandle::Fabric([0xff; 64]), cuvmm::ipc::wire::MAX_SIZE, 1 << 30, 0, 1 << 40, 1),
            ),
            ("v1-posix", v1_posix()),
            ("region", frame(&region())),
            ("region-fabric-largest", {
                let r = Region::new(HandleType::Fabric, max, 1 << 30, [0xff; 16], u64::MAX);
                frame(&Message::Region(r.expect("the largest region")))
            }),
            ("grow-posix", frame(&grow(2 * MIB, 4 * MIB))),
            ("grow-fabric-last", frame(&fabric_grow(max - 2 * MIB, 2 * MIB))),
            ("shrink", frame(&shrink(2 * MIB))),
            ("shrink-largest", frame(&shrink(max))),
            ("note", frame(&Message::Note { tag: 1000 })),
        ]
    }

    /// What the `recv` target does with a seed.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Expect {
        /// A message is received.
        Accepted,
        /// It is refused with a protocol error.
        Refused,
        /// The stream ends before a frame begins.
        Closed,
    }

    /// How a receiver of a silent sender is bounded.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Bound {
        /// A deadline [`BOUND`] away.
        Deadline,
        /// A receive timeout of [`BOUND`].
        Timeout,
        /// A non-blocking socket.
        NonBlocking,
    }

    /// `input` with the sender pausing after its first send and the receiver bounded by `bound`.
    pub fn paused(input: RecvInput, bound: Bound) -> RecvInput {
        RecvInput {
            pause: true,
            deadline: bound == Bound::Deadline,
            receive_timeout: bound == Bound::Timeout,
            nonblocking: bound == Bound::NonBlocking,
            ..input
        }
    }

    /// Seeds of the `recv` target, with what `recv_message` does with each: valid messages of every
    /// kind, each way a message can be wrong, and each way the kernel can deliver one.
    pub fn recv_cases() -> Vec<(&'static str, RecvInput, Expect)> {
        use Expect::*;
        let posix = bytes(&posix());
        let fabric = bytes(&fabric());
        let one = |stream: &[u8]| RecvInput::new(stream, 1);
        let none = |stream: &[u8]| RecvInput::new(stream, 0);
        let note = frame(&Message::Note { tag: 1 });
        let mut cases: Vec<(&'static str, RecvInput, Expect)> = vec![
            ("posix-one-fd", one(&posix), Accepted),
            ("fabric-no-fd", RecvInput::new(fabric, 0), Accepted),
            ("posix-one-fd-passcred", RecvInput { pass_cred: true, ..one(&posix) }, Accepted),
            ("posix-one-fd-pidfd", RecvInput { pass_cred: true, pass_pidfd: true, ..one(&posix) }, Accepted),
            ("posix-split", RecvInput { split_at: Some(10), ..one(&posix) }, Accepted),
            (
                "posix-split-fd-with-second-passcred",
                RecvInput { split_at: Some(100), fds_with_second: true, pass_cred: true, ..one(&posix) },
                Accepted,
            ),
            ("fabric-split-at-1", RecvInput { split_at: Some(1), ..RecvInput::new(fabric, 0) }, Accepted),
            // Trailing bytes stay in the socket for the next message.
            ("posix-trailing-bytes", one(&[&posix[..], b"more"].concat()), Accepted),
            ("v1-posix-one-fd", one(&v1_posix()), Accepted),
            // The messages of a growing region.
            ("region-no-fd", none(&frame(&region())), Accepted),
            ("grow-posix-one-fd", one(&frame(&grow(0, 2 * MIB))), Accepted),
            ("grow-fabric-no-fd", none(&frame(&fabric_grow(0, 2 * MIB))), Accepted),
            ("shrink-no-fd", none(&frame(&shrink(0))), Accepted),
            ("note-split-at-143", RecvInput { split_at: Some(143), ..none(&note) }, Accepted),
            // Wrong descriptor counts.
            ("posix-no-fd", RecvInput::new(posix, 0), Refused),
            ("posix-two-fds", RecvInput::new(posix, 2), Refused),
            ("fabric-one-fd", RecvInput::new(fabric, 1), Refused),
            ("posix-252-fds-passcred", RecvInput { pass_cred: true, ..RecvInput::new(posix, 252) }, Refused),
            ("posix-253-fds-passcred", RecvInput { pass_cred: true, ..RecvInput::new(posix, 253) }, Refused),
            (
                "posix-253-fds-pidfd",
                RecvInput { pass_cred: true, pass_pidfd: true, ..RecvInput::new(posix, 253) },
                Refused,
            ),
            ("region-one-fd", one(&frame(&region())), Refused),
            ("grow-posix-no-fd", none(&frame(&grow(0, 2 * MIB))), Refused),
            ("grow-fabric-one-fd", one(&frame(&fabric_grow(0, 2 * MIB))), Refused),
            ("note-one-fd", one(&note), Refused),
            // Cut short, or nothing at all.
            ("posix-cut-at-100", one(&posix[..100]), Refused),
            ("note-cut-at-70", none(&note[..70]), Refused),
            ("empty", RecvInput::new(Vec::new(), 3), Closed),
            // A sender that falls silent, connected: inside a frame, or before one, with the
            // receiver bounded each way; then the rest (or only the end of the stream) follows.
            ("posix-one-byte-then-silence-deadline", paused(one(&posix[..1]), Bound::Deadline), Refused),
            ("posix-one-byte-then-silence-timeout", paused(one(&posix[..1]), Bound::Timeout), Refused),
            (
                "posix-one-byte-then-silence-nonblocking",
                paused(one(&posix[..1]), Bound::NonBlocking),
                Refused,
            ),
            ("silence-then-close", paused(none(&[]), Bound::Deadline), Closed),
            ("posix-cut-at-100-silence-timeout", paused(one(&posix[..100]), Bound::Timeout), Refused),
            (
                "posix-paused-at-1-deadline",
                paused(RecvInput { split_at: Some(1), ..one(&posix) }, Bound::Deadline),
                Accepted,
            ),
            (
                "posix-paused-at-100-fd-with-second-timeout",
                paused(
                    RecvInput { split_at: Some(100), fds_with_second: true, pass_cred: true, ..one(&posix) },
                    Bound::Timeout,
                ),
                Accepted,
            ),
            (
                "note-paused-at-143-nonblocking",
                paused(RecvInput { split_at: Some(143), ..none(&note) }, Bound::NonBlocking),
                Accepted,
            ),
            (
                "posix-two-fds-paused-at-10-nonblocking",
                paused(RecvInput { split_at: Some(10), ..RecvInput::new(posix, 2) }, Bound::NonBlocking),
                Refused,
            ),
            ("posix-silence-before-a-whole-frame", paused(one(&posix), Bound::Deadline), Accepted),
            // Bounded receivers of a sender that has finished.
            ("posix-one-fd-deadline", RecvInput { deadline: true, ..one(&posix) }, Accepted),
            (
                "posix-one-fd-nonblocking-timeout",
                RecvInput { nonblocking: true, receive_timeout: true, ..one(&posix) },
                Accepted,
            ),
        ];
        // Each check a receiver makes, failed by a POSIX message that carries its one fd.
        let h = super::seeds::posix();
        let broken: Vec<(&'static str, Vec<u8>)> = vec![
            ("bad-magic", patched(&h, field::MAGIC, b"CUVMMIPX")),
            ("bad-version", patched(&h, field::VERSION, &3u16.to_le_bytes())),
            ("bad-handle-type", patched(&h, field::HANDLE_TYPE, &2u16.to_le_bytes())),
            ("bad-kind", patched(&h, field::KIND, &5u16.to_le_bytes())),
            ("bad-flags", patched(&h, field::FLAGS, &1u16.to_le_bytes())),
            ("bad-reserved", patched(&h, field::RESERVED, &1u32.to_le_bytes())),
            ("bad-fd-count", patched(&h, field::FD_COUNT, &2u32.to_le_bytes())),
            ("bad-fabric-bytes-in-posix", patched(&h, field::FABRIC, &[1])),
            ("bad-size-zero", patched(&h, field::SIZE, &0u64.to_le_bytes())),
            ("bad-size-over-max", patched(&h, field::SIZE, &(2 * cuvmm::ipc::wire::MAX_SIZE).to_le_bytes())),
            ("bad-size-unaligned", patched(&h, field::SIZE, &(64 * MIB + 4096).to_le_bytes())),
            ("bad-granularity-zero", patched(&h, field::GRANULARITY, &0u64.to_le_bytes())),
            ("bad-granularity-not-power-of-two", patched(&h, field::GRANULARITY, &(3 * MIB).to_le_bytes())),
            ("bad-granularity-over-max", patched(&h, field::GRANULARITY, &(2u64 << 30).to_le_bytes())),
            ("bad-length-zero", patched(&h, field::LENGTH, &0u64.to_le_bytes())),
            ("bad-length-past-end", patched(&h, field::LENGTH, &(63 * MIB).to_le_bytes())),
            ("bad-offset-past-end", patched(&h, field::OFFSET, &(64 * MIB).to_le_bytes())),
            ("bad-offset-overflows", patched(&h, field::OFFSET, &u64::MAX.to_le_bytes())),
            // Version 1 has no kinds: its bytes 12 to 15 are flags.
            ("bad-v1-grow", {
                let mut b = patched_frame(&grow(0, 2 * MIB), field::VERSION, &1u16.to_le_bytes());
                b[field::KIND] = 2;
                b
            }),
            // The fields each growth kind leaves zero, and the bounds of those it uses.
            ("bad-region-offset", patched_frame(&region(), field::OFFSET, &(2 * MIB).to_le_bytes())),
            (
                "bad-region-capacity-unaligned",
                patched_frame(&region(), field::SIZE, &(64 * MIB + 4096).to_le_bytes()),
            ),
            (
                "bad-region-capacity-over-max",
                patched_frame(&region(), field::SIZE, &(2 * cuvmm::ipc::wire::MAX_CAPACITY).to_le_bytes()),
            ),
            ("bad-grow-length", patched_frame(&grow(0, 2 * MIB), field::LENGTH, &1u64.to_le_bytes())),
            (
                "bad-grow-offset-unaligned",
                patched_frame(&grow(0, 2 * MIB), field::OFFSET, &MIB.to_le_bytes()),
            ),
            (
                "bad-grow-past-max",
                patched_frame(
                    &grow(0, 2 * MIB),
                    field::OFFSET,
                    &cuvmm::ipc::wire::MAX_CAPACITY.to_le_bytes(),
                ),
            ),
            (
                "bad-grow-offset-overflows",
                patched_frame(&grow(0, 2 * MIB), field::OFFSET, &u64::MAX.to_le_bytes()),
            ),
            ("bad-shrink-uuid", patched_frame(&shrink(0), 48, &[1])),
            ("bad-shrink-handle-type", patched_frame(&shrink(0), field::HANDLE_TYPE, &1u16.to_le_bytes())),
            (
                "bad-shrink-past-max",
                patched_frame(&shrink(0), field::LENGTH, &(cuvmm::ipc::wire::MAX_CAPACITY + 1).to_le_bytes()),
            ),
            ("bad-note-size", patched_frame(&Message::Note { tag: 1 }, field::SIZE, &1u64.to_le_bytes())),
        ];
        cases.extend(broken.into_iter().map(|(name, b)| {
            // Each carries the one fd a POSIX share or grow announces, so that only the named
            // field is wrong where it can be.
            let fds = usize::from(b[field::HANDLE_TYPE] == 1 && b[field::KIND] != 1 && b[field::KIND] != 3);
            (name, RecvInput::new(b, fds), Refused)
        }));
        cases
    }

    /// Seeds of the `recv` target, as its input bytes.
    pub fn recv() -> Seeds {
        recv_cases().into_iter().map(|(name, input, _)| (name, input.encode())).collect()
    }

    /// Seeds of the `growth` target, with what each run does: frames applied, and whether one
    /// was refused. Each breaks one rule of `RegionLayout`, or follows them all.
    pub fn growth_cases() -> Vec<(&'static str, GrowthInput, GrowthRun)> {
        let g = 2 * MIB;
        let of = |messages: &[Message]| GrowthInput::of(g, 1 << 30, messages);
        let ok = |applied| GrowthRun { applied, refused: false };
        let refused = |applied| GrowthRun { applied, refused: true };
        let other = |f: fn(Grow) -> Result<Grow, cuvmm::Error>| {
            Message::Grow(
                f(match grow(2 * MIB, 2 * MIB) {
                    Message::Grow(x) => x,
                    _ => unreachable!("a grow"),
                })
                .expect("a valid chunk"),
            )
        };
        let note = Message::Note { tag: 9 };
        let mut late: Vec<Message> = vec![region()];
        late.extend((0..32).map(|i| grow(i * g, g)));
        let mut cut = of(&[region(), grow(0, g)]);
        cut.stream.extend_from_slice(&frame(&grow(g, g))[..70]);
        let mut corrupt = of(&[region(), grow(0, g), grow(g, g)]);
        corrupt.stream[2 * HEADER_LEN + field::KIND] = 9;
        vec![
            (
                "follow",
                of(&[region(), grow(0, g), grow(g, 4 * MIB), note, shrink(g), grow(g, g), shrink(0), note]),
                ok(8),
            ),
            (
                "follow-fabric",
                of(&[
                    fabric_region(),
                    fabric_grow(0, 4 * MIB),
                    fabric_grow(4 * MIB, 60 * MIB),
                    shrink(4 * MIB),
                ]),
                ok(4),
            ),
            ("late-importer-whole-region", of(&late), ok(33)),
            ("overlap", of(&[region(), grow(0, 4 * MIB), grow(g, g)]), refused(2)),
            ("gap", of(&[region(), grow(0, g), grow(2 * g, g)]), refused(2)),
            ("past-capacity", of(&[region(), grow(0, g), grow(g, 64 * MIB)]), refused(2)),
            ("second-region", of(&[region(), grow(0, g), region()]), refused(2)),
            ("share-on-growth", of(&[region(), Message::Share(posix())]), refused(1)),
            ("shrink-inside-chunk", of(&[region(), grow(0, 4 * MIB), shrink(g)]), refused(2)),
            ("shrink-past-end", of(&[region(), grow(0, g), shrink(2 * g)]), refused(2)),
            ("grow-before-region", of(&[grow(0, g), region()]), refused(0)),
            ("note-before-region", of(&[note, region()]), refused(0)),
            ("over-importer-limit", GrowthInput::of(g, 32 * MIB, &[region()]), refused(0)),
            (
                "importer-granularity-coarser",
                GrowthInput::of(4 * MIB, 1 << 30, &[region(), grow(0, g)]),
                refused(1),
            ),
            (
                "other-device",
                of(&[
                    region(),
                    grow(0, g),
                    other(|x| Grow::new(x.handle(), x.size(), x.granularity(), x.offset(), [9; 16], 0)),
                ]),
                refused(2),
            ),
            (
                "other-granularity",
                of(&[
                    region(),
                    grow(0, g),
                    other(|x| Grow::new(x.handle(), x.size(), 1 << 20, x.offset(), x.device_uuid(), 0)),
                ]),
                refused(2),
            ),
            ("fabric-chunk-in-posix-region", of(&[region(), fabric_grow(0, g)]), refused(1)),
            ("cut-frame", cut, refused(2)),
            ("corrupt-frame", corrupt, refused(2)),
        ]
    }

    /// Seeds of the `growth` target, as its input bytes.
    pub fn growth() -> Seeds {
        growth_cases().into_iter().map(|(name, input, _)| (name, input.encode())).collect()
    }

    /// The fields of a ticket, laid out by hand as docs/WIRE.md ("The ticket") gives them, so that
    /// the seeds check the layout as well as the code.
    pub struct TicketFields {
        /// The sender's pid.
        pub pid: u32,
        /// The token.
        pub token: [u8; 16],
        /// The device's UUID.
        pub device: [u8; 16],
        /// The block's address.
        pub block: u64,
        /// The block's size.
        pub len: u64,
        /// The address of its first page.
        pub first_page: u64,
        /// Bytes per page.
        pub page: u64,
        /// The pages' serials.
        pub serials: Vec<u64>,
        /// The sender's address, its leading zero byte included.
        pub address: Vec<u8>,
    }

    impl TicketFields {
        /// A block of 200 MiB, 4 KiB into two pages of 128 MiB, offered by pid 4242.
        pub fn example() -> TicketFields {
            TicketFields {
                pid: 4242,
                token: *b"0123456789abcdef",
                device: [0xee; 16],
                block: 0x7f00_0000_0000 + 4096,
                len: 200 * MIB,
                first_page: 0x7f00_0000_0000,
                page: 128 * MIB,
                serials: vec![11, 12],
                address: b"\0cuvmm-handoff-4242-00112233aabbccdd".to_vec(),
            }
        }

        /// Its bytes.
        pub fn bytes(&self) -> Vec<u8> {
            let mut b = b"CVHT".to_vec();
            b.extend_from_slice(&1u16.to_le_bytes());
            b.extend_from_slice(&[0, 0]);
            b.extend_from_slice(&self.pid.to_le_bytes());
            b.extend_from_slice(&self.token);
            b.extend_from_slice(&self.device);
            for v in [self.block, self.len, self.first_page, self.page] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            b.extend_from_slice(&(self.serials.len() as u32).to_le_bytes());
            b.extend_from_slice(&(self.address.len() as u16).to_le_bytes());
            b.extend_from_slice(&[0, 0]);
            for s in &self.serials {
                b.extend_from_slice(&s.to_le_bytes());
            }
            b.extend_from_slice(&self.address);
            b
        }
    }

    /// What the `handoff` target makes of a seed.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Handoff {
        /// A message.
        Message,
        /// A ticket.
        Ticket,
        /// Neither.
        Refused,
    }

    /// Seeds of the `handoff` target with what each decodes to: every kind of message at its
    /// smallest and largest, tickets, and each way a message or a ticket can be wrong.
    pub fn handoff_cases() -> Vec<(&'static str, Vec<u8>, Handoff)> {
        use cuvmm::ipc::handoff::{Placement, Refusal, Token};
        use Handoff::*;
        let t = |b: u8| Token([b; 16]);
        let msg = |f: Frame| {
            let mut b = vec![f.fd_count() as u8];
            b.extend(f.encode().expect("a valid message"));
            b
        };
        let with_fds = |fds: u8, f: Frame| {
            let mut b = msg(f);
            b[0] = fds;
            b
        };
        // A message's bytes with `value` written at `at` (an offset into the message).
        let patched = |f: Frame, at: usize, value: &[u8]| {
            let mut b = msg(f);
            b[1 + at..1 + at + value.len()].copy_from_slice(value);
            b
        };
        let ticket = |change: &dyn Fn(&mut TicketFields)| {
            let mut f = TicketFields::example();
            change(&mut f);
            [vec![0], f.bytes()].concat()
        };
        let many: Vec<u64> = (1..=300).collect();
        let place = |serial: u64, addr: u64| Placement { serial, addr, size: 128 * MIB };
        vec![
            ("fetch", msg(Frame::Fetch(t(1))), Message),
            ("hold", msg(Frame::Hold(t(2))), Message),
            ("release", msg(Frame::Release(vec![t(3)])), Message),
            ("release-largest", msg(Frame::Release(vec![t(4); 256])), Message),
            ("offered", msg(Frame::Offered(vec![(t(5), 2)])), Message),
            ("offered-largest", msg(Frame::Offered(vec![(t(6), 1 << 20); 256])), Message),
            ("held", msg(Frame::Held(vec![])), Message),
            ("held-along", msg(Frame::Held(vec![t(7), t(8)])), Message),
            ("pages", msg(Frame::Pages(2)), Message),
            ("pages-largest", msg(Frame::Pages(250)), Message),
            ("refused-unknown", msg(Frame::Refused(Refusal::Unknown)), Message),
            ("refused-failed", msg(Frame::Refused(Refusal::Failed)), Message),
            ("refused-withdrawn", msg(Frame::Refused(Refusal::Withdrawn)), Message),
            ("revoke", msg(Frame::Revoke(vec![11])), Message),
            ("revoke-largest", msg(Frame::Revoke((1..=512).collect())), Message),
            ("mirror", msg(Frame::Mirror([9; 16])), Message),
            ("placed", msg(Frame::Placed(vec![place(12, 1 << 40)])), Message),
            ("placed-largest", msg(Frame::Placed((1..=250).map(|k| place(k, k << 27)).collect())), Message),
            ("unplaced", msg(Frame::Unplaced(vec![1 << 40])), Message),
            ("unplaced-largest", msg(Frame::Unplaced((1..=512).map(|k| k << 27).collect())), Message),
            ("ticket", ticket(&|_| {}), Ticket),
            (
                "ticket-one-page-whole",
                ticket(&|f| (f.block, f.len, f.serials) = (f.first_page, f.page, vec![7])),
                Ticket,
            ),
            (
                "ticket-many-pages",
                ticket(&|f| (f.page, f.len, f.serials) = (2 * MIB, 300 * 2 * MIB - 4096, many.clone())),
                Ticket,
            ),
            ("bad-magic", patched(Frame::Fetch(t(1)), 0, b"CVHX"), Refused),
            ("bad-version", patched(Frame::Fetch(t(1)), 4, &2u16.to_le_bytes()), Refused),
            ("bad-kind", patched(Frame::Fetch(t(1)), 6, &4u16.to_le_bytes()), Refused),
            ("bad-count", patched(Frame::Fetch(t(1)), 8, &2u32.to_le_bytes()), Refused),
            ("bad-fetch-with-fd", with_fds(1, Frame::Fetch(t(1))), Refused),
            ("bad-pages-fewer-fds", with_fds(1, Frame::Pages(2)), Refused),
            ("bad-pages-no-fd", patched(Frame::Pages(1), 12, &0u32.to_le_bytes()), Refused),
            (
                "bad-release-past-most",
                {
                    let mut b = msg(Frame::Release(vec![t(4); 256]));
                    b[9..13].copy_from_slice(&257u32.to_le_bytes());
                    b.extend_from_slice(&[4; 16]);
                    b
                },
                Refused,
            ),
            (
                "bad-offered-no-pages",
                patched(Frame::Offered(vec![(t(5), 2)]), 32, &0u32.to_le_bytes()),
                Refused,
            ),
            (
                "bad-offered-reserved",
                patched(Frame::Offered(vec![(t(5), 2)]), 36, &1u32.to_le_bytes()),
                Refused,
            ),
            ("bad-placed-fewer-fds", with_fds(1, Frame::Placed(vec![place(1, 1 << 40); 2])), Refused),
            ("bad-placed-no-size", patched(Frame::Placed(vec![place(1, 1 << 40)]), 32, &0u64.to_le_bytes()), Refused),
            ("bad-placed-past-2-64", patched(Frame::Placed(vec![place(1, 1 << 40)]), 24, &u64::MAX.to_le_bytes()), Refused),
            ("bad-refusal", patched(Frame::Refused(Refusal::Unknown), 16, &4u32.to_le_bytes()), Refused),
            ("bad-trailing-byte", [msg(Frame::Hold(t(2))), vec![0]].concat(), Refused),
            (
                "bad-ticket-version",
                {
                    let mut b = ticket(&|_| {});
                    b[5] = 2;
                    b
                },
                Refused,
            ),
            ("bad-ticket-no-pid", ticket(&|f| f.pid = 0), Refused),
            ("bad-ticket-page-size", ticket(&|f| f.page = 3 * MIB), Refused),
            ("bad-ticket-last-page-unused", ticket(&|f| f.len = 100 * MIB), Refused),
            ("bad-ticket-past-last-page", ticket(&|f| f.len = 300 * MIB), Refused),
            ("bad-ticket-end-past-2-64", ticket(&|f| (f.len, f.serials) = (u64::MAX - 1, vec![11])), Refused),
            ("bad-ticket-no-address", ticket(&|f| f.address.clear()), Refused),
            (
                "bad-ticket-cut",
                {
                    let mut b = ticket(&|_| {});
                    b.pop();
                    b
                },
                Refused,
            ),
        ]
    }

    /// Seeds of the `handoff` target, as its input bytes.
    pub fn handoff() -> Seeds {
        handoff_cases().into_iter().map(|(name, input, _)| (name, input)).collect()
    }

    /// Every target's seeds, by target name.
    pub fn all() -> Vec<(&'static str, Seeds)> {
        vec![("header", header()), ("recv", recv()), ("growth", growth()), ("handoff", handoff())]
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::path::PathBuf;

        fn dir(target: &str) -> PathBuf {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("seeds").join(target)
        }

        /// Descriptors are counted per process, and the other tests open files.
        static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

        #[test]
        fn checked_in_seeds_are_current() {
            let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
            let write = std::env::var_os("CUVMM_WRITE_SEEDS").is_some();
            for (target, seeds) in all() {
                let d = dir(target);
                if write {
                    let _ = std::fs::remove_dir_all(&d);
                    std::fs::create_dir_all(&d).unwrap();
                }
                for (name, bytes) in &seeds {
                    let path = d.join(name);
                    if write {
                        std::fs::write(&path, bytes).unwrap();
                    }
                    let on_disk = std::fs::read(&path).unwrap_or_else(|e| {
                        panic!("{}: {e} (CUVMM_WRITE_SEEDS=1 writes it)", path.display())
                    });
                    assert_eq!(
                        &on_disk,
                        bytes,
                        "{} is stale (CUVMM_WRITE_SEEDS=1 rewrites it)",
                        path.display()
                    );
                }
                let mut names: Vec<String> = std::fs::read_dir(&d)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect();
                names.sort();
                let mut made: Vec<String> = seeds.iter().map(|(n, _)| n.to_string()).collect();
                made.sort();
                assert_eq!(names, made, "{} holds seeds nothing generates", d.display());
            }
        }

        #[test]
        fn header_seeds_decode_and_re_encode() {
            let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
            for (name, b) in header() {
                let m = Message::decode(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
                let mut expect = b.clone();
                expect[field::VERSION] = 2; // a version-1 share is written as version 2
                assert_eq!(m.encode().unwrap().to_vec(), expect, "{name}");
                assert_eq!(Header::decode(&b).is_ok(), matches!(m, Message::Share(_)), "{name}");
            }
        }

        #[test]
        fn handoff_seeds_decode_as_named() {
            for (name, input, expect) in handoff_cases() {
                let got = match run_handoff(&input) {
                    (Some(_), None) => Handoff::Message,
                    (None, Some(_)) => Handoff::Ticket,
                    (None, None) => Handoff::Refused,
                    (Some(f), Some(t)) => panic!("{name}: both {f:?} and {t:?}"),
                };
                assert_eq!(got, expect, "{name}");
            }
            // The worked examples of docs/WIRE.md.
            let fetch = Frame::Fetch(cuvmm::ipc::handoff::Token(*b"0123456789abcdef")).encode().unwrap();
            let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" ");
            assert_eq!(
                hex(&fetch),
                "43 56 48 4f 01 00 01 00 01 00 00 00 00 00 00 00 \
                 30 31 32 33 34 35 36 37 38 39 61 62 63 64 65 66"
            );
            let token = cuvmm::ipc::handoff::Token(*b"0123456789abcdef");
            assert_eq!(
                hex(&Frame::Offered(vec![(token, 2)]).encode().unwrap()),
                "43 56 48 4f 01 00 10 00 01 00 00 00 00 00 00 00 \
                 30 31 32 33 34 35 36 37 38 39 61 62 63 64 65 66 02 00 00 00 00 00 00 00"
            );
            assert_eq!(
                hex(&Frame::Pages(2).encode().unwrap()),
                "43 56 48 4f 01 00 11 00 00 00 00 00 02 00 00 00"
            );
            let ticket = TicketFields::example().bytes();
            assert_eq!(
                hex(&ticket),
                "43 56 48 54 01 00 00 00 92 10 00 00 \
                 30 31 32 33 34 35 36 37 38 39 61 62 63 64 65 66 \
                 ee ee ee ee ee ee ee ee ee ee ee ee ee ee ee ee \
                 00 10 00 00 00 7f 00 00 00 00 80 0c 00 00 00 00 \
                 00 00 00 00 00 7f 00 00 00 00 00 08 00 00 00 00 \
                 02 00 00 00 24 00 00 00 \
                 0b 00 00 00 00 00 00 00 0c 00 00 00 00 00 00 00 \
                 00 63 75 76 6d 6d 2d 68 61 6e 64 6f 66 66 2d 34 \
                 32 34 32 2d 30 30 31 31 32 32 33 33 61 61 62 62 \
                 63 63 64 64"
            );
            let t = Ticket::from_bytes(&ticket).unwrap();
            assert_eq!((t.offset(), t.len(), t.serials()), (4096, 200 * MIB, &[11, 12][..]));
            // Any bytes decode, and no input panics.
            for b in [&[][..], &[0], &[255, 1, 2, 3]] {
                assert_eq!(run_handoff(b), (None, None));
            }
        }

        #[test]
        fn growth_seeds_run_as_named_and_round_trip() {
            for (name, input, expect) in growth_cases() {
                assert_eq!(GrowthInput::decode(&input.encode()), input, "{name}");
                assert_eq!(run_growth(&input), expect, "{name}");
            }
            // Any bytes decode; limits stay within what the layout expresses.
            for b in [&[][..], &[255, 255], &[18, 22, 1, 2, 3]] {
                let i = GrowthInput::decode(b);
                assert!(i.granularity.is_power_of_two() && i.granularity <= 1 << 30);
                assert!(i.max_capacity.is_power_of_two() && i.max_capacity <= 1 << 42);
                assert_eq!(run_growth(&i).applied, 0);
            }
        }

        #[test]
        fn recv_seeds_round_trip_and_are_accepted_or_refused_as_named() {
            let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
            for (name, input, expect) in recv_cases() {
                assert_eq!(RecvInput::decode(&input.encode()), input, "{name}");
                // A receive that waits for a silent sender for ever fails the test, not hangs it.
                let (tx, rx) = std::sync::mpsc::channel();
                let run = input.clone();
                std::thread::spawn(move || tx.send(run_recv(&run)));
                let got = rx
                    .recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap_or_else(|_| panic!("{name}: the receiver still waits after 10 s"));
                match got {
                    Ok(Some(n)) => {
                        assert!(
                            expect == Expect::Accepted && n == input.fds,
                            "{name} was accepted with {n} fds"
                        )
                    }
                    Ok(None) => assert_eq!(expect, Expect::Closed, "{name} ended the stream"),
                    Err(e) if e.is_protocol() => assert_eq!(expect, Expect::Refused, "{name} was refused"),
                    Err(e) => panic!("{name}: not a protocol error: {e}"),
                }
                if name.starts_with("bad-") {
                    assert!(Message::decode(&input.stream).is_err(), "{name}: the frame itself is wrong");
                }
            }
        }

        #[test]
        fn any_bytes_decode_and_canonical_ones_round_trip() {
            assert_eq!(RecvInput::decode(&[]), RecvInput::new(Vec::new(), 0));
            assert_eq!(RecvInput::decode(&[255, 0, 0]).fds, 255 % 254);
            // Without the split flag the split byte and the fds-with-second flag mean nothing.
            let loose = RecvInput::decode(&[1, FDS_WITH_SECOND, 9, 0xaa]);
            assert_eq!(loose, RecvInput::new([0xaa], 1));
            for flags in 0..=255u8 {
                let b = [253, flags, 200, 1, 2, 3];
                let i = RecvInput::decode(&b);
                let mut canonical = flags;
                if flags & SPLIT == 0 {
                    canonical &= !FDS_WITH_SECOND;
                }
                // A paused sender's receiver is bounded even when no bound is asked for.
                if flags & PAUSE != 0 && flags & (RECEIVE_TIMEOUT | NONBLOCKING) == 0 {
                    canonical |= DEADLINE;
                }
                let split = if flags & SPLIT == 0 { 0 } else { 200 };
                assert_eq!(i.encode(), [253, canonical, split, 1, 2, 3], "flags {flags:#x}");
                assert_eq!(RecvInput::decode(&i.encode()), i, "flags {flags:#x}");
                assert_eq!(i.parts().0.len() + i.parts().1.len(), 3);
            }
        }
    }
}
