//! The wire format of cuvmm's messages, version 2; version 1 messages are still read.
//! `docs/WIRE.md` describes it byte by byte for implementations in other languages.
//!
//! Every message is one [`HEADER_LEN`]-byte frame, all integers little-endian. A message whose
//! handle travels as a POSIX fd carries exactly that descriptor as SCM_RIGHTS ancillary data; every
//! other message carries none. The frame's kind says what it is: a share ([`Header`]) hands over a
//! range of one allocation, the only message of version 1; a [`Region`] opens a growing vector on a
//! connection, and [`Grow`], shrink and note messages then let the importer follow it (see
//! [`GrowableImport`](super::GrowableImport)). [`Message`] is any of them.

use crate::error::{Error, Refusal, Result};

/// `b"CUVMMIPC"`.
pub const MAGIC: [u8; 8] = *b"CUVMMIPC";
/// The version this crate writes.
pub const VERSION: u16 = 2;
/// The oldest version this crate reads: version 1, whose only message is the share, decodes to the
/// same [`Header`] as a version-2 share with the same fields.
pub const OLDEST_VERSION: u16 = 1;
/// Frame length in bytes, for every kind and version.
pub const HEADER_LEN: usize = 144;
/// The largest allocation a receiver accepts (1 TiB).
pub const MAX_SIZE: u64 = 1 << 40;
/// The largest granularity a receiver accepts (1 GiB).
pub const MAX_GRANULARITY: u64 = 1 << 30;
/// The largest region a receiver accepts (4 TiB): the address space an importer of a growing
/// vector reserves, far above any one device's memory, and bounded so that no peer can make an
/// importer ask for more. Importers set their own, lower, limit too.
pub const MAX_CAPACITY: u64 = 1 << 42;

/// How an allocation travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireHandle {
    /// A POSIX file descriptor, passed alongside with SCM_RIGHTS.
    PosixFd,
    /// A 64-byte fabric handle, inside the frame.
    Fabric([u8; 64]),
}

impl WireHandle {
    /// The type, without the fabric handle's bytes.
    pub fn handle_type(&self) -> HandleType {
        match self {
            WireHandle::PosixFd => HandleType::PosixFd,
            WireHandle::Fabric(_) => HandleType::Fabric,
        }
    }

    /// How many file descriptors travel with a message that carries this handle.
    pub fn fd_count(&self) -> usize {
        match self {
            WireHandle::PosixFd => 1,
            WireHandle::Fabric(_) => 0,
        }
    }
}

pub use crate::error::values::{HandleType, Kind};

/// Where each field of a frame lies, for encoding and decoding alike (`docs/WIRE.md` draws it).
mod at {
    use std::ops::Range;

    pub const MAGIC: Range<usize> = 0..8;
    pub const VERSION: Range<usize> = 8..10;
    pub const HANDLE_TYPE: Range<usize> = 10..12;
    /// Version 2's kind; version 1 has none, its flags take [`V1_FLAGS`].
    pub const KIND: Range<usize> = 12..14;
    pub const FLAGS: Range<usize> = 14..16;
    pub const V1_FLAGS: Range<usize> = 12..16;
    pub const SIZE: Range<usize> = 16..24;
    pub const GRANULARITY: Range<usize> = 24..32;
    pub const OFFSET: Range<usize> = 32..40;
    pub const LENGTH: Range<usize> = 40..48;
    pub const DEVICE_UUID: Range<usize> = 48..64;
    pub const TAG: Range<usize> = 64..72;
    pub const FD_COUNT: Range<usize> = 72..76;
    pub const RESERVED: Range<usize> = 76..80;
    pub const FABRIC: Range<usize> = 80..144;

    /// Every field of a version-2 frame, in order.
    #[cfg(test)]
    pub const V2: [Range<usize>; 14] = [
        MAGIC,
        VERSION,
        HANDLE_TYPE,
        KIND,
        FLAGS,
        SIZE,
        GRANULARITY,
        OFFSET,
        LENGTH,
        DEVICE_UUID,
        TAG,
        FD_COUNT,
        RESERVED,
        FABRIC,
    ];
}

/// The `N` bytes of field `r` of a frame (`r` is one of [`at`]'s, `N` its width).
fn field<const N: usize>(b: &[u8], r: std::ops::Range<usize>) -> [u8; N] {
    let mut x = [0u8; N];
    x.copy_from_slice(&b[r]);
    x
}

fn protocol<T>(m: impl Into<String>) -> Result<T> {
    Err(Error::Protocol(m.into()))
}

fn check_granularity(granularity: u64) -> Result<()> {
    if granularity == 0 || !granularity.is_power_of_two() || granularity > MAX_GRANULARITY {
        return protocol(format!("granularity {granularity} is not a power of two up to {MAX_GRANULARITY}"));
    }
    Ok(())
}

