//! The `cuvmm` binary without a usable driver, and against the fake one.

#[path = "../../tests/common/mod.rs"]
mod common;

/// The `cuvmm` binary: Cargo's path when it exists, else the one on PATH (a staged copy on a GPU
/// machine, where compile-time paths differ).
fn cuvmm_bin() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_cuvmm"));
    if built.exists() {
        return built;
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("cuvmm"))
        .find(|p| p.exists())
        .expect("cuvmm binary not found")
}

use std::process::Command;

#[test]
fn info_without_a_driver_prints_one_clear_line_and_fails() {
    let out = Command::new(cuvmm_bin())
        .args(["info"])
        .env("CUVMM_LIBCUDA", "/nonexistent/libcuda.so.1")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("cuvmm: no CUDA driver found: tried /nonexistent/libcuda.so.1 ("), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn info_json_without_a_driver_fails_the_same_way() {
    let out = Command::new(cuvmm_bin())
        .args(["info", "--json"])
        .env("CUVMM_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("cuvmm: no CUDA driver found"));
}

#[test]
fn info_with_a_failing_cu_init_names_the_call() {
    let out = Command::new(cuvmm_bin())
        .args(["info"])
        .env("CUVMM_LIBCUDA", common::fake_driver("FAKE_NO_DEVICE"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        "cuvmm: cuInit failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"
    );
}

#[test]
fn info_on_a_driver_with_no_devices_reports_zero_as_table_and_json() {
    let lib = common::fake_driver("FAKE_OK");
    let out = Command::new(cuvmm_bin()).args(["info"]).env("CUVMM_LIBCUDA", &lib).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("CUDA driver 12.4 ("), "{text}");
    assert!(text.contains("0 device(s)"), "{text}");

    let out = Command::new(cuvmm_bin()).args(["info", "--json"]).env("CUVMM_LIBCUDA", &lib).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["driver_version"], "12.4");
    assert_eq!(v["devices"].as_array().unwrap().len(), 0);
    assert!(v["imex"]["usable"].is_boolean());
}

#[test]
fn unknown_subcommands_are_usage_errors_not_panics() {
    let out = Command::new(cuvmm_bin()).args(["frobnicate"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

#[test]
fn the_tour_without_a_driver_prints_one_clear_line_and_fails() {
    let dir = common::scratch().join("tour");
    let out = Command::new(cuvmm_bin())
        .args(["tour", "--out"])
        .arg(&dir)
        .env("CUVMM_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("cuvmm: no CUDA driver found"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

// `cuvmm bench trace` reads its trace before it needs a driver: a bad file is one clear line on
// any machine.

use std::path::PathBuf;

/// A file with `text` in the test's scratch folder (removed when the test process exits).
fn file(name: &str, text: &[u8]) -> PathBuf {
    let path = common::scratch().join(name);
    std::fs::write(&path, text).expect("write trace");
    path
}

/// Runs `cuvmm bench trace ARGS` with no driver to be found; returns (exit code, stderr).
fn trace(args: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let out = Command::new(cuvmm_bin())
        .args(["bench", "trace"])
        .args(args)
        .env("CUVMM_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    (out.status.code(), String::from_utf8(out.stderr).unwrap())
}

const HEADER: &str = "# cuvmm trace v1: op t_ns device stream size ptr\n";

#[test]
fn a_bad_trace_is_refused_naming_the_file_and_line_before_the_driver_is_needed() {
    let path = file("unknown-free.trace", format!("{HEADER}a 1 0 0x0 8 0x10\nf 2 0 0x0 8 0x20\n").as_bytes());
    let (code, err) = trace(&[path.as_os_str()]);
    assert_eq!(code, Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("trace {}: line 3: free of 0x20, which is not live", path.display())),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    let path = file("binary.trace", b"\x7fELF\x02\x01\x01\0\0\0\0\n");
    let (code, err) = trace(&[path.as_os_str()]);
    assert_eq!(code, Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("line 1: "), "{err}");
}

#[test]
fn a_missing_trace_file_says_so() {
    let path = file("x", b"").with_file_name("no-such.trace");
    let (code, err) = trace(&[path.as_os_str()]);
    assert_eq!(code, Some(1));
    assert!(err.contains(&format!("trace {}: cannot open: ", path.display())), "{err}");
}

#[test]
fn a_trace_without_records_of_the_device_is_refused() {
    let path = file("device1.trace", format!("{HEADER}a 1 1 0x0 8 0x10\n").as_bytes());
    let (code, err) = trace(&[path.as_os_str()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no successful allocation of device 0"), "{err}");
}

#[test]
fn a_good_trace_or_none_gets_as_far_as_the_driver() {
    let path = file("good.trace", format!("{HEADER}a 1 0 0x0 8 0x10\nf 2 0 0x0 8 0x10\n").as_bytes());
    for args in [vec![path.as_os_str()], vec![]] {
        let (code, err) = trace(&args);
        assert_eq!(code, Some(1));
        assert!(err.starts_with("cuvmm: no CUDA driver found"), "{err}");
    }
}

/// `bench ipc` runs its whole protocol (importer processes, both paths, bandwidth, legacy)
/// against the fake driver's FAKE_VMM device, whose calls succeed without doing anything: the
/// figures mean nothing, but the exchange and the report are checked before GPU time is spent.
#[test]
fn bench_ipc_runs_both_paths_end_to_end_on_the_fake_device() {
    let lib = common::fake_driver("FAKE_VMM");
    let out = Command::new(cuvmm_bin())
        .args(["bench", "ipc", "--size", "4MiB", "--processes", "2", "--pairs", "1", "--json"])
        .env("CUVMM_LIBCUDA", &lib)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bench"], "ipc");
    assert_eq!(v["processes"], 2);
    for path in ["cuvmm", "raw"] {
        assert_eq!(v[path]["warm_n"], 2, "{v}");
        assert_eq!(v[path]["first_n"], 1, "{v}");
        assert!(v[path]["warm_us"]["export → mapped"].as_f64().unwrap() > 0.0, "{v}");
    }
    assert!(v["ratio_export_to_mapped"].as_f64().unwrap() > 0.0);
}

/// `bench bandwidth`, plain and as a sweep, against the fake device, whose copies really move data:
/// the staged round trips it checks byte for byte pass, and the report comes out.
#[test]
fn bench_bandwidth_and_its_sweep_run_on_the_fake_device() {
    let lib = common::fake_driver("FAKE_VMM");
    let run = |args: &[&str]| {
        let out = Command::new(cuvmm_bin()).args(args).env("CUVMM_LIBCUDA", &lib).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(&[
        "bench",
        "bandwidth",
        "--sizes",
        "1MiB,3MiB",
        "--reps",
        "1",
        "--threads",
        "3",
        "--chunk",
        "256KiB",
        "--host-copy",
        "both",
    ]);
    assert!(text.contains("staged: 3 threads, 256 KiB chunks"), "{text}");
    assert!(text.contains("slots, streaming host copies"), "{text}");
    for size in ["1 MiB", "3 MiB"] {
        let line = text.lines().find(|l| l.starts_with(&format!("staged at {size} by host copy"))).unwrap();
        assert!(line.contains("(over streaming): streaming ") && line.contains(", plain "), "{line}");
    }
    let refused = Command::new(cuvmm_bin())
        .args(["bench", "bandwidth", "--sweep", "--sizes", "1MiB", "--host-copy", "both"])
        .env("CUVMM_LIBCUDA", &lib)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("one --host-copy"));
    // Without --trace, no timeline; with it, one per size and direction, every chunk's steps.
    assert!(!text.contains("slowest staged"), "{text}");
    let args = "bench bandwidth --sizes 1MiB,3MiB --reps 2 --threads 3 --chunk 256KiB --trace";
    let text = run(&args.split(' ').collect::<Vec<_>>());
    let timelines: Vec<&str> = text.lines().filter(|l| l.starts_with("slowest staged")).collect();
    assert_eq!(timelines.len(), 4, "{text}");
    // 3 MiB in 256 KiB chunks: twelve, each with its steps.
    let h2d = timelines.iter().find(|l| l.contains("host to device of 3 MiB")).unwrap();
    let steps = h2d.rsplit(": ").next().unwrap().split(' ').collect::<Vec<_>>();
    assert_eq!(steps.len(), 12, "{h2d}");
    assert!(steps.iter().all(|s| s.split('/').count() == 2 && !s.contains('-')), "{h2d}");
    let d2h = timelines.iter().find(|l| l.contains("device to host of 3 MiB")).unwrap();
    let steps = d2h.rsplit(": ").next().unwrap().split(' ').collect::<Vec<_>>();
    assert!(steps.iter().all(|s| s.split('/').count() == 3 && !s.contains('-')), "{d2h}");
    let args = "bench bandwidth --sweep --json --sizes 1MiB --reps 1 --threads 2 --trace";
    let traces: Vec<serde_json::Value> = run(&args.split(' ').collect::<Vec<_>>())
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["bench"] == "bandwidth-trace")
        .collect();
    assert_eq!(traces.len(), 2);
    assert_eq!(traces[0]["shape"]["threads"], 2);
    assert_eq!(traces[1]["chunks"].as_array().unwrap().len(), 1, "one 4 MiB chunk holds 1 MiB");
    let lines = run(&[
        "bench",
        "bandwidth",
        "--sweep",
        "--json",
        "--sizes",
        "1MiB,3MiB",
        "--reps",
        "1",
        "--threads",
        "1,4",
        "--chunk",
        "256KiB,1MiB",
        "--piece",
        "64KiB,512KiB",
        "--slots",
        "2,5",
    ]);
    let shapes = lines.lines().filter(|l| l.contains("\"staged_h2d\"")).count();
    // 2 thread counts x 2 slot counts x (256 KiB chunks: 1 piece size; 1 MiB: 2) x 2 sizes.
    assert_eq!(shapes, 2 * 2 * 3 * 2, "{lines}");

    // With the host idle before every timed transfer: one shape, one size, one timed round after
    // a warm-up, so each of staged, pinned and memcpy pauses 2 rounds x 2 directions, and the
    // source is read alone 2 rounds on at least one thread count: 14 pauses at least.
    let start = std::time::Instant::now();
    let args = "bench bandwidth --sweep --json --sizes 1MiB --reps 1 --threads 2 --idle-ms 30";
    let lines = run(&args.split(' ').collect::<Vec<_>>());
    assert!(start.elapsed() >= std::time::Duration::from_millis(14 * 30), "{lines}");
    let refs: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v.get("pinned_host_clock_h2d").is_some())
        .collect();
    assert_eq!(refs.len(), 1, "{lines}");
    assert_eq!(refs[0]["idle_ms"], 30);
    assert!(refs[0]["pinned_host_clock_h2d"].as_f64().unwrap() > 0.0, "{lines}");
    // The pause is for the sweep only.
    let out = Command::new(cuvmm_bin())
        .args(["bench", "bandwidth", "--idle-ms", "30"])
        .env("CUVMM_LIBCUDA", &lib)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `bench overlap` against the fake device, whose busy kernel runs on the CPU: every schedule,
/// cuvmm's and the raw reference's, runs, and the output of the fastest of each is checked
/// against the CPU's multiply-adds.
#[test]
fn bench_overlap_runs_every_schedule_and_checks_both_paths_on_the_fake_device() {
    let lib = common::fake_driver("FAKE_VMM");
    let out = Command::new(cuvmm_bin())
        .args([
            "bench",
            "overlap",
            "--n",
            "10000",
            "--reps",
            "1",
            "--iters",
            "5",
            "--streams",
            "3,5",
            "--chunks",
            "7",
            "--lanes",
            "1,3",
            "--json",
        ])
        .env("CUVMM_LIBCUDA", &lib)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let schedules: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("schedule").is_some())
        .collect();
    // serial, 2 x 2 breadth/depth each way, 2 pipelines.
    assert_eq!(schedules.len(), 1 + 4 + 4 + 2, "{text}");
    assert_eq!(schedules.iter().filter(|v| v["raw"] == true).count(), 4);
    assert!(text.contains("\"ratio\""), "{text}");
}

/// `bench alloc --threads` runs cuvmm's stream-ordered allocator and the driver's pool on every
/// thread count, each thread on its own stream, against the fake device.
#[test]
fn bench_alloc_threads_runs_cuvmm_and_the_pool_per_thread_count_on_the_fake_device() {
    let lib = common::fake_driver("FAKE_VMM");
    let out = Command::new(cuvmm_bin())
        .args(["bench", "alloc", "--threads", "1,3", "--sizes", "4KiB,2MiB", "--pairs", "800", "--json"])
        .env("CUVMM_LIBCUDA", &lib)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = out
        .stdout
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    for (r, (size, threads)) in rows.iter().zip([(4096, 1), (4096, 3), (2 << 20, 1), (2 << 20, 3)]) {
        assert_eq!(
            (r["bench"].as_str(), r["size"].as_u64(), r["threads"].as_u64()),
            (Some("alloc_threads"), Some(size), Some(threads))
        );
        assert!(r["cuvmm_mpairs"].as_f64().unwrap() > 0.0 && r["pool_mpairs"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["stream_calls_mpairs"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(rows[0]["cuvmm_vs_one_thread"].as_f64(), Some(1.0));
    let bad = Command::new(cuvmm_bin())
        .args(["bench", "alloc", "--threads", "0"])
        .env("CUVMM_LIBCUDA", &lib)
        .output()
        .unwrap();
    assert!(!bad.status.success());
}
