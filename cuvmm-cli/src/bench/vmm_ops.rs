//! `cuvmm bench vmm-ops`: latency of create / map / set-access / unmap / release per chunk size,
//! raw driver calls against the crate's types, measured in the same run.

use super::{median, timed};
use crate::common::size::{parse_sizes, show};
use crate::common::CliResult;
use cuvmm::context::Context;
use cuvmm::driver::{driver, result, sys::*};
use cuvmm::error::Result;
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use serde_json::json;
use std::io::Write;
use std::sync::{Arc, Mutex};

/// The operations measured, in the order a chunk's life runs through them.
pub const OPS: [&str; 5] = ["create", "map", "set_access", "unmap", "release"];

/// Medians in microseconds for one chunk size.
#[derive(Clone, Debug)]
pub struct OpsRow {
    /// Chunk size in bytes.
    pub size: usize,
    /// Repetitions timed.
    pub reps: usize,
    /// Raw driver calls, one per entry of [`OPS`]. `unmap` includes the context synchronisation
    /// that must precede it (the crate does the same), so both sides do the same work.
    pub raw_us: [f64; 5],
    /// The crate's types: `PhysicalBuilder::create`, `Reservation::map`, `Mapping::set_access`,
    /// dropping the `Mapping`, dropping the `PhysicalMemory`.
    pub crate_us: [f64; 5],
    /// The raw `cuMemMap` with the synchronisation and ownership a `Mapping` of a shared,
    /// thread-safe `Reservation` needs around it, done on structures of its own: a mutex locked
    /// across the call, the range recorded in a sorted vector under it, and two reference counts
    /// raised (the reservation's and the physical memory's), as `Reservation::map` does.
    pub floor_map_us: f64,
}

impl OpsRow {
    /// Crate time over raw time, per op, minus one.
    pub fn overhead(&self) -> [f64; 5] {
        std::array::from_fn(|i| self.crate_us[i] / self.raw_us[i] - 1.0)
    }

    /// Whole-life overhead: sum over ops.
    pub fn total_overhead(&self) -> f64 {
        self.crate_us.iter().sum::<f64>() / self.raw_us.iter().sum::<f64>() - 1.0
    }
}

fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// What [`raw_cycle`] does around its `cuMemMap` when it measures the floor (see
/// [`OpsRow::floor_map_us`]): heap structures like the crate's, touched the way its map touches them.
struct Floor {
    ranges: Mutex<Vec<(usize, usize)>>,
    reservation: Arc<u64>,
    physical: Arc<u64>,
}

