//! `cuvmm` with no arguments (or `cuvmm tour`): the main job. A short report of what cuvmm does on
//! the first GPU, with the pictures written to a folder.

use super::plot::{line_chart, Series};
use crate::bench::bandwidth::print_bandwidth;
use crate::bench::overlap::print_overlap;
use crate::bench::{bandwidth, grow, overlap};
use crate::common::size::show;
use crate::common::CliResult;
use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::caps::Report;
use cuvmm::host::Staging;
use cuvmm::ipc::{recv_message, PeerPolicy, SharedMemory};
use cuvmm::kernels::Kernels;
use cuvmm::{Context, Stream, VmmVec};
use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Instant;

const STEPS: usize = 5;

fn step(n: usize, what: &str) {
    if std::io::stderr().is_terminal() {
        eprintln!("[{n}/{STEPS}] {what}…");
    }
}

pub fn run(out_dir: &Path, device: usize) -> CliResult {
    let mut out = std::io::stdout().lock();
    step(1, "reading the capability report");
    let report = Report::query()?;
    std::fs::create_dir_all(out_dir)?;
    writeln!(out, "== 1. What the driver and GPUs support\n")?;
    super::info::write_table(&mut out, &report)?;
    let ctx = Context::for_ordinal(device)?;
    let name = ctx.device().name()?;

    step(2, "growing a VmmVec to 4 GiB and shrinking it");
    writeln!(out, "\n== 2. A VmmVec grows without copying\n")?;
    {
        let mut v = VmmVec::<u8>::new(&ctx)?;
        let base = v.device_ptr();
        writeln!(out, "{:>10} {:>12} {:>8} {:>10}", "length", "mapped", "chunks", "step µs")?;
        for i in 1..=8u8 {
            let t = Instant::now();
            v.resize(i as usize * (512 << 20), i)?;
            writeln!(
                out,
                "{:>10} {:>12} {:>8} {:>10.0}",
                show(v.len()),
                show(v.mapped_bytes()),
                v.raw().chunk_count(),
                t.elapsed().as_secs_f64() * 1e6
            )?;
        }
        let moved = v.device_ptr() != base;
        v.truncate(256 << 20);
        v.shrink_to_fit()?;
        writeln!(
            out,
            "base address moved: {}; after truncate(256 MiB) + shrink_to_fit: {} mapped in {} chunk(s)",
            if moved { "yes" } else { "no" },
            show(v.mapped_bytes()),
            v.raw().chunk_count()
        )?;
    }
    let g = grow::run(&ctx, grow::GrowConfig { target: 4 << 30, reps: 1, ..Default::default() })?;
    writeln!(
        out,
        "growing to 4 GiB in 64 MiB steps: VmmVec {:.2} ms, realloc-by-copy doubling {:.2} ms ({:.2}x); peak in use {} vs {}",
        g.vmm.total_s * 1e3,
        g.copy.total_s * 1e3,
        g.total_ratio(),
        show(g.vmm.peak_bytes),
        show(g.copy.peak_bytes)
    )?;
    write_growth(out_dir, &g, &name)?;

    step(3, "sharing an allocation with a child process");
    writeln!(out, "\n== 3. An allocation shared with another process\n")?;
    share_with_child(&ctx, &mut out)?;

    step(4, "measuring bandwidth (pageable, pinned, registered, staged)");
    writeln!(out, "\n== 4. Host-device bandwidth\n")?;
    let mut staging = Staging::with_defaults(&ctx)?;
    let sizes: Vec<usize> = (0..5).map(|i| (1usize << 20) << (2 * i)).collect();
    let rows = bandwidth::run(&ctx, &sizes, 3, &mut staging, &[])?;
    print_bandwidth(&mut out, &ctx, &rows, &staging, false)?;
    write_bandwidth(out_dir, &rows, &name)?;

    step(5, "overlapping copies and kernels");
    writeln!(out, "\n== 5. Overlapping copies and kernels (chunks through several streams)\n")?;
    let r = overlap::run(&ctx, overlap::OverlapConfig { reps: 3, ..Default::default() })?;
    print_overlap(&mut out, &r, &name)?;
    std::fs::write(
        out_dir.join("overlap_timeline.svg"),
        overlap::svg(r.fastest(), &format!("{} floats on {name}", r.config.n)),
    )?;

    writeln!(
        out,
        "\npictures written to {}: growth_time.svg, growth_memory.svg, bandwidth.svg, overlap_timeline.svg",
        out_dir.display()
    )?;
    Ok(())
}

