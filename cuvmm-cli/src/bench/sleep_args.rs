//! The options of `cuvmm bench sleep`, and the command line that hands them to a child process:
//! kept apart from the benchmark so that the process that coordinates children
//! (`sleep_procs`) and the benchmark itself take them from below, not from each other.

use crate::common::size::parse_size;
use cuvmm::host::HostCopy;

// The options of `cuvmm bench sleep` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Bytes tagged.
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    pub(super) size: usize,
    /// Bytes per allocation.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub(super) block: usize,
    /// Sleep and wake cycles measured after the first.
    #[arg(long, default_value_t = 5)]
    pub(super) reps: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(super) device: usize,
    /// Device ordinals, comma-separated: the tag on each (one allocator per device), slept
    /// and woken on all at once (overrides --device).
    #[arg(long, value_delimiter = ',')]
    pub(super) devices: Vec<usize>,
    /// Where an offloading sleep keeps the contents: pageable (host memory through the
    /// staging ring), pinned (host memory as large as the tag) or disk (a file in --dir).
    #[arg(long, default_value = "pageable")]
    pub(super) backup: String,
    /// Directory of the disk backup.
    #[arg(long)]
    pub(super) dir: Option<std::path::PathBuf>,
    /// Keep the backup after each wake for the next sleep.
    #[arg(long)]
    pub(super) retain: bool,
    /// With the default backup, leave out the cycles run again with the backup retained.
    #[arg(long)]
    pub(super) no_retained: bool,
    /// One process per device (of --devices, or 0..N), all sleeping at once, each cycle started
    /// together: each process's own cycles, bounds and floor.
    #[arg(long, default_value_t = 1)]
    pub(super) processes: usize,
    /// Wait for the parent before each cycle (what --processes runs in each child).
    #[arg(long, hide = true)]
    pub(super) barrier: bool,
    /// Run the first cycle in a child process of its own: the first sleep of a fresh process.
    #[arg(long)]
    pub(super) fresh_process: bool,
    /// Milliseconds waited between each sleep and its wake.
    #[arg(long, default_value_t = 0)]
    pub(super) gap_ms: u64,
    /// How the staging ring's threads write the backup (and read it back): plain (ordinary
    /// stores), streaming (non-temporal stores, the library's default) or both (cycles take
    /// turns, each one's medians reported). Default: the library's (or CUVMM_HOST_COPY).
    #[arg(long, value_parser = crate::bench::parse_host_copies)]
    pub(super) host_copy: Option<std::vec::Vec<HostCopy>>,
    /// Get the backup ready in the background once the tag is allocated (the library's
    /// prepare_backup), and wait until it is, before the first sleep: what a program that calls it
    /// after loading its weights pays at its first sleep.
    #[arg(long)]
    pub(super) prepare: bool,
    /// Run only the first cycle, as JSON lines (what --fresh-process runs in the child).
    #[arg(long, hide = true)]
    pub(super) first_only: bool,
    /// JSON lines instead of a table.
    #[arg(long)]
    pub(super) json: bool,
}

/// `cuvmm bench sleep --json` on `devices` with the options of `args` that shape the cycles, as a
/// child of this process runs it.
pub(super) fn child_command(args: &Args, devices: &[usize]) -> std::io::Result<std::process::Command> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    let devs: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
    cmd.args([
        "bench",
        "sleep",
        "--json",
        "--size",
        &args.size.to_string(),
        "--block",
        &args.block.to_string(),
    ])
    .args(["--reps", &args.reps.to_string(), "--devices", &devs.join(",")])
    .args(["--backup", &args.backup, "--gap-ms", &args.gap_ms.to_string()]);
    if let Some(d) = &args.dir {
        cmd.arg("--dir").arg(d);
    }
    if args.retain {
        cmd.arg("--retain");
    }
    if args.no_retained {
        cmd.arg("--no-retained");
    }
    if args.prepare {
        cmd.arg("--prepare");
    }
    match args.host_copy.as_deref() {
        Some([one]) => drop(cmd.args(["--host-copy", one.name()])),
        Some([_, _, ..]) => drop(cmd.args(["--host-copy", "both"])),
        _ => {}
    }
    Ok(cmd)
}

/// `argv` (starting with the program's name) parsed as `bench sleep`'s options.
#[cfg(test)]
pub(super) fn parse_args(argv: &[&str]) -> Args {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    <Cli as clap::Parser>::parse_from(argv).args
}