fn raw_cycle(
    ctx: &Context,
    size: usize,
    va: CUdeviceptr,
    prop: &CUmemAllocationProp,
    floor: Option<&Floor>,
) -> Result<[f64; 5]> {
    let api = driver()?.api();
    let desc = CUmemAccessDesc {
        location: CUmemLocation { type_: CUmemLocationType::DEVICE, id: ctx.device().raw() },
        flags: CUmemAccess_flags::PROT_READWRITE,
    };
    // For the calls below: `va` is a reserved range of at least `size` bytes, unmapped at entry
    // and at exit; the handle is created and released here.
    let (r, t0) = timed(|| result::mem::create(api, size, prop));
    let h = r?;
    let (r, t1) = timed(|| {
        let Some(f) = floor else {
            // SAFETY: see above.
            return unsafe { result::mem::map(api, va, size, 0, h) }.map(|()| None);
        };
        let mut ranges = f.ranges.lock().unwrap_or_else(|e| e.into_inner());
        let at = ranges.partition_point(|&(o, _)| o < size);
        // SAFETY: see above.
        unsafe { result::mem::map(api, va, size, 0, h) }?;
        ranges.insert(at, (0, size));
        Ok(Some((Arc::clone(&f.reservation), Arc::clone(&f.physical))))
    });
    let owners = r?;
    if let Some(f) = floor {
        f.ranges.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
    drop(owners);
    // SAFETY: see above.
    let (r, t2) = timed(|| unsafe { result::mem::set_access(api, va, size, &[desc]) });
    r?;
    // SAFETY: see above.
    let (r, t3) =
        timed(|| result::ctx::synchronize(api).and_then(|()| unsafe { result::mem::unmap(api, va, size) }));
    r?;
    // SAFETY: see above.
    let (r, t4) = timed(|| unsafe { result::mem::release(api, h) });
    r?;
    Ok([us(t0), us(t1), us(t2), us(t3), us(t4)])
}

fn crate_cycle(ctx: &Context, size: usize, va: &Reservation) -> Result<[f64; 5]> {
    let builder = PhysicalMemory::builder(ctx);
    let (phys, t0) = timed(|| builder.create(size));
    let phys = phys?;
    let (m, t1) = timed(|| va.map(0, &phys, 0, size));
    let m = m?;
    let (r, t2) = timed(|| m.set_access(&[(ctx.device(), Access::ReadWrite)]));
    r?;
    let ((), t3) = timed(|| drop(m));
    let ((), t4) = timed(|| drop(phys));
    Ok([us(t0), us(t1), us(t2), us(t3), us(t4)])
}

/// Measures each size in `sizes` (bytes; multiples of the granularity), `reps` times per side after
/// two warm-up cycles, the raw, crate and floor cycles taking turns (each first every third time),
/// each in a reservation of its own.
pub fn run(ctx: &Context, sizes: &[usize], reps: usize) -> Result<Vec<OpsRow>> {
    if reps == 0 || sizes.is_empty() {
        return Err(crate::bench::invalid("need at least one size and one repetition"));
    }
    ctx.bind()?;
    let builder = PhysicalMemory::builder(ctx);
    let prop = CUmemAllocationProp {
        type_: CUmemAllocationType::PINNED,
        location: CUmemLocation { type_: CUmemLocationType::DEVICE, id: ctx.device().raw() },
        ..Default::default()
    };
    let mut rows = Vec::new();
    for &size in sizes {
        cuvmm::vmm::check_aligned("chunk size", size, builder.granularity()?.minimum)?;
        let raw_va = Reservation::new(ctx, size)?;
        let crate_va = Reservation::new(ctx, size)?;
        let floor_va = Reservation::new(ctx, size)?;
        let floor = Floor {
            ranges: Mutex::new(Vec::with_capacity(4)),
            reservation: Arc::new(0),
            physical: Arc::new(0),
        };
        for _ in 0..2 {
            raw_cycle(ctx, size, raw_va.base(), &prop, None)?;
            crate_cycle(ctx, size, &crate_va)?;
            raw_cycle(ctx, size, floor_va.base(), &prop, Some(&floor))?;
        }
        let mut raw: Vec<[f64; 5]> = Vec::with_capacity(reps);
        let mut ours: Vec<[f64; 5]> = Vec::with_capacity(reps);
        let mut floors: Vec<[f64; 5]> = Vec::with_capacity(reps);
        for rep in 0..reps {
            // Each of the three goes first, second and third in turn.
            for k in 0..3 {
                match (rep + k) % 3 {
                    0 => raw.push(raw_cycle(ctx, size, raw_va.base(), &prop, None)?),
                    1 => ours.push(crate_cycle(ctx, size, &crate_va)?),
                    _ => floors.push(raw_cycle(ctx, size, floor_va.base(), &prop, Some(&floor))?),
                }
            }
        }
        let med = |v: &[[f64; 5]], i: usize| median(&v.iter().map(|a| a[i]).collect::<Vec<_>>());
        rows.push(OpsRow {
            size,
            reps,
            raw_us: std::array::from_fn(|i| med(&raw, i)),
            crate_us: std::array::from_fn(|i| med(&ours, i)),
            floor_map_us: med(&floors, 1),
        });
    }
    Ok(rows)
}

/// What one call cuvmm may add to a raw sequence costs, nanoseconds (median of batches).
#[derive(Clone, Debug)]
pub struct CallCost {
    /// The call, as the report names it.
    pub what: &'static str,
    /// Nanoseconds per call.
    pub ns: f64,
}

/// Times, in this process and context, the driver calls a cuvmm path makes beyond the raw ones
/// (or made before they were cached), and the host clock read around every timed operation: what
/// a difference between the two sides of the table is made of.
pub fn call_costs(ctx: &Context) -> Result<Vec<CallCost>> {
    use std::time::Instant;
    let api = driver()?.api();
    ctx.bind()?;
    let dev = ctx.device();
    let prop = CUmemAllocationProp {
        type_: CUmemAllocationType::PINNED,
        location: CUmemLocation { type_: CUmemLocationType::DEVICE, id: dev.raw() },
        ..Default::default()
    };
    const N: usize = 2000;
    let per_call = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut batches = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            for _ in 0..N {
                f()?;
            }
            batches.push(t.elapsed().as_secs_f64() * 1e9 / N as f64);
        }
        Ok(median(&batches))
    };
    let mut out = Vec::new();
    let mut add = |what, ns| out.push(CallCost { what, ns });
    add(
        "Instant::now() pair",
        per_call(&mut || {
            std::hint::black_box(Instant::now().elapsed());
            Ok(())
        })?,
    );
    // SAFETY: the context is retained by `ctx`; making it current again changes nothing.
    add(
        "cuCtxSetCurrent, same context",
        per_call(&mut || unsafe { result::ctx::set_current(api, ctx.raw()) })?,
    );
    add("cuCtxGetCurrent", per_call(&mut || result::ctx::get_current(api).map(drop))?);
    add(
        "cuMemGetAllocationGranularity",
        per_call(&mut || {
            result::mem::get_allocation_granularity(api, &prop, CUmemAllocationGranularity_flags::MINIMUM)
                .map(drop)
        })?,
    );
    add(
        "cuDeviceGetAttribute",
        per_call(&mut || {
            result::device::get_attribute(
                api,
                CUdevice_attribute::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                dev.raw(),
            )
            .map(drop)
        })?,
    );
    match per_call(&mut || result::device::get_uuid(api, dev.raw()).map(drop)) {
        Ok(ns) => add("cuDeviceGetUuid", ns),
        Err(cuvmm::Error::Unsupported { .. }) => {}
        Err(e) => return Err(e),
    }
    add("cuDeviceGetCount", per_call(&mut || result::device::get_count(api).map(drop))?);
    // An allocation's properties: a query an import could make after each import, which
    // cuvmm's import does without.
    let phys = PhysicalMemory::builder(ctx).create(PhysicalMemory::builder(ctx).round_up(1)?)?;
    add(
        "cuMemGetAllocationPropertiesFromHandle",
        // The handle is live while `phys` is.
        per_call(&mut || result::mem::get_allocation_properties(api, phys.handle()).map(drop))?,
    );
    Ok(out)
}

