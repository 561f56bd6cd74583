//! A C program that destroys streams between rounds of `cuvmm_malloc`/`cuvmm_free`
//! (fixtures/streams_destroyed.c), built with the system C compiler and run against libcuvmm.so
//! and the fake driver (host functions on their own thread, destroyed handles handed to new
//! streams).

// The shared test helpers name the library `cuvmm`, which here is this package's own name.
extern crate cuvmm_lib as cuvmm;

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::Command;

/// The C program, compiled into the test so that a copy of it runs away from the source tree.
const PROGRAM: &str = include_str!("fixtures/streams_destroyed.c");

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

#[test]
#[ignore = "needs libcuvmm.so: `cargo build -p cuvmm-capi` first (.ci/run does; a GPU bundle carries it)"]
fn threads_that_destroy_their_streams_between_rounds_get_no_block_still_in_use() {
    let lib = libcuvmm();
    let fake = common::fake_driver("FAKE_VMM");
    let dir = common::scratch();
    let (source, exe) = (dir.join("streams_destroyed.c"), dir.join("streams_destroyed"));
    std::fs::write(&source, PROGRAM).unwrap();
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&exe)
        .arg(&source)
        .args(["-ldl", "-lpthread"])
        .status()
        .expect("the test needs a C compiler (cc)");
    assert!(status.success(), "cc failed");
    let out = Command::new(&exe)
        .arg(&lib)
        .arg(&fake)
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
}
