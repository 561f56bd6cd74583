//! The VMM core: physical memory, address reservations, mappings, access, striping, and the
//! growable [`VmmVec`] built on them.
//!
//! Reach for [`VmmVec`] when you need a device array that grows; for the pieces
//! ([`PhysicalMemory`], [`Reservation`], [`Mapping`]) when you write an allocator, alias memory at
//! several addresses, or lay one array over several GPUs ([`Striped`]).
//!
//! ```no_run
//! # fn main() -> cuvmm::Result<()> {
//! use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
//! let ctx = cuvmm::Context::for_ordinal(0)?;
//! let phys = PhysicalMemory::builder(&ctx).create(2 << 20)?;
//! let va = Reservation::new(&ctx, 4 << 20)?;
//! let a = va.map(0, &phys, 0, 2 << 20)?;       // the same memory…
//! let b = va.map(2 << 20, &phys, 0, 2 << 20)?; // …at a second address: a virtual alias
//! a.set_access(&[(ctx.device(), Access::ReadWrite)])?;
//! b.set_access(&[(ctx.device(), Access::Read)])?;
//! # Ok(()) }
//! ```
//!
//! # Ordering between aliases
//! Writes through one mapping of an allocation are only guaranteed visible through another mapping
//! of it once the writing operation (kernel, copy, memset) has completed and the reading operation
//! is ordered after it by a stream or an event. Two aliases used inside one kernel need a
//! `fence.proxy.alias` between the accesses.

mod layout;
mod physical;
pub(crate) use physical::{placements, released_exports};
pub(crate) use vec::Followers;
mod reservation;
mod stripe;
mod vec;

pub use layout::{bytes_for, check_aligned, round_up, ChunkPolicy};
pub use physical::{AllocationProperties, HandleTypes, Location, PhysicalBuilder, PhysicalMemory};
pub use reservation::{Access, Mapping, Reservation};
pub use stripe::Striped;
pub use vec::{RawVmm, VmmVec, VmmVecBuilder};
