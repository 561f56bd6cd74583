//! Sharing allocations with other processes: the wire format, the socket transport, and the
//! import side.

pub mod shared;
pub mod socket;
pub mod wire;

pub use shared::{share, SharedMemory};
pub use socket::{check_peer, recv, send, Credentials, PeerPolicy, Received};
pub use wire::{Header, WireHandle};