/// `what` is non-zero, at most `max` and a multiple of `granularity` (checked before).
fn check_size(what: &str, size: u64, granularity: u64, max: u64) -> Result<()> {
    if size == 0 || size > max || size % granularity != 0 {
        return protocol(format!("{what} {size} is zero, over {max} or not a multiple of the granularity"));
    }
    Ok(())
}

/// A message type: the struct, with private fields, and a read-only accessor for each field
/// that returns a copy of it; `fd_count` for a type whose handle may travel as a descriptor.
/// [`Header`], [`Region`] and [`Grow`] share most fields, and their accessors are written once.
macro_rules! message_type {
    (
        $(#[$m:meta])*
        pub struct $ty:ident { $($(#[$doc:meta])* $field:ident: $t:ty,)* }
        $(fd_count: $handle:ident)?
    ) => {
        $(#[$m])*
        pub struct $ty {
            $($field: $t,)*
        }

        impl $ty {
            $(
                $(#[$doc])*
                pub fn $field(&self) -> $t {
                    self.$field
                }
            )*
            $(
                /// How many file descriptors travel with this message.
                pub fn fd_count(&self) -> usize {
                    self.$handle.fd_count()
                }
            )?
        }
    };
}

/// `offset + len` neither overflows nor passes `limit`; else `refusal` says what lies outside.
fn check_end(offset: u64, len: u64, limit: u64, refusal: impl FnOnce() -> String) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= limit => Ok(()),
        _ => protocol(refusal()),
    }
}

message_type! {
    /// A share message: one range of one allocation.
    ///
    /// Every `Header` that exists is valid: its fields are private and the only ways to make one,
    /// [`Header::new`] and [`Header::decode`], check every bound a receiver enforces. So a header
    /// received by [`recv_message`](super::recv_message) cannot be widened afterwards to point an
    /// import past the allocation:
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
        /// How the allocation travels.
        handle: WireHandle,
        /// Size of the physical allocation, bytes.
        size: u64,
        /// Its allocation granularity, bytes.
        granularity: u64,
        /// Start of the shared range within the allocation.
        offset: u64,
        /// Length of the shared range, bytes (never zero).
        length: u64,
        /// UUID of the device the allocation lives on.
        device_uuid: [u8; 16],
        /// The sender's tag, passed through untouched.
        tag: u64,
    } fd_count: handle
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

    /// Checks every bound a receiver enforces: the granularity is a power of two up to
    /// [`MAX_GRANULARITY`], the size is non-zero, at most [`MAX_SIZE`] and a multiple of the
    /// granularity, the length is non-zero and `offset + length` neither overflows nor exceeds
    /// the size. Always `Ok` for a `Header` made by this crate; importers call it again anyway.
    pub fn validate(&self) -> Result<()> {
        check_granularity(self.granularity)?;
        check_size("size", self.size, self.granularity, MAX_SIZE)?;
        if self.length == 0 {
            return protocol("length is zero");
        }
        check_end(self.offset, self.length, self.size, || {
            format!("range {}+{} lies outside the {}-byte allocation", self.offset, self.length, self.size)
        })
    }

    /// Encodes a valid header as a version-2 share message.
    pub fn encode(&self) -> Result<[u8; HEADER_LEN]> {
        Message::Share(*self).encode()
    }

    /// Decodes and validates a share message (version 1 or 2); any malformed byte is an
    /// [`Error::Protocol`], a well-formed message of another kind an [`Error::UnexpectedMessage`].
    pub fn decode(b: &[u8]) -> Result<Header> {
        match Message::decode(b)? {
            Message::Share(h) => Ok(h),
            other => {
                Err(Error::UnexpectedMessage { got: other.kind(), expected: "a share message was expected" })
            }
        }
    }
}

message_type! {
    /// A region message: the first message on a connection that follows a growing vector. It names
    /// the address space the importer reserves once, and how the chunks will travel; the chunks
    /// follow as [`Grow`] messages.
    ///
    /// Like [`Header`], every `Region` is valid: its fields are private, and [`Region::new`] and
    /// [`Message::decode`] check them.
    ///
    /// ```
    /// use cuvmm::ipc::wire::{HandleType, Region};
    /// let r = Region::new(HandleType::PosixFd, 1 << 30, 2 << 20, [0; 16], 7)?;
    /// assert_eq!(r.capacity(), 1 << 30);
    /// // A capacity off the granularity, or above MAX_CAPACITY, is refused.
    /// assert!(Region::new(HandleType::PosixFd, (1 << 30) + 4096, 2 << 20, [0; 16], 7).is_err());
    /// assert!(Region::new(HandleType::PosixFd, 1 << 43, 2 << 20, [0; 16], 7).is_err());
    /// # Ok::<(), cuvmm::Error>(())
    /// ```
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Region {
        /// How every chunk travels.
        handle_type: HandleType,
        /// Bytes of address space the importer reserves: the most the region can ever map.
        capacity: u64,
        /// The chunks' allocation granularity, bytes.
        granularity: u64,
        /// UUID of the device the chunks live on.
        device_uuid: [u8; 16],
        /// The sender's tag, passed through untouched.
        tag: u64,
    }
}

impl Region {
    /// A region of `capacity` bytes whose chunks travel as `handle`, are multiples of
    /// `granularity` and live on the device with `device_uuid`. Refuses, with
    /// [`Error::Protocol`], what a receiver would refuse (see [`Region::validate`]).
    pub fn new(
        handle: HandleType,
        capacity: u64,
        granularity: u64,
        device_uuid: [u8; 16],
        tag: u64,
    ) -> Result<Region> {
        let r = Region { handle_type: handle, capacity, granularity, device_uuid, tag };
        r.validate()?;
        Ok(r)
    }

    /// Checks every bound a receiver enforces: the granularity is a power of two up to
    /// [`MAX_GRANULARITY`], and the capacity is non-zero, at most [`MAX_CAPACITY`] and a multiple
    /// of the granularity.
    pub fn validate(&self) -> Result<()> {
        check_granularity(self.granularity)?;
        check_size("capacity", self.capacity, self.granularity, MAX_CAPACITY)
    }
}

message_type! {
    /// A grow message: one more chunk of a region, a whole physical allocation, to be mapped at
    /// `offset` in the region.
    ///
    /// Every `Grow` is valid on its own (private fields, checked by [`Grow::new`] and
    /// [`Message::decode`]); whether it fits the region so far is for the receiver's
    /// [`RegionLayout`](super::RegionLayout) to say.
    ///
    /// ```
    /// use cuvmm::ipc::wire::{Grow, WireHandle};
    /// let g = Grow::new(WireHandle::PosixFd, 4 << 20, 2 << 20, 2 << 20, [0; 16], 0)?;
    /// assert_eq!(g.end(), 6 << 20);
    /// // An offset off the granularity is refused.
    /// assert!(Grow::new(WireHandle::PosixFd, 4 << 20, 2 << 20, 4096, [0; 16], 0).is_err());
    /// # Ok::<(), cuvmm::Error>(())
    /// ```
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Grow {
        /// How the chunk travels.
        handle: WireHandle,
        /// Size of the chunk's physical allocation, all of which is mapped, bytes.
        size: u64,
        /// Its allocation granularity, bytes.
        granularity: u64,
        /// Where the chunk starts in the region.
        offset: u64,
        /// UUID of the device the chunk lives on.
        device_uuid: [u8; 16],
        /// The sender's tag, passed through untouched.
        tag: u64,
    } fd_count: handle
}

impl Grow {
    /// A chunk of `size` bytes (the whole allocation), mapped at `offset` in the region.
    /// Refuses, with [`Error::Protocol`], what a receiver would refuse (see [`Grow::validate`]).
    pub fn new(
        handle: WireHandle,
        size: u64,
        granularity: u64,
        offset: u64,
        device_uuid: [u8; 16],
        tag: u64,
    ) -> Result<Grow> {
        let g = Grow { handle, size, granularity, offset, device_uuid, tag };
        g.validate()?;
        Ok(g)
    }

    /// Where it ends: `offset + size`, never more than [`MAX_CAPACITY`].
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }

    /// Checks every bound a receiver enforces without knowing the region: the granularity is a
    /// power of two up to [`MAX_GRANULARITY`], the size is non-zero, at most [`MAX_SIZE`] and a
    /// multiple of the granularity, the offset is a multiple of the granularity, and
    /// `offset + size` neither overflows nor exceeds [`MAX_CAPACITY`].
    pub fn validate(&self) -> Result<()> {
        check_granularity(self.granularity)?;
        check_size("chunk size", self.size, self.granularity, MAX_SIZE)?;
        if self.offset % self.granularity != 0 {
            return protocol(format!("chunk offset {} is not a multiple of the granularity", self.offset));
        }
        check_end(self.offset, self.size, MAX_CAPACITY, || {
            format!("chunk {}+{} ends past the largest region ({MAX_CAPACITY} bytes)", self.offset, self.size)
        })
    }
}

/// Any message: what [`Message::decode`] reads from a frame and [`recv_message`](super::recv_message)
/// receives.
///
/// ```
/// use cuvmm::ipc::wire::{Kind, Message};
/// let bytes = Message::Shrink { length: 4 << 20, tag: 9 }.encode()?;
/// let m = Message::decode(&bytes)?;
/// assert_eq!((m.kind(), m.tag(), m.fd_count()), (Kind::Shrink, 9, 0));
/// # Ok::<(), cuvmm::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    /// One range of one allocation.
    Share(Header),
    /// Opens a growing region; the first message on its connection.
    Region(Region),
    /// One more chunk of the region.
    Grow(Grow),
    /// Every chunk that starts at or past `length` bytes is gone; the importer unmaps them.
    Shrink {
        /// Bytes of the region that stay mapped; at most [`MAX_CAPACITY`].
        length: u64,
        /// The sender's tag, passed through untouched.
        tag: u64,
    },
    /// A value of the sender's (how many elements are written, say), received after every
    /// message sent before it.
    Note {
        /// The value.
        tag: u64,
    },
}

/// The fields of a frame after magic, version, kind and flags, as the bytes say.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Fields {
    handle_type: u16,
    size: u64,
    granularity: u64,
    offset: u64,
    length: u64,
    device_uuid: [u8; 16],
    tag: u64,
    fd_count: u32,
    fabric: [u8; 64],
}

