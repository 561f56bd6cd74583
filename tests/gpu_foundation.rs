//! Foundation checks that need a CUDA GPU (run with `cargo test -- --include-ignored`, or in a
//! bundle from `tools/gpu-bundle`).

use cuvmm::caps::{DeviceCaps, Report};
use cuvmm::driver::{driver, result, sys::CUresult};
use cuvmm::{Context, Device, Error};
use std::process::Command;

/// (domain, bus, device, function) from `0000:1A:00.0` or `00000000:1a:00.0`.
fn pci(s: &str) -> (u32, u32, u32, u32) {
    let (dom, rest) = s.trim().split_once(':').unwrap();
    let (bus, rest) = rest.split_once(':').unwrap();
    let (dev, func) = rest.split_once('.').unwrap();
    let h = |x: &str| u32::from_str_radix(x, 16).unwrap();
    (h(dom), h(bus), h(dev), h(func))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn enumeration_matches_nvidia_smi() {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=name,uuid,pci.bus_id,memory.total", "--format=csv,noheader,nounits"])
        .output()
        .expect("nvidia-smi");
    assert!(out.status.success());
    let smi: Vec<Vec<String>> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split(',').map(|f| f.trim().to_owned()).collect())
        .collect();
    let devices = Device::all().unwrap();
    // nvidia-smi lists every GPU; CUDA_VISIBLE_DEVICES may show the driver fewer (each of which
    // nvidia-smi still lists, which the loop checks).
    if std::env::var_os("CUDA_VISIBLE_DEVICES").is_none() {
        assert_eq!(devices.len(), smi.len(), "device count");
    }
    assert!(!devices.is_empty() && devices.len() <= smi.len(), "device count");
    for d in &devices {
        let uuid = d.uuid().unwrap().to_string();
        let row = smi.iter().find(|r| r[1] == uuid).unwrap_or_else(|| panic!("{uuid} not in nvidia-smi"));
        assert_eq!(d.name().unwrap(), row[0]);
        assert_eq!(pci(&d.pci_bus_id().unwrap()), pci(&row[2]));
        let smi_mib: u64 = row[3].parse().unwrap();
        let ours_mib = d.total_memory().unwrap() as u64 >> 20;
        // nvidia-smi counts the memory the driver reserves for itself (480 MiB on an H100 with
        // driver 580); cuDeviceTotalMem does not.
        assert!(
            ours_mib <= smi_mib && smi_mib - ours_mib < 1024,
            "memory: ours {ours_mib} MiB, nvidia-smi {smi_mib} MiB"
        );
        eprintln!("device {}: {} {} {} {} MiB", d.ordinal(), row[0], uuid, row[2], ours_mib);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_reports_vmm_posix_fd_and_2_mib_granularity() {
    let devices = Device::all().unwrap();
    assert!(!devices.is_empty());
    for d in &devices {
        let caps = DeviceCaps::query(d).unwrap();
        if caps.compute_capability.0 < 9 {
            continue;
        }
        assert_eq!(caps.vmm, Some(true));
        assert_eq!(caps.posix_fd, Some(true));
        assert_eq!(caps.unified_addressing, Some(true));
        let g = caps.granularity.expect("granularity");
        assert_eq!(g.minimum, 2 << 20);
        assert!(g.recommended >= g.minimum && g.recommended % g.minimum == 0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_attribute_query_returns_without_error() {
    let r = Report::query().unwrap();
    assert!(r.driver_version >= 12000, "driver {}", r.driver_version);
    for d in &r.devices {
        let flags = [
            d.vmm,
            d.posix_fd,
            d.fabric,
            d.multicast,
            d.generic_compression,
            d.rdma_with_vmm,
            d.host_numa_vmm,
            d.host_vmm,
            d.unified_addressing,
            d.concurrent_kernels,
        ];
        assert!(flags.iter().all(Option::is_some), "an attribute was unknown: {d:?}");
        assert!(d.async_engine_count.is_some() && d.multiprocessors.is_some() && d.uuid.is_some());
    }
    assert_eq!(r.peer_access.len(), r.devices.len());
    for (i, row) in r.peer_access.iter().enumerate() {
        assert!(row[i], "a device is its own peer");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn contexts_work_from_several_threads() {
    let ctx = Context::for_ordinal(0).unwrap();
    let total = ctx.memory_info().unwrap().total;
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                let api = driver().unwrap().api();
                ctx.bind().unwrap();
                let bytes = (i + 1) << 20;
                let p = result::mem::alloc(api, bytes).unwrap();
                let data: Vec<u8> = (0..bytes).map(|k| (k * 7 + i) as u8).collect();
                let mut back = vec![0u8; bytes];
                // SAFETY: both buffers are `bytes` long; p is a live allocation of that size.
                unsafe {
                    result::mem::memcpy_htod(api, p, data.as_ptr().cast(), bytes).unwrap();
                    result::mem::memcpy_dtoh(api, back.as_mut_ptr().cast(), p, bytes).unwrap();
                    result::mem::free(api, p).unwrap();
                }
                assert_eq!(back, data);
                assert_eq!(ctx.memory_info().unwrap().total, total);
                ctx.synchronize().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // A clone dropped on another thread leaves the context usable here.
    let c2 = ctx.clone();
    std::thread::spawn(move || drop(c2)).join().unwrap();
    ctx.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_device_ordinals_are_typed_errors() {
    let n = Device::count().unwrap();
    assert!(matches!(Device::get(n), Err(Error::InvalidArgument(_))));
    assert!(matches!(Context::for_ordinal(n + 7), Err(Error::InvalidArgument(_))));
    // And a driver-side rejection keeps the driver's own name.
    let api = driver().unwrap().api();
    // The attribute id is deliberately unknown.
    let err =
        result::device::get_attribute(api, cuvmm::driver::sys::CUdevice_attribute(100_000), 0).unwrap_err();
    assert_eq!(err.code(), Some(CUresult::ERROR_INVALID_VALUE));
    assert!(err.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{err}");
}
