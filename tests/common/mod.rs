//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

const FAKE_SOURCE: &str = include_str!("../fixtures/fake_libcuda.c");

/// Builds the fake driver in `mode` (see fixtures/fake_libcuda.c) into a temporary file with the
/// system C compiler and returns its path. The source is embedded, so this works wherever the test
/// binary runs, the GPU machine included.
pub fn fake_driver(mode: &str) -> PathBuf {
    // Cargo's scratch folder for integration tests, inside target/, so nothing is left in /tmp;
    // a copied test executable (on a GPU machine) falls back to the system's temporary folder.
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let base = if scratch.is_dir() { scratch } else { std::env::temp_dir() };
    let dir = base.join(format!("cuvmm-fake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let lib = dir.join(format!("libfakecuda-{mode}.so"));
    if !lib.exists() {
        // Each thread writes and compiles its own copy: tests run in parallel, and one rewriting
        // a shared source file while another's `cc` reads it built libraries missing symbols.
        let thread = format!("{:?}", std::thread::current().id());
        let src = dir.join(format!("fake_libcuda-{mode}-{thread}.c"));
        std::fs::write(&src, FAKE_SOURCE).expect("write fake source");
        let tmp = dir.join(format!("libfakecuda-{mode}.so.{thread}"));
        let status = Command::new("cc")
            .args(["-shared", "-fPIC", "-O1", &format!("-D{mode}"), "-o"])
            .arg(&tmp)
            .arg(&src)
            .args(["-lm", "-lpthread"])
            .status()
            .expect("the CPU tests need a C compiler (cc) to build the fake driver");
        assert!(status.success(), "cc failed to build the fake driver");
        std::fs::rename(&tmp, &lib).expect("rename fake driver");
    }
    lib
}

/// The first two GPUs, or `None` on a machine with one (where `CUVMM_REQUIRE_GPUS` set makes
/// that a failure: the two-GPU machine must not skip the checks).
pub fn two_gpus() -> Option<(cuvmm::Device, cuvmm::Device)> {
    let devices = cuvmm::Device::all().unwrap();
    if devices.len() < 2 {
        assert!(
            std::env::var_os("CUVMM_REQUIRE_GPUS").is_none(),
            "this machine was expected to have two GPUs"
        );
        eprintln!("one GPU: the two-GPU checks run on the two-GPU machine (CUVMM_REQUIRE_GPUS=2)");
        return None;
    }
    Some((devices[0], devices[1]))
}