impl Fields {
    fn zero(tag: u64) -> Fields {
        Fields {
            handle_type: 0,
            size: 0,
            granularity: 0,
            offset: 0,
            length: 0,
            device_uuid: [0; 16],
            tag,
            fd_count: 0,
            fabric: [0; 64],
        }
    }

    /// The handle of a share or grow message: type, fd count and fabric bytes agree.
    fn wire_handle(&self) -> Result<WireHandle> {
        match (self.handle_type()?, self.fd_count) {
            (HandleType::PosixFd, 1) => Ok(WireHandle::PosixFd),
            (HandleType::PosixFd, n) => protocol(format!("a POSIX-fd message carries one fd, not {n}")),
            (HandleType::Fabric, 0) => Ok(WireHandle::Fabric(self.fabric)),
            (HandleType::Fabric, n) => protocol(format!("a fabric message carries no fds, not {n}")),
        }
    }

    fn handle_type(&self) -> Result<HandleType> {
        HandleType::from_code(self.handle_type)
            .ok_or_else(|| Error::Protocol(format!("unknown handle type {}", self.handle_type)))
    }

    /// With `handle`'s type code, fd count and fabric bytes.
    fn with_handle(self, handle: WireHandle) -> Fields {
        let fabric = match handle {
            WireHandle::PosixFd => [0; 64],
            WireHandle::Fabric(f) => f,
        };
        // At most one fd travels with a message.
        let fd_count = handle.fd_count() as u32;
        Fields { handle_type: handle.handle_type().code(), fd_count, fabric, ..self }
    }

