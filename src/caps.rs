//! The capability report: what each device and the machine support, read from the driver.
//!
//! Reach for it before relying on a feature (POSIX-fd or fabric export, host-located memory,
//! peer access): `cuvmm info` prints the same report.

use crate::context::Context;
use crate::device::Device;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Minimum and recommended allocation granularity for device memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granularity {
    /// What `cuMemCreate` and `cuMemMap` accept at the least.
    pub minimum: usize,
    /// What the driver recommends for performance.
    pub recommended: usize,
}

/// What one device supports. `None` means the driver does not know the attribute (an older driver).
#[derive(Clone, Debug)]
pub struct DeviceCaps {
    /// Ordinal.
    pub ordinal: usize,
    /// Product name.
    pub name: String,
    /// UUID as `nvidia-smi` prints it, if the driver can say.
    pub uuid: Option<String>,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Total memory in bytes.
    pub total_memory: usize,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Multiprocessor count.
    pub multiprocessors: Option<i32>,
    /// `cuMemCreate` and friends work on this device.
    pub vmm: Option<bool>,
    /// Allocations can be exported as POSIX file descriptors.
    pub posix_fd: Option<bool>,
    /// Allocations can be exported as fabric handles (an IMEX channel is still needed: see [`Report::imex`]).
    pub fabric: Option<bool>,
    /// Multicast objects are supported. A query only: this crate never creates one.
    pub multicast: Option<bool>,
    /// Generic compressible memory can be requested.
    pub generic_compression: Option<bool>,
    /// VMM allocations can be GPUDirect-RDMA capable.
    pub rdma_with_vmm: Option<bool>,
    /// `cuMemCreate` accepts host-NUMA locations.
    pub host_numa_vmm: Option<bool>,
    /// `cuMemCreate` accepts host locations.
    pub host_vmm: Option<bool>,
    /// Unified virtual addressing.
    pub unified_addressing: Option<bool>,
    /// Copy engines that can work while kernels run.
    pub async_engine_count: Option<i32>,
    /// Several kernels may run at once.
    pub concurrent_kernels: Option<bool>,
    /// Allocation granularity for device memory, when VMM is supported.
    pub granularity: Option<Granularity>,
}

/// IMEX channel availability: needed to export fabric handles.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImexStatus {
    /// The `nvidia-caps-imex-channels` major number in `/proc/devices`, if the driver registered it.
    pub major: Option<u32>,
    /// The channel nodes found under `/dev/nvidia-caps-imex-channels`.
    pub channels: Vec<ImexChannel>,
}

/// One IMEX channel device node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImexChannel {
    /// Its path.
    pub path: PathBuf,
    /// Whether this process may open it for reading and writing.
    pub accessible: bool,
}

/// Where the driver lists its character devices.
pub const PROC_DEVICES: &str = "/proc/devices";
/// Where IMEX channel nodes live.
pub const IMEX_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

impl ImexStatus {
    /// Reads `/proc/devices` and the channel directory.
    pub fn probe() -> ImexStatus {
        let major = std::fs::read_to_string(PROC_DEVICES).ok().and_then(|t| ImexStatus::parse_major(&t));
        ImexStatus { major, channels: list_channels(Path::new(IMEX_CHANNEL_DIR)) }
    }

    /// The major number of `nvidia-caps-imex-channels` in the text of `/proc/devices`.
    pub fn parse_major(proc_devices: &str) -> Option<u32> {
        proc_devices.lines().find_map(|line| {
            let mut it = line.split_whitespace();
            let major = it.next()?.parse().ok()?;
            (it.next()? == "nvidia-caps-imex-channels" && it.next().is_none()).then_some(major)
        })
    }

    /// Whether fabric handles can be exported from this process: the driver registered the
    /// device and at least one channel node is open to us.
    pub fn usable(&self) -> bool {
        self.major.is_some() && self.channels.iter().any(|c| c.accessible)
    }

    /// Why fabric export cannot work here, or `None` if it can.
    pub fn missing(&self) -> Option<String> {
        if self.major.is_none() {
            return Some(format!("no nvidia-caps-imex-channels device in {PROC_DEVICES}"));
        }
        if self.channels.is_empty() {
            return Some(format!("no channel nodes in {IMEX_CHANNEL_DIR}"));
        }
        if !self.channels.iter().any(|c| c.accessible) {
            return Some(format!("no channel in {IMEX_CHANNEL_DIR} is readable and writable by this user"));
        }
        None
    }
}

