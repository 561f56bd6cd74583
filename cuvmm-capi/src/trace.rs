//! The allocation trace: one line per call, read back by `cuvmm bench trace`.
//!
//! ```text
//! # cuvmm trace v1: op t_ns device stream size ptr
//! a 1200 0 0x5581c0 4096 0x7f0000000000
//! f 1900 0 0x5581c0 4096 0x7f0000000000
//! ```
//! `a` is an allocation (a null `ptr` when it failed), `f` a free; `t_ns` counts from the first
//! call; `stream` is the raw handle, kept so that a replay can tell streams apart.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

pub struct Trace {
    start: Instant,
    out: Mutex<BufWriter<File>>,
}

impl Trace {
    pub fn create(path: &Path) -> std::io::Result<Trace> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        writeln!(out, "# cuvmm trace v1: op t_ns device stream size ptr")?;
        Ok(Trace { start: Instant::now(), out: Mutex::new(out) })
    }

    pub fn record(&self, op: char, device: i32, stream: usize, size: isize, ptr: u64) {
        let t = self.start.elapsed().as_nanos();
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        // A trace that cannot be written is lost, not an allocation failure.
        let _ = writeln!(out, "{op} {t} {device} {stream:#x} {size} {ptr:#x}");
    }

    pub fn flush(&self) {
        let _ = self.out.lock().unwrap_or_else(|e| e.into_inner()).flush();
    }
}
