//! The `cuvmm` binary without a usable driver, and against the fake one.

#[path = "../../cuvmm/tests/common/mod.rs"]
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
    let dir = std::env::temp_dir().join(format!("cuvmm-tour-test-{}", std::process::id()));
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