fn list_channels(dir: &Path) -> Vec<ImexChannel> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<ImexChannel> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("channel"))
        .map(|e| {
            let path = e.path();
            let accessible =
                nix::unistd::access(&path, nix::unistd::AccessFlags::R_OK | nix::unistd::AccessFlags::W_OK)
                    .is_ok();
            ImexChannel { path, accessible }
        })
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// The whole report.
#[derive(Clone, Debug)]
pub struct Report {
    /// The driver's CUDA version (13000 = 13.0).
    pub driver_version: i32,
    /// The library that was opened.
    pub library: String,
    /// One entry per device.
    pub devices: Vec<DeviceCaps>,
    /// `peer_access[i][j]`: device i can access device j's memory.
    pub peer_access: Vec<Vec<bool>>,
    /// IMEX channels on this machine.
    pub imex: ImexStatus,
}

/// Reads an attribute, mapping "the driver does not know this attribute" to `None`.
fn maybe(dev: &Device, attr: CUdevice_attribute) -> Result<Option<i32>> {
    match dev.attribute(attr) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_code(CUresult::ERROR_INVALID_VALUE) => Ok(None),
        Err(e) => Err(e),
    }
}

fn flag(dev: &Device, attr: CUdevice_attribute) -> Result<Option<bool>> {
    Ok(maybe(dev, attr)?.map(|v| v != 0))
}

/// Granularity of pinned device memory on `dev` for the given handle types.
pub fn device_granularity(dev: &Device, handles: CUmemAllocationHandleType) -> Result<Granularity> {
    let prop = CUmemAllocationProp {
        type_: CUmemAllocationType::PINNED,
        requestedHandleTypes: handles,
        location: CUmemLocation { type_: CUmemLocationType::DEVICE, id: dev.raw() },
        ..Default::default()
    };
    granularity_of(&prop, Some(dev))
}

/// What a granularity answer depends on: every field of `CUmemAllocationProp` but the Windows
/// handle metadata (always null here).
#[derive(Clone, Copy, PartialEq, Eq)]
struct GranularityKey {
    kind: CUmemAllocationType,
    handles: CUmemAllocationHandleType,
    location: CUmemLocation,
    flags: CUmemAllocFlags,
}

/// The granularities the driver has reported so far in this process. They depend only on the
/// properties asked about and on the device, which do not change while the process runs, so each
/// is asked once, where `Reservation::new`, `ipc::share`, `SharedMemory::import` and every fresh
/// `PhysicalBuilder` would otherwise make two `cuMemGetAllocationGranularity` calls each.
static GRANULARITIES: std::sync::Mutex<Vec<(GranularityKey, Granularity)>> =
    std::sync::Mutex::new(Vec::new());

fn granularity_key(prop: &CUmemAllocationProp) -> Option<GranularityKey> {
    prop.win32HandleMetaData.is_null().then_some(GranularityKey {
        kind: prop.type_,
        handles: prop.requestedHandleTypes,
        location: prop.location,
        flags: prop.allocFlags,
    })
}

/// The cached granularity for `prop`, if the driver was asked before.
pub(crate) fn cached_granularity(prop: &CUmemAllocationProp) -> Option<Granularity> {
    let key = granularity_key(prop)?;
    let cache = GRANULARITIES.lock().unwrap_or_else(|e| e.into_inner());
    cache.iter().find(|(k, _)| *k == key).map(|(_, g)| *g)
}

/// Granularity for an allocation described by `prop`, asked of the driver once per process (see
/// [`GRANULARITIES`]). Some drivers want a current context for this query; `dev`'s primary
/// context is bound and the query retried if so. Failures are not remembered.
pub(crate) fn granularity_of(prop: &CUmemAllocationProp, dev: Option<&Device>) -> Result<Granularity> {
    if let Some(g) = cached_granularity(prop) {
        return Ok(g);
    }
    let g = query_granularity(prop, dev)?;
    if let Some(key) = granularity_key(prop) {
        let mut cache = GRANULARITIES.lock().unwrap_or_else(|e| e.into_inner());
        if !cache.iter().any(|(k, _)| *k == key) {
            cache.push((key, g));
        }
    }
    Ok(g)
}

