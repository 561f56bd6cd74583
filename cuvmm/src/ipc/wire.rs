//! The wire format of a shared-allocation message, version 1. `docs/WIRE.md` describes it byte by
//! byte for implementations in other languages.
//!
//! All integers are little-endian. The header is exactly [`HEADER_LEN`] bytes; a POSIX-fd message
//! carries exactly one file descriptor as SCM_RIGHTS ancillary data, a fabric message none.

use crate::error::{Error, Result};

/// `b"CUVMMIPC"`.
pub const MAGIC: [u8; 8] = *b"CUVMMIPC";
/// The version this crate writes and reads.
pub const VERSION: u16 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 144;
/// The largest allocation a receiver accepts (1 TiB).
pub const MAX_SIZE: u64 = 1 << 40;
/// The largest granularity a receiver accepts (1 GiB).
pub const MAX_GRANULARITY: u64 = 1 << 30;

/// How the allocation travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireHandle {
    /// A POSIX file descriptor, passed alongside with SCM_RIGHTS.
    PosixFd,
    /// A 64-byte fabric handle, inside the header.
    Fabric([u8; 64]),
}

/// One shared-allocation message.
///
/// Every `Header` that exists is valid: its fields are private and the only ways to make one,
/// [`Header::new`] and [`Header::decode`], check every bound a receiver enforces. So a header
/// returned by [`recv`](super::recv) cannot be widened afterwards to point an import past the
/// allocation:
///
/// ```compile_fail,E0616
/// fn widen(h: &mut cuvmm::ipc::Header) {
///     h.length = u64::MAX; // error: private field
/// }
/// ```
///
/// ```
/// use cuvmm::ipc::{Header, WireHandle};
/// let h = Header::new(WireHandle::PosixFd, 4 << 20, 2 << 20, 2 << 20, 2 << 20, [0; 16], 7)?;
/// assert_eq!((h.offset(), h.length()), (2 << 20, 2 << 20));
/// // A range past the end of the allocation is refused.
/// assert!(Header::new(WireHandle::PosixFd, 4 << 20, 2 << 20, 2 << 20, 4 << 20, [0; 16], 7).is_err());
/// # Ok::<(), cuvmm::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    handle: WireHandle,
    size: u64,
    granularity: u64,
    offset: u64,
    length: u64,
    device_uuid: [u8; 16],
    tag: u64,
}

impl Header {
    /// A header for the range `[offset, offset + length)` of a `size`-byte allocation with the
    /// given `granularity`, on the device with `device_uuid`. Refuses, with [`Error::Protocol`],
    /// whatever a receiver would refuse (see [`Header::validate`]).
    pub fn new(
        handle: WireHandle,
        size: u64,
        granularity: u64,
        offset: u64,
        length: u64,
        device_uuid: [u8; 16],
        tag: u64,
    ) -> Result<Header> {
        let h = Header { handle, size, granularity, offset, length, device_uuid, tag };
        h.validate()?;
        Ok(h)
    }

    /// How the allocation travels.
    pub fn handle(&self) -> WireHandle {
        self.handle
    }

    /// Size of the physical allocation, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Its allocation granularity, bytes.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Start of the shared range within the allocation.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the shared range, bytes (never zero).
    pub fn length(&self) -> u64 {
        self.length
    }

