//! The input layouts of the fuzz targets, decoded by the targets and encoded by the seed
//! generator, so that checked-in seeds always mean what their names say.
//!
//! Seeds live in `fuzz/seeds/TARGET`. They are generated, not edited: the test
//! `seeds::checked_in_seeds_are_current` fails when they differ from what [`seeds`] makes, and
//! `CUVMM_WRITE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml --lib` rewrites them.

use cuvmm::ipc::wire::{Header, WireHandle, HEADER_LEN};

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
/// | 1 | flags: bit 0 `SO_PASSCRED` on the receiver; bit 1 send the stream in two `sendmsg` calls; bit 2 the descriptors travel with the second call instead of the first; bit 3 `SO_PASSPIDFD` on the receiver; other bits ignored |
/// | 2 | split point: with bit 1, the first call sends this many stream bytes (at most all) |
/// | 3.. | the stream bytes the receiver reads (a 144-byte header, or anything) |
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
    /// What the receiver reads.
    pub stream: Vec<u8>,
}

const PASS_CRED: u8 = 1 << 0;
const SPLIT: u8 = 1 << 1;
const FDS_WITH_SECOND: u8 = 1 << 2;
const PASS_PIDFD: u8 = 1 << 3;

impl RecvInput {
    /// A message sent in one piece, with `fds` descriptors, to a receiver with default options.
    pub fn new(stream: impl Into<Vec<u8>>, fds: usize) -> RecvInput {
        RecvInput {
            fds,
            pass_cred: false,
            pass_pidfd: false,
            split_at: None,
            fds_with_second: false,
            stream: stream.into(),
        }
    }

    /// Decodes any bytes (see the layout above).
    pub fn decode(data: &[u8]) -> RecvInput {
        let at = |i: usize| data.get(i).copied().unwrap_or(0);
        let flags = at(1);
        let split = flags & SPLIT != 0;
        RecvInput {
            fds: usize::from(at(0)) % (MAX_FDS + 1),
            pass_cred: flags & PASS_CRED != 0,
            pass_pidfd: flags & PASS_PIDFD != 0,
            split_at: split.then(|| at(2)),
            fds_with_second: split && flags & FDS_WITH_SECOND != 0,
            stream: data.get(3..).unwrap_or_default().to_vec(),
        }
    }