fn query_granularity(prop: &CUmemAllocationProp, dev: Option<&Device>) -> Result<Granularity> {
    let api = driver()?.api();
    let query = |flag| result::mem::get_allocation_granularity(api, prop, flag);
    let both = || -> Result<Granularity> {
        Ok(Granularity {
            minimum: query(CUmemAllocationGranularity_flags::MINIMUM)?,
            recommended: query(CUmemAllocationGranularity_flags::RECOMMENDED)?,
        })
    };
    match (both(), dev) {
        (Err(e), Some(dev)) if e.is_code(CUresult::ERROR_INVALID_CONTEXT) => {
            let ctx = Context::new(*dev)?;
            ctx.bind()?;
            both()
        }
        (r, _) => r,
    }
}

impl DeviceCaps {
    /// Queries every capability of `dev`.
    pub fn query(dev: &Device) -> Result<DeviceCaps> {
        use CUdevice_attribute as A;
        let vmm = flag(dev, A::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?;
        let uuid = match dev.uuid() {
            Ok(u) => Some(u.to_string()),
            Err(Error::Unsupported { .. }) => None,
            Err(e) => return Err(e),
        };
        Ok(DeviceCaps {
            ordinal: dev.ordinal(),
            name: dev.name()?,
            uuid,
            pci_bus_id: dev.pci_bus_id()?,
            total_memory: dev.total_memory()?,
            compute_capability: dev.compute_capability()?,
            multiprocessors: maybe(dev, A::MULTIPROCESSOR_COUNT)?,
            vmm,
            posix_fd: flag(dev, A::HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
            fabric: flag(dev, A::HANDLE_TYPE_FABRIC_SUPPORTED)?,
            multicast: flag(dev, A::MULTICAST_SUPPORTED)?,
            generic_compression: flag(dev, A::GENERIC_COMPRESSION_SUPPORTED)?,
            rdma_with_vmm: flag(dev, A::GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?,
            host_numa_vmm: flag(dev, A::HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?,
            host_vmm: flag(dev, A::HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?,
            unified_addressing: flag(dev, A::UNIFIED_ADDRESSING)?,
            async_engine_count: maybe(dev, A::ASYNC_ENGINE_COUNT)?,
            concurrent_kernels: flag(dev, A::CONCURRENT_KERNELS)?,
            granularity: if vmm == Some(true) {
                Some(device_granularity(dev, CUmemAllocationHandleType::NONE)?)
            } else {
                None
            },
        })
    }
}

impl Report {
    /// Queries the driver, every device and the IMEX channels.
    pub fn query() -> Result<Report> {
        let d = driver()?;
        let devs = Device::all()?;
        let devices = devs.iter().map(DeviceCaps::query).collect::<Result<Vec<_>>>()?;
        let peer_access = devs
            .iter()
            .map(|a| devs.iter().map(|b| a.can_access_peer(b)).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        Ok(Report {
            driver_version: d.version(),
            library: d.library().to_owned(),
            devices,
            peer_access,
            imex: ImexStatus::probe(),
        })
    }
}

/// `13000` → `"13.0"`.
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imex_major_is_found_only_on_its_own_line() {
        let text = "Character devices:\n195 nvidia\n195 nvidiactl\n234 nvidia-caps-imex-channels\n509 nvidia-nvswitch\n";
        assert_eq!(ImexStatus::parse_major(text), Some(234));
        assert_eq!(ImexStatus::parse_major("195 nvidia\n510 nvidia-caps\n"), None);
        assert_eq!(ImexStatus::parse_major("x nvidia-caps-imex-channels\n"), None);
        assert_eq!(ImexStatus::parse_major("12 nvidia-caps-imex-channels-extra\n"), None);
    }

    #[test]
    fn imex_usable_needs_an_accessible_channel() {
        let mut s = ImexStatus::default();
        assert!(!s.usable());
        assert!(s.missing().unwrap().contains("/proc/devices"));
        s.major = Some(234);
        assert!(s.missing().unwrap().contains("no channel nodes"));
        s.channels.push(ImexChannel { path: "/dev/x/channel0".into(), accessible: false });
        assert!(!s.usable());
        assert!(s.missing().unwrap().contains("readable and writable"));
        s.channels[0].accessible = true;
        assert!(s.usable());
        assert_eq!(s.missing(), None);
    }

    #[test]
    fn channel_listing_of_a_missing_directory_is_empty() {
        assert!(list_channels(Path::new("/nonexistent/imex")).is_empty());
    }

    #[test]
    fn versions_print_as_major_minor() {
        assert_eq!(version_string(13000), "13.0");
        assert_eq!(version_string(12040), "12.4");
    }
}
