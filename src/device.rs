//! Devices: enumeration and the properties this crate reports.

use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, CStr};
use std::fmt;
use std::sync::Mutex;

/// A CUDA device, by ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: usize,
    raw: CUdevice,
}

/// A device's 16-byte UUID, shown as `nvidia-smi` shows it (`GPU-xxxxxxxx-xxxx-...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Uuid(pub [u8; 16]);

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

fn c_string(buf: &[c_char]) -> String {
    // SAFETY: reinterpreting c_char as u8 changes no size or alignment.
    let bytes: &[u8] = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), buf.len()) };
    CStr::from_bytes_until_nul(bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned())
}

impl Device {
    /// How many devices the driver sees.
    pub fn count() -> Result<usize> {
        let n = result::device::get_count(driver()?.api())?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The device at `ordinal`; an ordinal past the last device is an [`Error::InvalidArgument`].
    pub fn get(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(Error::invalid(format!(
                "device ordinal {ordinal} is out of range: the driver sees {count} device(s)"
            )));
        }
        // ordinal < count fits a c_int, since count came from one.
        let raw = result::device::get(driver()?.api(), ordinal as c_int)?;
        Ok(Device { ordinal, raw })
    }

    /// Every device, in ordinal order.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::get).collect()
    }

    /// The ordinal this device was opened with.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver's handle for this device.
    pub fn raw(&self) -> CUdevice {
        self.raw
    }

    /// The product name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        result::device::get_name(driver()?.api(), &mut buf, self.raw)?;
        Ok(c_string(&buf))
    }

    /// The device's UUID. Asked of the driver once per device and process: it names the hardware
    /// and never changes, and `ipc::share` puts it in every message it sends.
    pub fn uuid(&self) -> Result<Uuid> {
        static KNOWN: Mutex<Vec<(CUdevice, Uuid)>> = Mutex::new(Vec::new());
        let lock = || KNOWN.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, u)) = lock().iter().find(|(d, _)| *d == self.raw) {
            return Ok(u);
        }
        let u = result::device::get_uuid(driver()?.api(), self.raw)?;
        let mut known = lock();
        if !known.iter().any(|(d, _)| *d == self.raw) {
            known.push((self.raw, Uuid(u.bytes)));
        }
        Ok(Uuid(u.bytes))
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        result::device::total_mem(driver()?.api(), self.raw)
    }

    /// An attribute's value.
    pub fn attribute(&self, attr: CUdevice_attribute) -> Result<i32> {
        // Unknown attribute ids are rejected by the driver with an error code.
        result::device::get_attribute(driver()?.api(), attr, self.raw)
    }

    /// An attribute read as a flag.
    pub fn flag(&self, attr: CUdevice_attribute) -> Result<bool> {
        Ok(self.attribute(attr)? != 0)
    }

    /// Compute capability as (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(CUdevice_attribute::COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CUdevice_attribute::COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// The PCI bus id, as `nvidia-smi` prints it (`00000000:1A:00.0`).
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as c_char; 64];
        result::device::get_pci_bus_id(driver()?.api(), &mut buf, self.raw)?;
        Ok(c_string(&buf))
    }

    /// Whether this device can access `peer`'s memory directly. A device is its own peer.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer == self {
            return Ok(true);
        }
        result::device::can_access_peer(driver()?.api(), self.raw, peer.raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_prints_like_nvidia_smi() {
        let u = Uuid([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
        ]);
        assert_eq!(u.to_string(), "GPU-12345678-9abc-def0-0123-456789abcdef");
    }

    #[test]
    fn c_string_stops_at_nul_and_survives_none() {
        let buf: Vec<c_char> = b"H100\0junk".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_string(&buf), "H100");
        let unterminated: Vec<c_char> = b"abc".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_string(&unterminated), "abc");
    }
}
