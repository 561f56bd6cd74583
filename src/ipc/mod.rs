//! Sharing allocations with other processes: the wire format, the socket transport, and the
//! import side.
//!
//! Reach for it to hand device memory to another process on the same machine (or, with fabric
//! handles and IMEX, another node): [`share`] on one side, [`recv_message`] and [`SharedMemory::import`]
//! on the other. A vector that keeps growing is shared with
//! [`VmmVec::share_growth`](crate::VmmVec::share_growth) and followed with [`GrowableImport`].
//! Peers in other languages follow `docs/WIRE.md`. Everything received is validated; see
//! `docs/SOUNDNESS.md` for what a hostile peer cannot do.

pub mod growth;
pub mod handoff;
pub mod region;
pub mod shared;
pub mod socket;
pub mod wire;

pub use growth::{GrowableImport, Update};
pub use region::{RegionLayout, RegionRefusal, Step};
pub use shared::{share, SharedMemory};
pub use socket::{
    check_peer, recv_message, recv_message_deadline, send_message, Credentials, FrameReader, Incoming,
    PeerPolicy,
};
pub use wire::{Header, Message, WireHandle};
