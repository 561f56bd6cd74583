//! The fake driver (`fixtures/fake_libcuda.c`) built with the system C compiler, wherever the test
//! binary runs. Included by `tests/common/mod.rs` and by cuvmm-capi's unit tests.
//!
//! Nothing accumulates. Under Cargo the libraries go to one folder of its scratch directory named
//! by a hash of the source, reused by every later run and test binary (a folder of an older source
//! is removed). A test binary run elsewhere (copied to a GPU machine, or a unit test, which Cargo
//! gives no scratch directory) builds into a folder of the system's temporary directory that is
//! removed when the process exits.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const FAKE_SOURCE: &str = include_str!("../fixtures/fake_libcuda.c");
const PREFIX: &str = "cuvmm-fake-";

/// FNV-1a: stable across toolchains, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

static SCRATCH: OnceLock<PathBuf> = OnceLock::new();
static FOLDER: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_scratch() {
    if let Some(dir) = SCRATCH.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn cargo_scratch() -> Option<PathBuf> {
    option_env!("CARGO_TARGET_TMPDIR").map(PathBuf::from).filter(|p| p.is_dir())
}

/// A folder of this process for a test's files, removed when the process exits: in Cargo's
/// scratch directory, or the system's temporary one.
pub fn scratch() -> &'static Path {
    SCRATCH.get_or_init(|| {
        let base = cargo_scratch().unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("cuvmm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch folder");
        // SAFETY: registers a function without arguments that only removes a folder.
        unsafe { libc::atexit(remove_scratch) };
        dir
    })
}

fn folder() -> &'static Path {
    FOLDER.get_or_init(|| {
        let Some(scratch) = cargo_scratch() else { return scratch().to_path_buf() };
        let name = format!("{PREFIX}{:016x}", fnv1a(FAKE_SOURCE.as_bytes()));
        // Folders of other sources (and the per-process folders of older versions).
        for entry in std::fs::read_dir(&scratch).into_iter().flatten().flatten() {
            let other = entry.file_name().to_string_lossy().into_owned();
            if other.starts_with(PREFIX) && other != name {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = scratch.join(name);
        std::fs::create_dir_all(&dir).expect("fake driver folder");
        dir
    })
}

/// The fake driver built in `mode` (see fixtures/fake_libcuda.c): its path.
pub fn fake_driver(mode: &str) -> PathBuf {
    let dir = folder();
    let lib = dir.join(format!("libfakecuda-{mode}.so"));
    if lib.exists() {
        return lib;
    }
    // Each thread of each process compiles its own copy and renames it into place: tests run in
    // parallel, and one rewriting a shared file while another's `cc` reads it built libraries
    // missing symbols.
    let unique = format!("{mode}-{}-{:?}", std::process::id(), std::thread::current().id())
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '_', "");
    let src = dir.join(format!(".fake_libcuda-{unique}.c"));
    let tmp = dir.join(format!(".libfakecuda-{unique}.so"));
    std::fs::write(&src, FAKE_SOURCE).expect("write fake source");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", &format!("-D{mode}"), "-o"])
        .arg(&tmp)
        .arg(&src)
        .args(["-lm", "-lpthread"])
        .status();
    let _ = std::fs::remove_file(&src);
    let status = status.expect("the CPU tests need a C compiler (cc) to build the fake driver");
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        panic!("cc failed to build the fake driver");
    }
    std::fs::rename(&tmp, &lib).expect("rename fake driver");
    lib
}
