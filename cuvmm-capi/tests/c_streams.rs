//! C programs built with the system C compiler and run against libcuvmm.so and the fake driver: one
//! that destroys streams between rounds of `cuvmm_malloc`/`cuvmm_free`
//! (fixtures/streams_destroyed.c; host functions on their own thread, destroyed handles handed to
//! new streams), one that frees a block it shared before unexporting it (fixtures/shared_free.c),
//! one that marks a block shared and asks for its descriptors later (fixtures/export_mark.c), and
//! the shipped benchmark of the cached pair (bench/capi_pair.c).

// The shared test helpers name the library `cuvmm`, which here is this package's own name.
extern crate cuvmm_lib as cuvmm;

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::Command;

/// libcuvmm.so beside the folder that holds this test: `target/<profile>/` under cargo (where
/// Cargo builds no cdylib for a package's tests: `cargo build -p cuvmm-capi` first), or `lib/`
/// beside `tests/` as `tools/gpu-bundle` lays a bundle out.
fn libcuvmm() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    [dir.join("libcuvmm.so"), dir.join("lib").join("libcuvmm.so")]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no libcuvmm.so in {0} or {0}/lib: build it first", dir.display()))
}

/// Builds the C program `source` (with cuvmm.h and the fixtures' harness.h beside it: a copied test executable needs no
/// source tree) in a folder of its own, removed with the scratch folder when the tests end.
fn build(name: &str, source: &str) -> PathBuf {
    let dir = common::scratch().join(format!("fixture-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cuvmm.h"), include_str!("../include/cuvmm.h")).unwrap();
    std::fs::write(dir.join("harness.h"), include_str!("fixtures/harness.h")).unwrap();
    std::fs::write(dir.join(format!("{name}.c")), source).unwrap();
    let exe = dir.join(name);
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&exe)
        .arg(dir.join(format!("{name}.c")))
        .arg("-I")
        .arg(&dir)
        .args(["-ldl", "-lpthread"])
        .status()
        .expect("the test needs a C compiler (cc)");
    assert!(status.success(), "cc failed");
    exe
}

/// Runs the C program `exe` with `args` against the fake driver; fails the test with its output
/// unless it succeeds. Returns its standard output.
fn run_on_fake(exe: &std::path::Path, args: &[&std::ffi::OsStr]) -> String {
    let fake = common::fake_driver("FAKE_VMM");
    let out = Command::new(exe)
        .args(args)
        .env("CUVMM_LIBCUDA", &fake)
        .env("CUVMM_ALLOC_CONF", "log=0")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds the fixture `source` and runs it against libcuvmm.so and the fake driver.
fn run_fixture(name: &str, source: &str) {
    let fake = common::fake_driver("FAKE_VMM");
    run_on_fake(&build(name, source), &[libcuvmm().as_os_str(), fake.as_os_str()]);
}

#[test]
#[ignore = "needs libcuvmm.so: `cargo build -p cuvmm-capi` first (.ci/run does; a GPU bundle carries it)"]
fn threads_that_destroy_their_streams_between_rounds_get_no_block_still_in_use() {
    run_fixture("streams_destroyed", include_str!("fixtures/streams_destroyed.c"));
}

#[test]
#[ignore = "needs libcuvmm.so: `cargo build -p cuvmm-capi` first (.ci/run does; a GPU bundle carries it)"]
fn a_block_a_c_caller_frees_while_shared_stays_out_of_later_blocks_until_unexported() {
    run_fixture("shared_free", include_str!("fixtures/shared_free.c"));
}

#[test]
#[ignore = "needs libcuvmm.so: `cargo build -p cuvmm-capi` first (.ci/run does; a GPU bundle carries it)"]
fn the_shipped_pair_benchmark_reports_every_figure() {
    let exe = build("capi_pair", include_str!("../bench/capi_pair.c"));
    let out = run_on_fake(&exe, &[libcuvmm().as_os_str(), "1000".as_ref()]);
    let results: Vec<&str> = out.lines().filter(|l| l.starts_with("RESULT ")).collect();
    for what in ["legacy-stream", "created-stream"] {
        for size in ["4KiB", "64KiB", "1MiB", "16MiB"] {
            let line = format!("RESULT cuvmm_malloc+cuvmm_free {what} {size}: ");
            assert!(results.iter().any(|r| r.starts_with(&line) && r.contains(" ns/pair ")), "{line}\n{out}");
        }
    }
    for calls in ["cuStreamIsCapturing+cuStreamGetId -: ", "cuCtxGetCurrent -: "] {
        assert!(results.iter().any(|r| r.starts_with(&format!("RESULT {calls}"))), "{calls}\n{out}");
    }
    assert_eq!(results.len(), 10, "{out}");
}

#[test]
#[ignore = "needs libcuvmm.so: `cargo build -p cuvmm-capi` first (.ci/run does; a GPU bundle carries it)"]
fn a_block_marked_shared_costs_no_descriptor_and_gives_them_on_request_until_unexported() {
    run_fixture("export_mark", include_str!("fixtures/export_mark.c"));
}