fn write_growth(dir: &Path, g: &grow::GrowReport, name: &str) -> std::io::Result<()> {
    let step_gib = g.config.step as f64 / (1u64 << 30) as f64;
    let series = |f: &dyn Fn(&(f64, usize)) -> f64| -> Vec<Series> {
        [("VmmVec", "#4e79a7", &g.vmm), ("realloc-by-copy doubling", "#e15759", &g.copy)]
            .into_iter()
            .map(|(n, c, run)| Series {
                name: n.into(),
                color: c,
                dashed: false,
                points: run
                    .trace
                    .iter()
                    .enumerate()
                    .map(|(i, p)| ((i + 1) as f64 * step_gib, f(p)))
                    .collect(),
            })
            .collect()
    };
    let gib = |x: f64| format!("{x:.1}");
    let time = line_chart(
        &format!("Time per 64 MiB append step, {name}"),
        "length (GiB)",
        "ms",
        &series(&|p| p.0 * 1e3),
        false,
        &gib,
    );
    let mem = line_chart(
        &format!("Device memory in use while growing, {name}"),
        "length (GiB)",
        "GiB in use",
        &series(&|p| p.1 as f64 / (1u64 << 30) as f64),
        false,
        &gib,
    );
    std::fs::write(dir.join("growth_time.svg"), time)?;
    std::fs::write(dir.join("growth_memory.svg"), mem)
}

fn write_bandwidth(dir: &Path, rows: &[bandwidth::BandwidthRow], name: &str) -> std::io::Result<()> {
    let pick = |label: &str,
                color: &'static str,
                dashed: bool,
                f: &dyn Fn(&bandwidth::BandwidthRow) -> f64| Series {
        name: label.into(),
        color,
        dashed,
        points: rows.iter().map(|r| (r.size as f64, f(r))).collect(),
    };
    let series = vec![
        pick("pinned H2D", "#4e79a7", false, &|r| r.pinned[0]),
        pick("pinned D2H", "#4e79a7", true, &|r| r.pinned[1]),
        pick("registered H2D", "#76b7b2", false, &|r| r.registered[0]),
        pick("registered D2H", "#76b7b2", true, &|r| r.registered[1]),
        pick("staged H2D", "#f28e2b", false, &|r| r.staged[0]),
        pick("staged D2H", "#f28e2b", true, &|r| r.staged[1]),
        pick("pageable H2D", "#e15759", false, &|r| r.pageable[0]),
        pick("pageable D2H", "#e15759", true, &|r| r.pageable[1]),
    ];
    let svg =
        line_chart(&format!("Host-device bandwidth, {name}"), "transfer size", "GB/s", &series, true, &|x| {
            show(x as usize)
        });
    std::fs::write(dir.join("bandwidth.svg"), svg)
}

/// Exports a patterned allocation to a child (this binary, `tour-child`), which checks it with a
/// kernel and writes an answer that is checked here.
fn share_with_child(ctx: &Context, out: &mut impl Write) -> CliResult {
    let k = Kernels::load(ctx)?;
    let st = Stream::new(ctx)?;
    let alloc = PeerAllocator::new(ctx, &[], ExportMode::Auto)?;
    let mut a = alloc.allocate(64 << 20)?;
    k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 2024)?;
    st.synchronize()?;
    let dir = std::env::temp_dir().join(format!("cuvmm-tour-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("sock");
    let listener = UnixListener::bind(&path)?;
    let mut child =
        std::process::Command::new(std::env::current_exe()?).arg("tour-child").arg(&path).spawn()?;
    let (mut s, _) = listener.accept()?;
    let how = a.share(s.as_fd(), 0, a.len(), 2024)?;
    let mut bad = [0u8; 8];
    s.read_exact(&mut bad)?;
    let child_bad = u64::from_le_bytes(bad);
    let answer_bad = k.count_pattern_mismatches(&st, &a.as_slice::<u32>(), 0, 2025)?;
    let status = child.wait()?;
    let _ = std::fs::remove_dir_all(&dir);
    writeln!(
        out,
        "{} sent to child pid {} as {how:?} (export mode Auto chose {:?}); the child found {child_bad} wrong elements \
         in our pattern and wrote its answer, in which we found {answer_bad}",
        show(a.len()),
        child.id(),
        alloc.handle_types()
    )?;
    if !status.success() || child_bad != 0 || answer_bad != 0 {
        return Err("sharing with the child process failed".into());
    }
    Ok(())
}

/// The child's side of `share_with_child`.
pub fn child(socket: &Path) -> CliResult {
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let st = Stream::new(&ctx)?;
    let mut s = UnixStream::connect(socket)?;
    let msg = recv_message(s.as_fd(), PeerPolicy::SameUid)?.ok_or("the exporter closed the socket")?;
    let seed = msg.message().tag() as u32;
    let mut shm = SharedMemory::import(&ctx, msg, &[])?;
    let bad = k.count_pattern_mismatches(&st, &shm.as_slice::<u32>(), 0, seed)?;
    k.pattern_u32(&st, &mut shm.as_mut_slice::<u32>(), 0, seed + 1)?;
    st.synchronize()?;
    s.write_all(&bad.to_le_bytes())?;
    Ok(())
}
