//! `cuvmm info`.

use crate::common::CliResult;
use cuvmm::caps::{version_string, DeviceCaps, Report};
use serde_json::json;
use std::io::Write;

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown to this driver",
    }
}

fn gib(bytes: usize) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn mib(bytes: usize) -> String {
    format!("{} MiB", bytes >> 20)
}

pub fn run(json: bool) -> CliResult {
    let report = Report::query()?;
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&to_json(&report))?)?;
    } else {
        write_table(&mut out, &report)?;
    }
    Ok(())
}

pub(super) fn write_table(out: &mut impl Write, r: &Report) -> std::io::Result<()> {
    writeln!(
        out,
        "CUDA driver {} ({}), {} device(s)",
        version_string(r.driver_version),
        r.library,
        r.devices.len()
    )?;
    for d in &r.devices {
        writeln!(out)?;
        writeln!(
            out,
            "device {}: {}, sm_{}{}, {}",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            gib(d.total_memory)
        )?;
        writeln!(
            out,
            "  uuid / pci bus id            {} / {}",
            d.uuid.as_deref().unwrap_or("-"),
            d.pci_bus_id
        )?;
        let rows: [(&str, String); 14] = [
            ("virtual memory management", yes_no(d.vmm).into()),
            ("POSIX fd handles", yes_no(d.posix_fd).into()),
            ("fabric handles", fabric_line(d, r)),
            ("multicast (query only)", yes_no(d.multicast).into()),
            ("generic compression", yes_no(d.generic_compression).into()),
            ("GPUDirect RDMA with VMM", yes_no(d.rdma_with_vmm).into()),
            ("host-NUMA VMM", yes_no(d.host_numa_vmm).into()),
            ("host VMM", yes_no(d.host_vmm).into()),
            ("unified addressing", yes_no(d.unified_addressing).into()),
            ("concurrent kernels", yes_no(d.concurrent_kernels).into()),
            ("async copy engines", d.async_engine_count.map_or("-".into(), |n| n.to_string())),
            ("multiprocessors", d.multiprocessors.map_or("-".into(), |n| n.to_string())),
            ("granularity, minimum", d.granularity.map_or("-".into(), |g| mib(g.minimum))),
            ("granularity, recommended", d.granularity.map_or("-".into(), |g| mib(g.recommended))),
        ];
        for (k, v) in rows {
            writeln!(out, "  {k:<28} {v}")?;
        }
    }
    if r.devices.len() > 1 {
        writeln!(out, "\npeer access (row can access column):")?;
        write!(out, "     ")?;
        for j in 0..r.devices.len() {
            write!(out, "{j:>4}")?;
        }
        writeln!(out)?;
        for (i, row) in r.peer_access.iter().enumerate() {
            write!(out, "  {i:>3}")?;
            for (j, &ok) in row.iter().enumerate() {
                write!(
                    out,
                    "{:>4}",
                    if i == j {
                        "-"
                    } else if ok {
                        "yes"
                    } else {
                        "no"
                    }
                )?;
            }
            writeln!(out)?;
        }
    }
    writeln!(out, "\nIMEX channels: {}", r.imex.missing().unwrap_or_else(|| "usable".into()))?;
    Ok(())
}

fn fabric_line(d: &DeviceCaps, r: &Report) -> String {
    match (d.fabric, r.imex.missing()) {
        (Some(true), None) => "yes, IMEX channel usable".into(),
        (Some(true), Some(why)) => format!("yes, but export needs an IMEX channel: {why}"),
        (v, _) => yes_no(v).into(),
    }
}

fn to_json(r: &Report) -> serde_json::Value {
    let devices: Vec<_> = r
        .devices
        .iter()
        .map(|d| {
            json!({
                "ordinal": d.ordinal,
                "name": d.name,
                "uuid": d.uuid,
                "pci_bus_id": d.pci_bus_id,
                "total_memory": d.total_memory,
                "compute_capability": [d.compute_capability.0, d.compute_capability.1],
                "multiprocessors": d.multiprocessors,
                "vmm": d.vmm,
                "posix_fd": d.posix_fd,
                "fabric": d.fabric,
                "multicast": d.multicast,
                "generic_compression": d.generic_compression,
                "rdma_with_vmm": d.rdma_with_vmm,
                "host_numa_vmm": d.host_numa_vmm,
                "host_vmm": d.host_vmm,
                "unified_addressing": d.unified_addressing,
                "async_engine_count": d.async_engine_count,
                "concurrent_kernels": d.concurrent_kernels,
                "granularity": d.granularity.map(|g| json!({"minimum": g.minimum, "recommended": g.recommended})),
            })
        })
        .collect();
    json!({
        "driver_version": version_string(r.driver_version),
        "driver_version_raw": r.driver_version,
        "library": r.library,
        "devices": devices,
        "peer_access": r.peer_access,
        "imex": {
            "major": r.imex.major,
            "channels": r.imex.channels.iter().map(|c| json!({"path": c.path, "accessible": c.accessible})).collect::<Vec<_>>(),
            "usable": r.imex.usable(),
            "missing": r.imex.missing(),
        },
    })
}
