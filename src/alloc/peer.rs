//! Allocations mapped for exactly the devices the caller names, exportable to other processes.

use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ipc::{share, WireHandle};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::vmm::{round_up, Access, HandleTypes, Mapping, PhysicalBuilder, PhysicalMemory, Reservation};
use std::os::fd::BorrowedFd;

/// How allocations can be exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportMode {
    /// Not at all.
    None,
    /// As POSIX file descriptors (one machine).
    PosixFd,
    /// As fabric handles (needs an IMEX channel; the error says what is missing).
    Fabric,
    /// Fabric handles where an IMEX channel allows, else POSIX fds: see
    /// [`PeerAllocator::handle_types`] for which was chosen.
    Auto,
}

/// Makes allocations on an owner device, mapped read-write for it and with the given access for
/// each named peer, and for no other device, unlike `cuCtxEnablePeerAccess`, which maps every
/// allocation, past and future, for the peer.
pub struct PeerAllocator {
    builder: PhysicalBuilder,
    grants: Vec<(Device, Access)>,
    granularity: usize,
}

impl PeerAllocator {
    /// An allocator on `owner`'s device for the peers in `accessors`.
    pub fn new(owner: &Context, accessors: &[(Device, Access)], mode: ExportMode) -> Result<PeerAllocator> {
        let me = owner.device();
        let mut grants = vec![(me, Access::ReadWrite)];
        for &(d, a) in accessors {
            if d == me {
                continue;
            }
            if !d.can_access_peer(&me)? {
                return Err(Error::unsupported(
                    format!("access from device {} to device {}", d.ordinal(), me.ordinal()),
                    "the driver reports no peer access between them",
                ));
            }
            match grants.iter_mut().find(|(g, _)| *g == d) {
                Some(g) => g.1 = a,
                None => grants.push((d, a)),
            }
        }
        let base = PhysicalMemory::builder(owner);
        let builder = match mode {
            ExportMode::None => base,
            ExportMode::PosixFd => base.handle_types(HandleTypes::POSIX_FD),
            ExportMode::Fabric => {
                let b = base.handle_types(HandleTypes::FABRIC);
                b.create(b.granularity()?.minimum)?; // fails with the missing IMEX channel named
                b
            }
            ExportMode::Auto => {
                let b = base.clone().handle_types(HandleTypes::FABRIC);
                match b.create(b.granularity()?.minimum) {
                    Ok(_) => b,
                    Err(Error::Unsupported { .. }) => base.handle_types(HandleTypes::POSIX_FD),
                    Err(e) => return Err(e),
                }
            }
        };
        let granularity = builder.granularity()?.minimum;
        Ok(PeerAllocator { builder, grants, granularity })
    }

    /// The handle types allocations get (what [`ExportMode::Auto`] chose).
    pub fn handle_types(&self) -> HandleTypes {
        self.builder.get_handle_types()
    }

    /// Allocation sizes are rounded up to this.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The devices and access every new allocation gets.
    pub fn grants(&self) -> &[(Device, Access)] {
        &self.grants
    }

    /// The owner's context.
    pub fn context(&self) -> &Context {
        self.builder.context()
    }

    /// At least `size` bytes (rounded up to the granularity), mapped for exactly the named devices.
    pub fn allocate(&self, size: usize) -> Result<PeerAllocation> {
        let size = round_up(size, self.granularity)?;
        let phys = self.builder.create(size)?;
        let va = Reservation::new(self.context(), size)?;
        let mapping = va.map(0, &phys, 0, size)?;
        mapping.set_access(&self.grants)?;
        Ok(PeerAllocation { mapping, order: crate::stream::order::Tracker::new() })
    }
}

/// One allocation of a [`PeerAllocator`].
#[derive(Debug)]
pub struct PeerAllocation {
    mapping: Mapping,
    /// Streams that used it (see [`crate::stream::order`]).
    order: crate::stream::order::Tracker,
}

impl PeerAllocation {
    /// Its address.
    pub fn ptr(&self) -> u64 {
        self.mapping.ptr()
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The physical memory.
    pub fn physical(&self) -> &PhysicalMemory {
        self.mapping.physical()
    }

    /// Widens or narrows access: each listed device gets the access given (`Access::None` removes
    /// it); others keep theirs.
    pub fn set_access(&self, grants: &[(Device, Access)]) -> Result<()> {
        self.mapping.set_access(grants)
    }

    /// What `device` may do with it now (`cuMemGetAccess`).
    pub fn access(&self, device: Device) -> Result<Access> {
        self.mapping.access(device)
    }

    /// Sends `[offset, offset + length)` of it to the process at the other end of `sock`.
    pub fn share(&self, sock: BorrowedFd<'_>, offset: usize, length: usize, tag: u64) -> Result<WireHandle> {
        share(sock, self.physical(), offset, length, tag)
    }

    /// A device view of it as `T`s.
    pub fn as_slice<T: DeviceCopy>(&self) -> DeviceSlice<'_, T> {
        // SAFETY: mapped and accessible to the owner while self lives.
        unsafe { DeviceSlice::tracked(self.ptr(), self.len() / std::mem::size_of::<T>().max(1), &self.order) }
    }

    /// A writable device view of it as `T`s.
    pub fn as_mut_slice<T: DeviceCopy>(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as above; &mut self makes it unique.
        unsafe {
            DeviceSliceMut::tracked(self.ptr(), self.len() / std::mem::size_of::<T>().max(1), &self.order)
        }
    }
}