    /// UUID of the device the allocation lives on.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.device_uuid
    }

    /// The sender's tag, passed through untouched.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// How many file descriptors travel with this header.
    pub fn fd_count(&self) -> usize {
        match self.handle {
            WireHandle::PosixFd => 1,
            WireHandle::Fabric(_) => 0,
        }
    }

    /// Checks every bound a receiver enforces: the granularity is a power of two up to
    /// [`MAX_GRANULARITY`], the size is non-zero, at most [`MAX_SIZE`] and a multiple of the
    /// granularity, the length is non-zero and `offset + length` neither overflows nor exceeds
    /// the size. Always `Ok` for a `Header` made by this crate; importers call it again anyway.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Protocol(m));
        if self.granularity == 0 || !self.granularity.is_power_of_two() || self.granularity > MAX_GRANULARITY
        {
            return bad(format!(
                "granularity {} is not a power of two up to {MAX_GRANULARITY}",
                self.granularity
            ));
        }
        if self.size == 0 || self.size > MAX_SIZE || self.size % self.granularity != 0 {
            return bad(format!(
                "size {} is zero, over {MAX_SIZE} or not a multiple of the granularity",
                self.size
            ));
        }
        if self.length == 0 {
            return bad("length is zero".into());
        }
        match self.offset.checked_add(self.length) {
            Some(end) if end <= self.size => Ok(()),
            _ => bad(format!(
                "range {}+{} lies outside the {}-byte allocation",
                self.offset, self.length, self.size
            )),
        }
    }

    /// Encodes a valid header.
    pub fn encode(&self) -> Result<[u8; HEADER_LEN]> {
        self.validate()?;
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        let (kind, fds, fabric) = match self.handle {
            WireHandle::PosixFd => (1u16, 1u32, [0u8; 64]),
            WireHandle::Fabric(h) => (8u16, 0u32, h),
        };
        b[10..12].copy_from_slice(&kind.to_le_bytes());
        // 12..16: flags, zero in version 1.
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.granularity.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.length.to_le_bytes());
        b[48..64].copy_from_slice(&self.device_uuid);
        b[64..72].copy_from_slice(&self.tag.to_le_bytes());
        b[72..76].copy_from_slice(&fds.to_le_bytes());
        // 76..80: reserved, zero.
        b[80..144].copy_from_slice(&fabric);
        Ok(b)
    }

    /// Decodes and validates a header; any malformed byte is a [`Error::Protocol`].
    pub fn decode(b: &[u8]) -> Result<Header> {
        if b.len() != HEADER_LEN {
            return Err(Error::Protocol(format!("header is {} bytes, expected {HEADER_LEN}", b.len())));
        }
        if b[0..8] != MAGIC {
            return Err(Error::Protocol("bad magic: not a cuvmm message".into()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let version = u16_at(8);
        if version != VERSION {
            return Err(Error::Protocol(format!(
                "unsupported version {version} (this is version {VERSION})"
            )));
        }
        if u32_at(12) != 0 || u32_at(76) != 0 {
            return Err(Error::Protocol("flags and reserved fields must be zero in version 1".into()));
        }
        let mut fabric = [0u8; 64];
        fabric.copy_from_slice(&b[80..144]);
        let handle = match (u16_at(10), u32_at(72)) {
            (1, 1) if fabric == [0u8; 64] => WireHandle::PosixFd,
            (1, _) => {
                return Err(Error::Protocol("a POSIX-fd message carries one fd and no fabric handle".into()))
            }
            (8, 0) => WireHandle::Fabric(fabric),
            (8, _) => return Err(Error::Protocol("a fabric message carries no fds".into())),
            (k, _) => return Err(Error::Protocol(format!("unknown handle type {k}"))),
        };
        let mut device_uuid = [0u8; 16];
        device_uuid.copy_from_slice(&b[48..64]);
        Header::new(handle, u64_at(16), u64_at(24), u64_at(32), u64_at(40), device_uuid, u64_at(64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Header {
        Header::new(WireHandle::PosixFd, 64 << 20, 2 << 20, 2 << 20, 4 << 20, [7; 16], 0xfeed).unwrap()
    }

    #[test]
    fn new_refuses_every_forged_field() {
        const MIB: u64 = 1 << 20;
        let make = |size, granularity, offset, length| {
            Header::new(WireHandle::PosixFd, size, granularity, offset, length, [0; 16], 0)
        };
        let refused = |r: Result<Header>, what: &str| {
            assert!(matches!(r, Err(Error::Protocol(_))), "{what} was accepted: {r:?}");
        };
        assert!(make(64 * MIB, 2 * MIB, 0, 64 * MIB).is_ok());
        assert!(make(64 * MIB, 2 * MIB, 63 * MIB, MIB).is_ok(), "a range ending at the end is fine");
        refused(make(64 * MIB, 2 * MIB, 0, 64 * MIB + 1), "a length past the allocation");
        refused(make(64 * MIB, 2 * MIB, 64 * MIB, 1), "an offset at the end");
        refused(make(64 * MIB, 2 * MIB, 1 << 62, MIB), "an offset far past the allocation");
        refused(make(64 * MIB, 2 * MIB, 32 * MIB, 33 * MIB), "a range running past the end");
        refused(make(64 * MIB, 2 * MIB, u64::MAX, 2), "an offset + length that overflows");
        refused(make(64 * MIB, 2 * MIB, 2, u64::MAX), "a length + offset that overflows");
        refused(make(0, 2 * MIB, 0, 1), "a zero size");
        refused(make(64 * MIB, 2 * MIB, 0, 0), "a zero length");
        refused(make(64 * MIB + 4096, 2 * MIB, 0, MIB), "a size off the granularity");
        refused(make(64 * MIB, 3 * MIB, 0, MIB), "a granularity that is no power of two");
        refused(make(64 * MIB, 0, 0, MIB), "a zero granularity");
        refused(make(4 * MAX_GRANULARITY, 2 * MAX_GRANULARITY, 0, MIB), "a granularity over the maximum");
        refused(make(MAX_SIZE + 2 * MIB, 2 * MIB, 0, MIB), "a size over MAX_SIZE");
        refused(make(u64::MAX - (u64::MAX % (2 * MIB)), 2 * MIB, 0, MIB), "a huge size");
        assert!(make(MAX_SIZE, MAX_GRANULARITY, MAX_SIZE - 1, 1).is_ok(), "the largest valid header");
        // A fabric header is checked the same way.
        let fab = Header::new(WireHandle::Fabric([1; 64]), 64 * MIB, 2 * MIB, 0, 65 * MIB, [0; 16], 0);
        refused(fab, "a fabric range past the allocation");
    }

    #[test]
    fn accessors_return_what_was_given() {
        let h = Header::new(WireHandle::Fabric([4; 64]), 8 << 20, 2 << 20, 4096, 8192, [9; 16], 42).unwrap();
        assert_eq!(h.handle(), WireHandle::Fabric([4; 64]));
        assert_eq!((h.size(), h.granularity(), h.offset(), h.length()), (8 << 20, 2 << 20, 4096, 8192));
        assert_eq!((h.device_uuid(), h.tag(), h.fd_count()), ([9; 16], 42, 0));
        assert_eq!(sample().fd_count(), 1);
    }

    #[test]
    fn round_trip_and_layout() {
        let h = sample();
        let b = h.encode().unwrap();
        assert_eq!(&b[0..8], b"CUVMMIPC");
        assert_eq!(&b[8..10], &[1, 0]);
        assert_eq!(&b[10..12], &[1, 0]);
        assert_eq!(&b[16..24], &(64u64 << 20).to_le_bytes());
        assert_eq!(&b[72..76], &[1, 0, 0, 0]);
        assert_eq!(Header::decode(&b).unwrap(), h);
        let f = Header { handle: WireHandle::Fabric([9; 64]), ..h };
        let b = f.encode().unwrap();
        assert_eq!(&b[10..12], &[8, 0]);
        assert_eq!(Header::decode(&b).unwrap(), f);
    }

    #[test]
    fn every_malformed_header_is_rejected() {
        let good = sample().encode().unwrap();
        let reject = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
            let mut b = good;
            f(&mut b);
            assert!(matches!(Header::decode(&b), Err(Error::Protocol(_))));
        };
        reject(&|b| b[0] = b'X'); // magic
        reject(&|b| b[8] = 2); // version
        reject(&|b| b[10] = 2); // handle type
        reject(&|b| b[12] = 1); // flags
        reject(&|b| b[76] = 1); // reserved
        reject(&|b| b[72] = 2); // fd count
        reject(&|b| b[100] = 1); // a fabric handle in a POSIX message
        reject(&|b| b[16..24].copy_from_slice(&0u64.to_le_bytes())); // size zero
        reject(&|b| b[16..24].copy_from_slice(&(MAX_SIZE * 2).to_le_bytes())); // size too large
        reject(&|b| b[16..24].copy_from_slice(&((64u64 << 20) + 1).to_le_bytes())); // size not aligned
        reject(&|b| b[24..32].copy_from_slice(&3u64.to_le_bytes())); // granularity
        reject(&|b| b[24..32].copy_from_slice(&0u64.to_le_bytes()));
        reject(&|b| b[24..32].copy_from_slice(&(2u64 << 30).to_le_bytes()));
        reject(&|b| b[40..48].copy_from_slice(&0u64.to_le_bytes())); // length zero
        reject(&|b| b[40..48].copy_from_slice(&(63u64 << 20).to_le_bytes())); // past the end
        reject(&|b| b[32..40].copy_from_slice(&u64::MAX.to_le_bytes())); // offset overflows
        let mut fab = Header { handle: WireHandle::Fabric([1; 64]), ..sample() }.encode().unwrap();
        fab[72] = 1;
        assert!(Header::decode(&fab).is_err());
        assert!(Header::decode(&good[..100]).is_err());
        let mut long = good.to_vec();
        long.push(0);
        assert!(Header::decode(&long).is_err());
        assert!(Header { length: 0, ..sample() }.encode().is_err());
    }

    proptest! {
        #[test]
        fn valid_headers_round_trip(
            gshift in 12u32..31, units in 1u64..4096, off in 0u64..4096, len in 1u64..4096,
            uuid in any::<[u8; 16]>(), tag in any::<u64>(), fabric in any::<bool>(), fh in any::<[u8; 32]>(),
        ) {
            let g = 1u64 << gshift;
            let size = units.min(MAX_SIZE / g) * g;
            let offset = off.min(size - 1);
            let length = len.min(size - offset);
            let mut f = [0u8; 64];
            f[..32].copy_from_slice(&fh);
            let handle = if fabric { WireHandle::Fabric(f) } else { WireHandle::PosixFd };
            let h = Header::new(handle, size, g, offset, length, uuid, tag).unwrap();
            prop_assert_eq!(Header::decode(&h.encode().unwrap()).unwrap(), h);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = Header::decode(&bytes);
        }

        #[test]
        fn single_byte_corruptions_are_caught_or_harmless(i in 0usize..HEADER_LEN, v in any::<u8>()) {
            let good = sample().encode().unwrap();
            let mut b = good;
            b[i] = v;
            if let Ok(h) = Header::decode(&b) {
                // Whatever still decodes re-encodes to the same bytes and passes validation.
                prop_assert_eq!(h.encode().unwrap(), b);
            }
        }
    }
}