// The options of `cuvmm bench vmm-ops` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Chunk sizes.
    #[arg(long, default_value = "2MiB,8MiB,32MiB,128MiB,512MiB,1GiB", value_parser = parse_sizes)]
    sizes: std::vec::Vec<usize>,
    /// Timed repetitions per size and side.
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench vmm-ops`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { sizes, reps, device, json } = args;
    let ctx = Context::for_ordinal(device)?;
    let rows = run(&ctx, &sizes, reps)?;
    let costs = call_costs(&ctx)?;
    if json {
        print_json(out, &rows, &costs)
    } else {
        print_text(out, reps, &rows, &costs)
    }
}

/// `--json`: a line per size and operation, the map's floor, then each call's cost.
fn print_json(out: &mut impl Write, rows: &[OpsRow], costs: &[CallCost]) -> CliResult {
    for r in rows {
        for (i, op) in OPS.iter().enumerate() {
            writeln!(
                out,
                "{}",
                json!({"bench": "vmm-ops", "size": r.size, "op": op, "reps": r.reps,
                       "raw_us": r.raw_us[i], "cuvmm_us": r.crate_us[i], "overhead": r.overhead()[i],
                       "ratio": r.crate_us[i] / r.raw_us[i]})
            )?;
        }
        writeln!(
            out,
            "{}",
            json!({"bench": "vmm-ops", "size": r.size, "op": "map_floor", "reps": r.reps,
                   "raw_us": r.raw_us[1], "floor_us": r.floor_map_us, "cuvmm_us": r.crate_us[1]})
        )?;
    }
    for c in costs {
        writeln!(out, "{}", json!({"bench": "vmm-ops", "call": c.what, "ns": c.ns}))?;
    }
    Ok(())
}

/// The tables: per operation, cuvmm over raw, the map's floor, each call's cost.
fn print_text(out: &mut impl Write, reps: usize, rows: &[OpsRow], costs: &[CallCost]) -> CliResult {
    writeln!(
        out,
        "median µs per op over {reps} reps (raw driver / cuvmm; unmap includes the context sync both do)"
    )?;
    write!(out, "{:>9}", "chunk")?;
    for op in OPS {
        write!(out, " {op:>19}")?;
    }
    writeln!(out, " {:>10} {:>10}", "overhead", "µs per GiB")?;
    for r in rows {
        write!(out, "{:>9}", show(r.size))?;
        for i in 0..5 {
            write!(out, " {:>9.1} / {:>7.1}", r.raw_us[i], r.crate_us[i])?;
        }
        let per_gib = r.crate_us.iter().sum::<f64>() * (1u64 << 30) as f64 / r.size as f64;
        writeln!(out, " {:>9.1}% {:>10.0}", r.total_overhead() * 100.0, per_gib)?;
    }
    writeln!(out, "cuvmm / raw per op:")?;
    for r in rows {
        write!(out, "{:>9}", show(r.size))?;
        for i in 0..5 {
            write!(out, " {:>19.3}", r.crate_us[i] / r.raw_us[i])?;
        }
        writeln!(out)?;
    }
    if let Some(r) = rows.iter().min_by_key(|r| r.size) {
        let map = r.crate_us[1] / r.raw_us[1];
        writeln!(
            out,
            "cuMemMap of {}: cuvmm {:.3} µs / raw {:.3} µs = {map:.3}x (goal ≤ 1.05x: {})",
            show(r.size),
            r.crate_us[1],
            r.raw_us[1],
            if map <= 1.05 { "met" } else { "not met" }
        )?;
    }
    writeln!(
        out,
        "raw cuMemMap with what a shared Reservation's map needs around it (a mutex held across \
         the call, the range recorded, two reference counts raised):"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:>9} {:>9.3} µs = {:.3}x raw; cuvmm {:.3}x of it",
            show(r.size),
            r.floor_map_us,
            r.floor_map_us / r.raw_us[1],
            r.crate_us[1] / r.floor_map_us
        )?;
    }
    writeln!(out, "what the calls cuvmm may add cost here (ns per call, median of 7 batches of 2000):")?;
    for c in costs {
        writeln!(out, "  {:<40} {:>8.1}", c.what, c.ns)?;
    }
    Ok(())
}