    /// Refuses any field of `self` (as received) that differs from `canonical` (what the decoded
    /// message encodes to): the fields a kind does not use must be zero.
    fn must_equal(&self, canonical: &Fields, kind: Kind) -> Result<()> {
        let numbers = [
            ("handle type", u64::from(self.handle_type), u64::from(canonical.handle_type)),
            ("size", self.size, canonical.size),
            ("granularity", self.granularity, canonical.granularity),
            ("offset", self.offset, canonical.offset),
            ("length", self.length, canonical.length),
            ("fd count", u64::from(self.fd_count), u64::from(canonical.fd_count)),
        ];
        for (field, got, want) in numbers {
            if got != want {
                return protocol(format!("a {kind} message has {field} {want}, not {got}"));
            }
        }
        if self.device_uuid != canonical.device_uuid {
            return protocol(format!("a {kind} message carries no device UUID"));
        }
        if self.fabric != canonical.fabric {
            return protocol(format!(
                "a {kind} message without a fabric handle has an all-zero fabric field"
            ));
        }
        Ok(())
    }
}

impl Message {
    /// What it is.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Share(_) => Kind::Share,
            Message::Region(_) => Kind::Region,
            Message::Grow(_) => Kind::Grow,
            Message::Shrink { .. } => Kind::Shrink,
            Message::Note { .. } => Kind::Note,
        }
    }

    /// The sender's tag.
    pub fn tag(&self) -> u64 {
        match self {
            Message::Share(h) => h.tag(),
            Message::Region(r) => r.tag(),
            Message::Grow(g) => g.tag(),
            Message::Shrink { tag, .. } | Message::Note { tag } => *tag,
        }
    }

    /// How many file descriptors travel with it: one for a share or grow whose handle is a POSIX
    /// fd, else none.
    pub fn fd_count(&self) -> usize {
        match self {
            Message::Share(h) => h.fd_count(),
            Message::Grow(g) => g.fd_count(),
            _ => 0,
        }
    }

    /// Checks every bound a receiver enforces on the message alone (see each type's `validate`;
    /// a shrink's length is at most [`MAX_CAPACITY`]).
    pub fn validate(&self) -> Result<()> {
        match self {
            Message::Share(h) => h.validate(),
            Message::Region(r) => r.validate(),
            Message::Grow(g) => g.validate(),
            Message::Shrink { length, .. } if *length > MAX_CAPACITY => {
                protocol(format!("shrink length {length} is past the largest region ({MAX_CAPACITY} bytes)"))
            }
            Message::Shrink { .. } | Message::Note { .. } => Ok(()),
        }
    }

    /// The frame's fields for this message: what it uses, zero elsewhere.
    fn fields(&self) -> Fields {
        match *self {
            Message::Share(h) => Fields {
                size: h.size,
                granularity: h.granularity,
                offset: h.offset,
                length: h.length,
                device_uuid: h.device_uuid,
                ..Fields::zero(h.tag)
            }
            .with_handle(h.handle),
            Message::Region(r) => Fields {
                handle_type: r.handle_type.code(),
                size: r.capacity,
                granularity: r.granularity,
                device_uuid: r.device_uuid,
                ..Fields::zero(r.tag)
            },
            Message::Grow(g) => Fields {
                size: g.size,
                granularity: g.granularity,
                offset: g.offset,
                device_uuid: g.device_uuid,
                ..Fields::zero(g.tag)
            }
            .with_handle(g.handle),
            Message::Shrink { length, tag } => Fields { length, ..Fields::zero(tag) },
            Message::Note { tag } => Fields::zero(tag),
        }
    }

    /// Encodes a valid message as a version-2 frame.
    pub fn encode(&self) -> Result<[u8; HEADER_LEN]> {
        self.validate()?;
        let f = self.fields();
        let mut b = [0u8; HEADER_LEN];
        b[at::MAGIC].copy_from_slice(&MAGIC);
        b[at::VERSION].copy_from_slice(&VERSION.to_le_bytes());
        b[at::HANDLE_TYPE].copy_from_slice(&f.handle_type.to_le_bytes());
        b[at::KIND].copy_from_slice(&self.kind().code().to_le_bytes());
        // The flags stay zero.
        b[at::SIZE].copy_from_slice(&f.size.to_le_bytes());
        b[at::GRANULARITY].copy_from_slice(&f.granularity.to_le_bytes());
        b[at::OFFSET].copy_from_slice(&f.offset.to_le_bytes());
        b[at::LENGTH].copy_from_slice(&f.length.to_le_bytes());
        b[at::DEVICE_UUID].copy_from_slice(&f.device_uuid);
        b[at::TAG].copy_from_slice(&f.tag.to_le_bytes());
        b[at::FD_COUNT].copy_from_slice(&f.fd_count.to_le_bytes());
        // The reserved field stays zero.
        b[at::FABRIC].copy_from_slice(&f.fabric);
        Ok(b)
    }

    /// Decodes and validates one frame of version 1 or 2; any malformed byte is an
    /// [`Error::Protocol`]. Whatever it accepts encodes back to the same bytes, but for a version-1
    /// share, which encodes as version 2.
    pub fn decode(b: &[u8]) -> Result<Message> {
        if b.len() != HEADER_LEN {
            return protocol(format!("a frame is {HEADER_LEN} bytes, not {}", b.len()));
        }
        if b[at::MAGIC] != MAGIC {
            return protocol("bad magic: not a cuvmm message");
        }
        let u16_at = |r| u16::from_le_bytes(field(b, r));
        let u32_at = |r| u32::from_le_bytes(field(b, r));
        let u64_at = |r| u64::from_le_bytes(field(b, r));
        let kind = match u16_at(at::VERSION) {
            1 if u32_at(at::V1_FLAGS) != 0 => {
                return Err(Error::refused(Refusal::BadFlags, "flags must be zero in version 1"))
            }
            1 => Kind::Share,
            2 if u16_at(at::FLAGS) != 0 => {
                return Err(Error::refused(Refusal::BadFlags, "flags must be zero in version 2"))
            }
            2 => Kind::from_code(u16_at(at::KIND))
                .ok_or_else(|| Error::Protocol(format!("unknown message kind {}", u16_at(at::KIND))))?,
            v => {
                return protocol(format!(
                    "unsupported version {v} (this crate reads versions {OLDEST_VERSION} to {VERSION})"
                ))
            }
        };
        if u32_at(at::RESERVED) != 0 {
            return protocol("the reserved field must be zero");
        }
        let f = Fields {
            handle_type: u16_at(at::HANDLE_TYPE),
            size: u64_at(at::SIZE),
            granularity: u64_at(at::GRANULARITY),
            offset: u64_at(at::OFFSET),
            length: u64_at(at::LENGTH),
            device_uuid: field(b, at::DEVICE_UUID),
            tag: u64_at(at::TAG),
            fd_count: u32_at(at::FD_COUNT),
            fabric: field(b, at::FABRIC),
        };
        let m = match kind {
            Kind::Share => Message::Share(Header::new(
                f.wire_handle()?,
                f.size,
                f.granularity,
                f.offset,
                f.length,
                f.device_uuid,
                f.tag,
            )?),
            Kind::Region => {
                Message::Region(Region::new(f.handle_type()?, f.size, f.granularity, f.device_uuid, f.tag)?)
            }
            Kind::Grow => Message::Grow(Grow::new(
                f.wire_handle()?,
                f.size,
                f.granularity,
                f.offset,
                f.device_uuid,
                f.tag,
            )?),
            Kind::Shrink => Message::Shrink { length: f.length, tag: f.tag },
            Kind::Note => Message::Note { tag: f.tag },
        };
        m.validate()?;
        f.must_equal(&m.fields(), kind)?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn sample() -> Header {
        Header::new(WireHandle::PosixFd, 64 << 20, 2 << 20, 2 << 20, 4 << 20, [7; 16], 0xfeed).unwrap()
    }

    fn region() -> Region {
        Region::new(HandleType::PosixFd, 1 << 30, 2 * MIB, [7; 16], 0xabc).unwrap()
    }

    fn grow() -> Grow {
        Grow::new(WireHandle::PosixFd, 4 * MIB, 2 * MIB, 6 * MIB, [7; 16], 3).unwrap()
    }

    /// One valid message of each kind and handle type.
    fn every_kind() -> Vec<Message> {
        vec![
            Message::Share(sample()),
            Message::Share(Header { handle: WireHandle::Fabric([9; 64]), ..sample() }),
            Message::Region(region()),
            Message::Region(Region { handle_type: HandleType::Fabric, ..region() }),
            Message::Grow(grow()),
            Message::Grow(Grow { handle: WireHandle::Fabric([4; 64]), ..grow() }),
            Message::Shrink { length: 6 * MIB, tag: 11 },
            Message::Shrink { length: 0, tag: 0 },
            Message::Note { tag: u64::MAX },
        ]
    }

    fn refused<T: std::fmt::Debug>(r: Result<T>, what: &str) {
        assert!(matches!(&r, Err(e) if e.is_protocol()), "{what} was accepted: {r:?}");
    }

    #[test]
    fn new_refuses_every_forged_field() {
        let make = |size, granularity, offset, length| {
            Header::new(WireHandle::PosixFd, size, granularity, offset, length, [0; 16], 0)
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
    fn region_and_grow_constructors_refuse_every_forged_field() {
        let r = |capacity, granularity| Region::new(HandleType::PosixFd, capacity, granularity, [0; 16], 0);
        assert!(r(2 * MIB, 2 * MIB).is_ok());
        assert!(r(MAX_CAPACITY, MAX_GRANULARITY).is_ok(), "the largest region");
        refused(r(0, 2 * MIB), "a zero capacity");
        refused(r(MAX_CAPACITY + 2 * MIB, 2 * MIB), "a capacity over MAX_CAPACITY");
        refused(r(u64::MAX - (u64::MAX % (2 * MIB)), 2 * MIB), "a huge capacity");
        refused(r(3 * MIB, 2 * MIB), "a capacity off the granularity");
        refused(r(4 * MIB, 3 * MIB), "a granularity that is no power of two");
        refused(r(4 * MIB, 0), "a zero granularity");
        refused(r(4 << 30, 2 << 30), "a granularity over the maximum");

        let g = |size, offset| Grow::new(WireHandle::PosixFd, size, 2 * MIB, offset, [0; 16], 0);
        assert!(g(2 * MIB, 0).is_ok());
        assert!(g(MAX_SIZE, MAX_CAPACITY - MAX_SIZE).is_ok(), "a chunk ending at MAX_CAPACITY");
        refused(g(0, 0), "a zero chunk");
        refused(g(3 * MIB, 0), "a chunk off the granularity");
        refused(g(2 * MIB, MIB), "an offset off the granularity");
        refused(g(MAX_SIZE + 2 * MIB, 0), "a chunk over MAX_SIZE");
        refused(g(4 * MIB, MAX_CAPACITY - 2 * MIB), "a chunk ending past MAX_CAPACITY");
        refused(g(2 * MIB, u64::MAX - (u64::MAX % (2 * MIB))), "an offset + size that overflows");
        refused(Grow::new(WireHandle::PosixFd, 2 * MIB, 3, 0, [0; 16], 0), "a bad granularity");
        refused(Message::Shrink { length: MAX_CAPACITY + 1, tag: 0 }.encode(), "a shrink past MAX_CAPACITY");
        assert!(Message::Shrink { length: MAX_CAPACITY, tag: 0 }.encode().is_ok());
    }

    #[test]
    fn accessors_return_what_was_given() {
        let h = Header::new(WireHandle::Fabric([4; 64]), 8 << 20, 2 << 20, 4096, 8192, [9; 16], 42).unwrap();
        assert_eq!(h.handle(), WireHandle::Fabric([4; 64]));
        assert_eq!((h.size(), h.granularity(), h.offset(), h.length()), (8 << 20, 2 << 20, 4096, 8192));
        assert_eq!((h.device_uuid(), h.tag(), h.fd_count()), ([9; 16], 42, 0));
        assert_eq!(sample().fd_count(), 1);
        let r = region();
        assert_eq!((r.handle_type(), r.capacity(), r.granularity()), (HandleType::PosixFd, 1 << 30, 2 * MIB));
        assert_eq!((r.device_uuid(), r.tag()), ([7; 16], 0xabc));
        let g = grow();
        assert_eq!((g.handle(), g.size(), g.granularity()), (WireHandle::PosixFd, 4 * MIB, 2 * MIB));
        assert_eq!((g.offset(), g.end(), g.device_uuid(), g.tag()), (6 * MIB, 10 * MIB, [7; 16], 3));
        let fds: Vec<usize> = every_kind().iter().map(Message::fd_count).collect();
        assert_eq!(fds, [1, 0, 0, 0, 1, 0, 0, 0, 0]);
        let tags: Vec<u64> = every_kind().iter().map(Message::tag).collect();
        assert_eq!(tags, [0xfeed, 0xfeed, 0xabc, 0xabc, 3, 3, 11, 0, u64::MAX]);
    }

    #[test]
    fn the_fields_tile_the_frame_in_order() {
        let mut next = 0;
        for r in at::V2 {
            assert_eq!(r.start, next, "{r:?}");
            next = r.end;
        }
        assert_eq!(next, HEADER_LEN);
        assert_eq!(at::V1_FLAGS, at::KIND.start..at::FLAGS.end);
    }

    #[test]
    fn handle_codes_read_back() {
        for t in [HandleType::PosixFd, HandleType::Fabric] {
            assert_eq!(HandleType::from_code(t.code()), Some(t));
        }
        assert_eq!(HandleType::from_code(0), None);
    }

    #[test]
    fn round_trip_and_layout() {
        let h = sample();
        let b = h.encode().unwrap();
        assert_eq!(&b[0..8], b"CUVMMIPC");
        assert_eq!(&b[8..10], &[2, 0], "version 2");
        assert_eq!(&b[10..12], &[1, 0], "POSIX fd");
        assert_eq!(&b[12..16], &[0, 0, 0, 0], "kind share, no flags");
        assert_eq!(&b[16..24], &(64u64 << 20).to_le_bytes());
        assert_eq!(&b[72..76], &[1, 0, 0, 0]);
        assert_eq!(Header::decode(&b).unwrap(), h);
        let f = Header { handle: WireHandle::Fabric([9; 64]), ..h };
        let b = f.encode().unwrap();
        assert_eq!(&b[10..12], &[8, 0]);
        assert_eq!(Header::decode(&b).unwrap(), f);

        let b = Message::Region(region()).encode().unwrap();
        assert_eq!((&b[10..12], &b[12..14]), (&[1u8, 0][..], &[1u8, 0][..]));
        assert_eq!(&b[16..24], &(1u64 << 30).to_le_bytes(), "the capacity is in the size field");
        assert_eq!(&b[72..76], &[0, 0, 0, 0], "a region carries no fd, whatever its chunks do");
        let b = Message::Grow(grow()).encode().unwrap();
        assert_eq!((&b[12..14], &b[32..40]), (&[2u8, 0][..], &(6 * MIB).to_le_bytes()[..]));
        assert_eq!((&b[40..48], &b[72..76]), (&[0u8; 8][..], &[1u8, 0, 0, 0][..]));
        let b = Message::Shrink { length: 6 * MIB, tag: 11 }.encode().unwrap();
        assert_eq!((&b[10..14], &b[40..48]), (&[0u8, 0, 3, 0][..], &(6 * MIB).to_le_bytes()[..]));
        assert_eq!(&b[64..72], &11u64.to_le_bytes());
        let b = Message::Note { tag: 5 }.encode().unwrap();
        assert_eq!(&b[12..14], &[4, 0]);
        assert!(b[16..64].iter().chain(&b[72..]).all(|&x| x == 0), "a note is its tag alone");
        for m in every_kind() {
            assert_eq!(Message::decode(&m.encode().unwrap()).unwrap(), m, "{m:?}");
        }
    }

    #[test]
    fn version_1_shares_are_read_and_nothing_else_of_version_1() {
        let mut b = sample().encode().unwrap();
        b[8] = 1;
        assert_eq!(Header::decode(&b).unwrap(), sample(), "a version-1 share");
        assert_eq!(Message::decode(&b).unwrap(), Message::Share(sample()));
        // Version 1 has no kind field: its bytes 12..16 are flags, and must be zero.
        for kind in [1u8, 2, 3, 4] {
            let mut g = Message::Note { tag: 1 }.encode().unwrap();
            g[12] = kind;
            g[8] = 1;
            match Message::decode(&g) {
                Err(e) if e.kind() == crate::ErrorKind::Refused(Refusal::BadFlags) => {}
                other => panic!("a version-1 frame of kind {kind}: {other:?}"),
            }
        }
        let mut b = sample().encode().unwrap();
        b[8] = 1;
        b[15] = 1;
        refused(Message::decode(&b), "version-1 flags");
    }

    #[test]
    fn a_share_receiver_names_the_kind_it_got() {
        for m in every_kind().into_iter().filter(|m| m.kind() != Kind::Share) {
            match Header::decode(&m.encode().unwrap()) {
                Err(e) if e.kind() == crate::ErrorKind::UnexpectedMessage(m.kind()) => {}
                other => panic!("{m:?} decoded as a share: {other:?}"),
            }
        }
    }

    #[test]
    fn every_malformed_header_is_rejected() {
        let good = sample().encode().unwrap();
        let reject = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
            let mut b = good;
            f(&mut b);
            assert!(matches!(Header::decode(&b), Err(e) if e.is_protocol()));
        };
        reject(&|b| b[0] = b'X'); // magic
        reject(&|b| b[8] = 3); // version
        reject(&|b| b[8] = 0);
        reject(&|b| b[10] = 2); // handle type
        reject(&|b| b[12] = 9); // kind
        reject(&|b| b[14] = 1); // flags
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

    /// Every field a kind does not use must be zero, and every field it uses is checked.
    #[test]
    fn each_kind_refuses_bytes_in_fields_it_does_not_use_and_bad_values_in_those_it_does() {
        let reject = |m: Message, at: usize, value: &[u8], what: &str| {
            let mut b = m.encode().unwrap();
            b[at..at + value.len()].copy_from_slice(value);
            refused(Message::decode(&b), &format!("{:?}: {what}", m.kind()));
        };
        let one = 1u64.to_le_bytes();
        let r = Message::Region(region());
        reject(r, 32, &(2 * MIB).to_le_bytes(), "an offset");
        reject(r, 40, &one, "a length");
        reject(r, 72, &[1], "an fd");
        reject(r, 80, &[1], "fabric bytes");
        reject(r, 10, &[0], "no handle type");
        reject(r, 10, &[2], "an unknown handle type");
        reject(r, 16, &0u64.to_le_bytes(), "a zero capacity");
        reject(r, 16, &(MAX_CAPACITY + 2 * MIB).to_le_bytes(), "a capacity past MAX_CAPACITY");
        reject(r, 16, &((1u64 << 30) + 4096).to_le_bytes(), "a capacity off the granularity");
        reject(r, 24, &(3 * MIB).to_le_bytes(), "a granularity that is no power of two");
        let g = Message::Grow(grow());
        reject(g, 40, &one, "a length");
        reject(g, 72, &[0], "no fd with a POSIX handle");
        reject(g, 72, &[2], "two fds");
        reject(g, 80, &[1], "fabric bytes with a POSIX handle");
        reject(g, 10, &[0], "no handle type");
        reject(g, 32, &(MIB).to_le_bytes(), "an offset off the granularity");
        reject(g, 32, &(MAX_CAPACITY - 2 * MIB).to_le_bytes(), "a chunk ending past MAX_CAPACITY");
        reject(g, 32, &u64::MAX.to_le_bytes(), "an offset that overflows");
        reject(g, 16, &0u64.to_le_bytes(), "a zero size");
        let fg = Message::Grow(Grow { handle: WireHandle::Fabric([4; 64]), ..grow() });
        reject(fg, 72, &[1], "an fd with a fabric handle");
        for m in [Message::Shrink { length: 6 * MIB, tag: 1 }, Message::Note { tag: 1 }] {
            for (at, what) in [
                (10, "a handle type"),
                (16, "a size"),
                (24, "a granularity"),
                (32, "an offset"),
                (48, "a device UUID"),
                (63, "a device UUID's last byte"),
                (72, "an fd count"),
                (80, "fabric bytes"),
                (143, "the last fabric byte"),
            ] {
                reject(m, at, &[1], what);
            }
        }
        reject(Message::Note { tag: 1 }, 40, &one, "a note with a length");
        reject(Message::Shrink { length: 0, tag: 1 }, 40, &(MAX_CAPACITY + 1).to_le_bytes(), "a huge shrink");
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
        fn valid_growth_messages_round_trip(
            gshift in 12u32..31, units in 1u64..4096, at in 0u64..1 << 20, uuid in any::<[u8; 16]>(),
            tag in any::<u64>(), fabric in any::<bool>(), length in 0..=MAX_CAPACITY,
        ) {
            let g = 1u64 << gshift;
            let size = units.min(MAX_SIZE / g) * g;
            let offset = (at * g).min(MAX_CAPACITY - size);
            let handle = if fabric { WireHandle::Fabric([tag as u8; 64]) } else { WireHandle::PosixFd };
            let messages = [
                Message::Region(Region::new(handle.handle_type(), size, g, uuid, tag).unwrap()),
                Message::Grow(Grow::new(handle, size, g, offset, uuid, tag).unwrap()),
                Message::Shrink { length, tag },
                Message::Note { tag },
            ];
            for m in messages {
                prop_assert_eq!(Message::decode(&m.encode().unwrap()).unwrap(), m);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = Header::decode(&bytes);
            let _ = Message::decode(&bytes);
        }

        #[test]
        fn single_byte_corruptions_are_caught_or_harmless(
            which in 0usize..9, i in 0usize..HEADER_LEN, v in any::<u8>(),
        ) {
            let mut b = every_kind()[which].encode().unwrap();
            b[i] = v;
            if let Ok(m) = Message::decode(&b) {
                // Whatever still decodes re-encodes to the same bytes (a version-1 share as
                // version 2) and passes validation.
                let mut expect = b;
                expect[8..10].copy_from_slice(&VERSION.to_le_bytes());
                prop_assert_eq!(m.encode().unwrap(), expect);
            }
        }
    }
}
