//! Values that the errors of the sharing protocol carry: below [`crate::error`] and
//! [`crate::ipc`] alike, so that neither imports the other's types ([`crate::ipc`] re-exports
//! them where they were).

use std::fmt;

/// Whose messages a receiver accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only a peer running as this process's own user, effective uids compared (the default).
    #[default]
    SameUid,
    /// Only a peer running as this user id.
    Uid(u32),
    /// Anyone who can reach the socket.
    AnyUid,
}

/// A handle type without a handle: how every chunk of a growing region travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandleType {
    /// POSIX file descriptors (wire value 1).
    PosixFd,
    /// Fabric handles (wire value 8).
    Fabric,
}

impl HandleType {
    /// The wire value: `CUmemAllocationHandleType`'s.
    pub fn code(self) -> u16 {
        match self {
            HandleType::PosixFd => 1,
            HandleType::Fabric => 8,
        }
    }

    pub(crate) fn from_code(code: u16) -> Option<HandleType> {
        [HandleType::PosixFd, HandleType::Fabric].into_iter().find(|t| t.code() == code)
    }
}

/// What a frame is: the kind field (bytes 12..14 in version 2; a version-1 frame is a share).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One range of one allocation ([`Header`](crate::ipc::wire::Header)), wire value 0.
    Share,
    /// Opens a growing region on the connection ([`Region`](crate::ipc::wire::Region)), wire value 1.
    Region,
    /// One more chunk of the region ([`Grow`](crate::ipc::wire::Grow)), wire value 2.
    Grow,
    /// The region's chunks past a length are gone ([`Message::Shrink`](crate::ipc::wire::Message::Shrink)), wire value 3.
    Shrink,
    /// A value of the sender's, ordered with the growth ([`Message::Note`](crate::ipc::wire::Message::Note)), wire value 4.
    Note,
}

impl Kind {
    /// The wire value.
    pub fn code(self) -> u16 {
        match self {
            Kind::Share => 0,
            Kind::Region => 1,
            Kind::Grow => 2,
            Kind::Shrink => 3,
            Kind::Note => 4,
        }
    }

    pub(crate) fn from_code(code: u16) -> Option<Kind> {
        [Kind::Share, Kind::Region, Kind::Grow, Kind::Shrink, Kind::Note]
            .into_iter()
            .find(|k| k.code() == code)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Share => "share",
            Kind::Region => "region",
            Kind::Grow => "grow",
            Kind::Shrink => "shrink",
            Kind::Note => "note",
        })
    }
}

/// Which rule of the layout a message broke ([`Error::RegionRefused`](crate::Error::RegionRefused)): what an importer, or a
/// test, tells apart without reading the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionRefusal {
    /// A message of this kind came before the region message.
    BeforeRegion(Kind),
    /// A second region message on the connection.
    SecondRegion,
    /// A share message on a connection that follows a region.
    ShareInRegion,
    /// The region asks for more address space than the importer allows.
    OverLimit {
        /// Bytes the region asks for.
        capacity: u64,
        /// Bytes this importer allows.
        limit: u64,
    },
    /// The region's capacity is not a multiple of the importer's granularity.
    CapacityOffGranularity {
        /// Bytes the region asks for.
        capacity: u64,
        /// The importer's granularity.
        granularity: u64,
    },
    /// A chunk travels as another handle type than its region's.
    HandleType {
        /// The chunk's.
        chunk: HandleType,
        /// The region's.
        region: HandleType,
    },
    /// A chunk's granularity or device differs from its region's.
    ChunkOfAnotherRegion,
    /// A chunk does not start where the mapped part ends (a gap or an overlap).
    NotAtTheEnd {
        /// Where the chunk starts.
        offset: u64,
        /// Where the mapped part ends.
        end: u64,
    },
    /// A chunk ends past the region's capacity.
    PastTheRegion {
        /// Where the chunk starts.
        offset: u64,
        /// Its size.
        size: u64,
        /// The region's capacity.
        capacity: u64,
    },
    /// A chunk's size is not a multiple of the importer's granularity.
    SizeOffGranularity {
        /// The chunk's size.
        size: u64,
        /// The importer's granularity.
        granularity: u64,
    },
    /// A shrink to more than is mapped.
    ShrinkPastTheEnd {
        /// The length asked for.
        length: u64,
        /// Bytes mapped.
        end: u64,
    },
    /// A shrink whose length falls inside a chunk.
    ShrinkInsideAChunk {
        /// The length asked for.
        length: u64,
    },
}

impl fmt::Display for RegionRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RegionRefusal::BeforeRegion(kind) => write!(f, "a {kind} message before the region message"),
            RegionRefusal::SecondRegion => f.write_str("a second region message on one connection"),
            RegionRefusal::ShareInRegion => {
                f.write_str("a share message on a connection that follows a region")
            }
            RegionRefusal::OverLimit { capacity, limit } => {
                write!(
                    f,
                    "the region asks for {capacity} bytes of address space; this importer allows {limit}"
                )
            }
            RegionRefusal::CapacityOffGranularity { capacity, granularity } => {
                write!(f, "capacity {capacity} is not a multiple of this device's granularity {granularity}")
            }
            RegionRefusal::HandleType { chunk, region } => {
                write!(f, "a chunk travels as {chunk:?} in a region of {region:?} chunks")
            }
            RegionRefusal::ChunkOfAnotherRegion => {
                f.write_str("a chunk's granularity or device differs from its region's")
            }
            RegionRefusal::NotAtTheEnd { offset, end } => write!(
                f,
                "a chunk at {offset} where the mapped part ends at {end} (chunks follow each other, with no \
                 gap or overlap)"
            ),
            RegionRefusal::PastTheRegion { offset, size, capacity } => {
                write!(f, "chunk {offset}+{size} ends past the {capacity}-byte region")
            }
            RegionRefusal::SizeOffGranularity { size, granularity } => {
                write!(f, "chunk size {size} is not a multiple of this device's granularity {granularity}")
            }
            RegionRefusal::ShrinkPastTheEnd { length, end } => {
                write!(f, "a shrink to {length} bytes where {end} are mapped")
            }
            RegionRefusal::ShrinkInsideAChunk { length } => {
                write!(f, "a shrink to {length} bytes, inside a chunk")
            }
        }
    }
}