    /// The bytes that decode to this input.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.fds <= MAX_FDS, "at most {MAX_FDS} descriptors");
        let mut flags = 0;
        for (on, bit) in [
            (self.pass_cred, PASS_CRED),
            (self.split_at.is_some(), SPLIT),
            (self.fds_with_second, FDS_WITH_SECOND),
            (self.pass_pidfd, PASS_PIDFD),
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

/// Runs one `recv` target input: sets the receiving end of a socket pair up, sends the stream
/// and the descriptors as the input says, closes the sending end and receives. Returns what
/// `recv` returned, as the number of descriptors the accepted message kept.
///
/// # Panics
///
/// If a refused message left a descriptor open, or an accepted one holds other than exactly the
/// descriptors its header announces. Descriptors are counted for the whole process: run no other
/// thread that opens or closes any meanwhile.
pub fn run_recv(input: &RecvInput) -> cuvmm::Result<usize> {
    use nix::sys::socket::{sendmsg, setsockopt, sockopt, ControlMessage, MsgFlags};
    use std::io::IoSlice;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::net::UnixStream;

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
    let devnull = std::fs::File::open("/dev/null").expect("/dev/null");
    // One descriptor named n times still arrives as n descriptors.
    let raw = vec![devnull.as_raw_fd(); input.fds];
    let rights = [ControlMessage::ScmRights(&raw)];
    let (first, second) = input.parts();
    for (part, with_fds) in [(first, !input.fds_with_second), (second, input.fds_with_second)] {
        // A stream socket sends nothing, descriptors included, for an empty part.
        if part.is_empty() {
            continue;
        }
        let cmsgs: &[ControlMessage<'_>] = if with_fds && !raw.is_empty() { &rights } else { &[] };
        // Refusals (too many descriptors in flight, say) only make the input weaker.
        let _ = sendmsg::<()>(a.as_raw_fd(), &[IoSlice::new(part)], cmsgs, MsgFlags::empty(), None);
    }
    drop(a); // the receiver sees the end of the stream after the bytes
    let before = open_fds();
    let out = match cuvmm::ipc::recv(b.as_fd(), cuvmm::ipc::PeerPolicy::SameUid) {
        Ok(m) => {
            let n = m.header().fd_count();
            assert_eq!(open_fds(), before + n, "the accepted message holds other descriptors");
            Ok(n)
        }
        Err(e) => {
            assert_eq!(open_fds(), before, "a refused message left descriptors open");
            Err(e)
        }
    };
    assert_eq!(open_fds(), before, "descriptors outlived the message");
    out
}

/// Byte offsets of the header's fields (docs/WIRE.md), for seeds that break one of them.
pub mod field {
    /// Magic, 8 bytes.
    pub const MAGIC: usize = 0;
    /// Version, 2 bytes.
    pub const VERSION: usize = 8;
    /// Handle type, 2 bytes.
    pub const HANDLE_TYPE: usize = 10;
    /// Flags, 4 bytes.
    pub const FLAGS: usize = 12;
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

    /// Seeds of the `header` target: valid encoded headers, from the smallest to the largest.
    pub fn header() -> Seeds {
        let h = |handle, size, g, off, len, tag| {
            bytes(&Header::new(handle, size, g, off, len, [0xee; 16], tag).expect("a valid header")).to_vec()
        };
        vec![
            ("posix", bytes(&posix()).to_vec()),
            ("fabric", bytes(&fabric()).to_vec()),
            ("posix-smallest", h(WireHandle::PosixFd, 4096, 4096, 0, 1, 0)),
            ("posix-last-byte", h(WireHandle::PosixFd, 2 * MIB, 2 * MIB, 2 * MIB - 1, 1, u64::MAX)),
            (
                "fabric-largest",
                h(WireHandle::Fabric([0xff; 64]), cuvmm::ipc::wire::MAX_SIZE, 1 << 30, 0, 1 << 40, 1),
            ),
        ]
    }

    /// Seeds of the `recv` target, with whether `recv` accepts each: valid messages, each way a
    /// message can be wrong, and each way the kernel can deliver one.
    pub fn recv_cases() -> Vec<(&'static str, RecvInput, bool)> {
        let posix = bytes(&posix());
        let fabric = bytes(&fabric());
        let one = |stream: &[u8]| RecvInput::new(stream, 1);
        let mut cases: Vec<(&'static str, RecvInput, bool)> = vec![
            ("posix-one-fd", one(&posix), true),
            ("fabric-no-fd", RecvInput::new(fabric, 0), true),
            ("posix-one-fd-passcred", RecvInput { pass_cred: true, ..one(&posix) }, true),
            ("posix-one-fd-pidfd", RecvInput { pass_cred: true, pass_pidfd: true, ..one(&posix) }, true),
            ("posix-split", RecvInput { split_at: Some(10), ..one(&posix) }, true),
            (
                "posix-split-fd-with-second-passcred",
                RecvInput { split_at: Some(100), fds_with_second: true, pass_cred: true, ..one(&posix) },
                true,
            ),
            ("fabric-split-at-1", RecvInput { split_at: Some(1), ..RecvInput::new(fabric, 0) }, true),
            // Trailing bytes stay in the socket for the next message.
            ("posix-trailing-bytes", one(&[&posix[..], b"more"].concat()), true),
            // Wrong descriptor counts.
            ("posix-no-fd", RecvInput::new(posix, 0), false),
            ("posix-two-fds", RecvInput::new(posix, 2), false),
            ("fabric-one-fd", RecvInput::new(fabric, 1), false),
            ("posix-252-fds-passcred", RecvInput { pass_cred: true, ..RecvInput::new(posix, 252) }, false),
            ("posix-253-fds-passcred", RecvInput { pass_cred: true, ..RecvInput::new(posix, 253) }, false),
            (
                "posix-253-fds-pidfd",
                RecvInput { pass_cred: true, pass_pidfd: true, ..RecvInput::new(posix, 253) },
                false,
            ),
            // Cut short.
            ("posix-cut-at-100", one(&posix[..100]), false),
            ("empty", RecvInput::new(Vec::new(), 3), false),
        ];
        // Each check a receiver makes, failed by a POSIX message that carries its one fd.
        let h = super::seeds::posix();
        let broken: Vec<(&'static str, Vec<u8>)> = vec![
            ("bad-magic", patched(&h, field::MAGIC, b"CUVMMIPX")),
            ("bad-version", patched(&h, field::VERSION, &2u16.to_le_bytes())),
            ("bad-handle-type", patched(&h, field::HANDLE_TYPE, &2u16.to_le_bytes())),
            ("bad-flags", patched(&h, field::FLAGS, &1u32.to_le_bytes())),
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
        ];
        cases.extend(broken.into_iter().map(|(name, b)| (name, one(&b), false)));
        cases
    }

    /// Seeds of the `recv` target, as its input bytes.
    pub fn recv() -> Seeds {
        recv_cases().into_iter().map(|(name, input, _)| (name, input.encode())).collect()
    }

    /// Every target's seeds, by target name.
    pub fn all() -> Vec<(&'static str, Seeds)> {
        vec![("header", header()), ("recv", recv())]
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use cuvmm::Error;
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
                let h = Header::decode(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(h.encode().unwrap().to_vec(), b, "{name}");
            }
        }

        #[test]
        fn recv_seeds_round_trip_and_are_accepted_or_refused_as_named() {
            let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
            for (name, input, accepted) in recv_cases() {
                assert_eq!(RecvInput::decode(&input.encode()), input, "{name}");
                match run_recv(&input) {
                    Ok(n) => assert!(accepted && n == input.fds, "{name} was accepted with {n} fds"),
                    Err(Error::Protocol(_)) => assert!(!accepted, "{name} was refused"),
                    Err(e) => panic!("{name}: not a protocol error: {e}"),
                }
                if name.starts_with("bad-") {
                    assert!(Header::decode(&input.stream).is_err(), "{name}: the header itself is wrong");
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
            for flags in 0..16u8 {
                let b = [253, flags, 200, 1, 2, 3];
                let i = RecvInput::decode(&b);
                if flags & SPLIT != 0 || flags & FDS_WITH_SECOND == 0 {
                    let expect = if flags & SPLIT == 0 { [253, flags, 0, 1, 2, 3] } else { b };
                    assert_eq!(i.encode(), expect, "flags {flags:#x}");
                }
                assert_eq!(i.parts().0.len() + i.parts().1.len(), 3);
            }
        }
    }
}
