//! The addresses the stream-ordered allocator hands out and takes back, as a type of their own:
//! a size, a count or a page serial passed where a block's address is wanted does not compile.

use std::fmt;
use std::ops::Add;

/// A device address that [`StreamAllocator`](super::StreamAllocator) handed out, or one inside a
/// block it handed out. The driver's `CUdeviceptr` underneath; printed in hex, as addresses are.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(u64);

impl DevicePtr {
    /// The address `addr` (a `CUdeviceptr`, or a pointer from C).
    pub const fn new(addr: u64) -> DevicePtr {
        DevicePtr(addr)
    }

    /// The address as the driver takes it.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<DevicePtr> for u64 {
    fn from(p: DevicePtr) -> u64 {
        p.0
    }
}

/// The address `bytes` further on: a place inside a block, which the allocator's calls that take
/// "the block holding" an address accept.
impl Add<u64> for DevicePtr {
    type Output = DevicePtr;
    fn add(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

impl fmt::LowerHex for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

/// A live block of a [`StreamAllocator`](super::StreamAllocator)
/// ([`owner_of`](super::StreamAllocator::owner_of)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRange {
    /// The block's address.
    pub start: DevicePtr,
    /// The block's size in bytes.
    pub len: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_prints_in_hex_and_converts_back() {
        let p = DevicePtr::new(0x7f00_0000);
        assert_eq!(format!("{p:?}"), "DevicePtr(0x7f000000)");
        assert_eq!((p + 0x10).get(), 0x7f00_0010);
        assert_eq!(u64::from(p), 0x7f00_0000);
        assert_eq!(format!("{p:#x}"), "0x7f000000");
        let r = BlockRange { start: p, len: 4096 };
        assert_eq!(format!("{r:?}"), "BlockRange { start: DevicePtr(0x7f000000), len: 4096 }");
    }
}
