//! Sharing allocations with other processes: the wire format, the socket transport, and the
//! import side.
//!
//! Reach for it to hand device memory to another process on the same machine (or, with fabric
//! handles and IMEX, another node): [`share`] on one side, [`recv`] and [`SharedMemory::import`]
//! on the other. Peers in other languages follow `docs/WIRE.md`. Everything received is
//! validated; see the README's "Soundness" section for what a hostile peer cannot do.

pub mod shared;
pub mod socket;
pub mod wire;

pub use shared::{share, SharedMemory};
pub use socket::{check_peer, recv, send, Credentials, PeerPolicy, Received};
pub use wire::{Header, WireHandle};
