//! `cuvmm bench trace`: an allocation trace replayed against cuvmm's
//! [`StreamAllocator`], the driver's stream-ordered pool (`cuMemAllocAsync`) and `cuMemAlloc`:
//! host time per call and peak memory of each.
//!
//! The trace is what libcuvmm.so writes with `CUVMM_ALLOC_CONF=trace=PATH`:
//!
//! ```text
//! # cuvmm trace v1: op t_ns device stream size ptr
//! a 1200 0 0x5581c0 4096 0x7f0000000000
//! f 1900 0 0x5581c0 4096 0x7f0000000000
//! ```
//!
//! The replay follows the order of the lines, not `t_ns`: threads take their time stamp before the
//! file's lock, so stamps may run backwards while the lines keep the order the allocator saw.
//! Allocations that returned null (failures, size 0) are skipped. A free's size is the caller's
//! and goes unused, as libcuvmm.so ignores it too. Blocks never freed are freed after the last
//! line, on their own streams, so that every pass ends empty.
//!
//! Each stream of the trace gets a non-blocking stream of its own (the legacy stream, named 0x0 or
//! 0x1, is one of them) and no kernel runs: what is measured is the allocators' own cost. Each
//! allocator replays the whole trace once to warm its cache, as after the first step of a long
//! run; the measured passes then take turns between allocators, so that drift in the machine falls
//! on all of them alike.

use super::median;
use crate::common::size::{parse_sizes, show};
use crate::common::CliResult;
use cuvmm::alloc::{DevicePtr, GraphMemory, StreamAllocator};
use cuvmm::context::Context;
use cuvmm::driver::result::{self, pool};
use cuvmm::driver::{driver, sys::*, Api};
use cuvmm::error::{Error, Result};
use cuvmm::stream::Stream;
use serde_json::json;
use std::collections::HashMap;
use std::fmt;
use std::io::BufRead;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// The first line of a trace.
pub const HEADER: &str = "# cuvmm trace v1: op t_ns device stream size ptr";

/// One call of a trace. Allocations are numbered in trace order; streams by first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocation `id`, `size` bytes, on stream number `stream`.
    Alloc {
        /// Number of the allocation.
        id: u32,
        /// Stream number.
        stream: u32,
        /// Bytes asked for.
        size: u64,
    },
    /// Free of allocation `id` on stream number `stream`.
    Free {
        /// Number of the allocation.
        id: u32,
        /// Stream number.
        stream: u32,
        /// The allocation's size.
        size: u64,
    },
}

/// A parsed trace: one device's calls, ready to replay.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The calls in trace order, then frees of the blocks never freed.
    pub ops: Vec<Op>,
    /// Raw handle of each stream number, as the trace names it first.
    pub streams: Vec<u64>,
    /// The device whose records these are.
    pub device: i32,
    /// Successful allocations.
    pub allocations: usize,
    /// Frees in the trace.
    pub frees: usize,
    /// Allocations never freed in the trace (freed at the end of the replay).
    pub unfreed: usize,
    /// Allocations that returned null, skipped.
    pub null_allocations: usize,
    /// Records of other devices, skipped.
    pub other_devices: usize,
}

/// Why a trace was refused. Lines count from 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceError {
    /// The file could not be read.
    Read {
        /// Line being read.
        line: usize,
        /// The system's message.
        why: String,
    },
    /// The first line is not [`HEADER`].
    Header {
        /// What the first line says (shortened).
        found: String,
    },
    /// A record without six fields.
    Fields {
        /// The line.
        line: usize,
        /// How many fields it has.
        found: usize,
    },
    /// An operation other than `a` or `f`.
    Op {
        /// The line.
        line: usize,
        /// The operation (shortened).
        found: String,
    },
    /// A field that is not a number of its kind.
    Number {
        /// The line.
        line: usize,
        /// The field's name in the header.
        field: &'static str,
        /// Its text (shortened).
        found: String,
    },
    /// A successful allocation of zero or fewer bytes.
    Size {
        /// The line.
        line: usize,
        /// The size.
        size: i64,
    },
    /// An address allocated while already live.
    AllocatedTwice {
        /// The line.
        line: usize,
        /// The address.
        ptr: u64,
        /// The line of the allocation still live.
        first: usize,
    },
    /// A free of an address that is not live.
    UnknownFree {
        /// The line.
        line: usize,
        /// The address.
        ptr: u64,
    },
    /// More allocations or streams than a replay numbers (2^32).
    TooMany {
        /// The line.
        line: usize,
        /// Allocations or streams.
        what: &'static str,
    },
    /// No successful allocation of the device.
    NoAllocations {
        /// The device.
        device: i32,
    },
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Read { line, why } => write!(f, "line {line}: cannot read: {why}"),
            TraceError::Header { found } if found.is_empty() => {
                write!(f, "line 1: not a cuvmm trace: expected `{HEADER}`, found nothing")
            }
            TraceError::Header { found } => {
                write!(f, "line 1: not a cuvmm trace: expected `{HEADER}`, found `{found}`")
            }
            TraceError::Fields { line, found } => {
                write!(f, "line {line}: expected 6 fields (op t_ns device stream size ptr), found {found}")
            }
            TraceError::Op { line, found } => write!(f, "line {line}: unknown operation `{found}` (a or f)"),
            TraceError::Number { line, field, found } => {
                write!(f, "line {line}: {field} `{found}` is not a {}", number_kind(field))
            }
            TraceError::Size { line, size } => {
                write!(f, "line {line}: an allocation of {size} bytes returned an address")
            }
            TraceError::AllocatedTwice { line, ptr, first } => {
                write!(f, "line {line}: {ptr:#x} allocated again while live (allocated on line {first})")
            }
            TraceError::UnknownFree { line, ptr } => {
                write!(f, "line {line}: free of {ptr:#x}, which is not live")
            }
            TraceError::TooMany { line, what } => write!(f, "line {line}: more than 2^32 {what}"),
            TraceError::NoAllocations { device } => {
                write!(f, "no successful allocation of device {device} in the trace")
            }
        }
    }
}

impl std::error::Error for TraceError {}

fn number_kind(field: &str) -> &'static str {
    match field {
        "stream" | "ptr" => "hexadecimal number with 0x",
        "device" => "device number",
        "size" => "signed integer",
        _ => "non-negative integer",
    }
}

/// At most 40 characters of `s`, so that an error about a binary file stays one short line.
fn shorten(s: &str) -> String {
    let mut out: String = s.chars().take(40).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

fn hex(s: &str, line: usize, field: &'static str) -> Result<u64, TraceError> {
    let bad = || TraceError::Number { line, field, found: shorten(s) };
    let digits = s.strip_prefix("0x").ok_or_else(bad)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    u64::from_str_radix(digits, 16).map_err(|_| bad())
}

fn number<T: std::str::FromStr>(s: &str, line: usize, field: &'static str) -> Result<T, TraceError> {
    s.parse().map_err(|_| TraceError::Number { line, field, found: shorten(s) })
}

/// A block live while parsing.
struct Live {
    id: u32,
    stream: u32,
    size: u64,
    line: usize,
}

/// Parses a trace, keeping `device`'s records. Every line is checked, other devices' included.
pub fn parse(mut input: impl BufRead, device: i32) -> Result<Trace, TraceError> {
    let mut t = Trace { device, ..Trace::default() };
    // The null handle and CU_STREAM_LEGACY name the same stream.
    let key = |s: u64| if s == 0 { CU_STREAM_LEGACY as u64 } else { s };
    let mut stream_of: HashMap<u64, u32> = HashMap::new();
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut buf = String::new();
    let mut line = 0;
    loop {
        buf.clear();
        let n =
            input.read_line(&mut buf).map_err(|e| TraceError::Read { line: line + 1, why: e.to_string() })?;
        if n == 0 {
            break;
        }
        line += 1;
        let text = buf.strip_suffix('\n').unwrap_or(&buf);
        let text = text.strip_suffix('\r').unwrap_or(text);
        if line == 1 {
            if text != HEADER {
                return Err(TraceError::Header { found: shorten(text) });
            }
            continue;
        }
        let mut fields = [""; 6];
        let mut count = 0;
        for w in text.split_ascii_whitespace() {
            if let Some(slot) = fields.get_mut(count) {
                *slot = w;
            }
            count += 1;
        }
        if count != 6 {
            return Err(TraceError::Fields { line, found: count });
        }
        let alloc = match fields[0] {
            "a" => true,
            "f" => false,
            other => return Err(TraceError::Op { line, found: shorten(other) }),
        };
        let _t_ns: u64 = number(fields[1], line, "t_ns")?;
        let dev: i32 = number(fields[2], line, "device")?;
        let stream = hex(fields[3], line, "stream")?;
        let size: i64 = number(fields[4], line, "size")?;
        let ptr = hex(fields[5], line, "ptr")?;
        if dev != device {
            t.other_devices += 1;
            continue;
        }
        if alloc && ptr == 0 {
            t.null_allocations += 1;
            continue;
        }
        let next = stream_of.len();
        let stream = match stream_of.get(&key(stream)) {
            Some(&s) => s,
            None => {
                let s = u32::try_from(next).map_err(|_| TraceError::TooMany { line, what: "streams" })?;
                stream_of.insert(key(stream), s);
                t.streams.push(stream);
                s
            }
        };
        if alloc {
            if size <= 0 {
                return Err(TraceError::Size { line, size });
            }
            if let Some(first) = live.get(&ptr) {
                return Err(TraceError::AllocatedTwice { line, ptr, first: first.line });
            }
            let id = u32::try_from(t.allocations)
                .map_err(|_| TraceError::TooMany { line, what: "allocations" })?;
            let size = size as u64;
            live.insert(ptr, Live { id, stream, size, line });
            t.ops.push(Op::Alloc { id, stream, size });
            t.allocations += 1;
        } else {
            let block = live.remove(&ptr).ok_or(TraceError::UnknownFree { line, ptr })?;
            t.ops.push(Op::Free { id: block.id, stream, size: block.size });
            t.frees += 1;
        }
    }
    if line == 0 {
        return Err(TraceError::Header { found: String::new() });
    }
    if t.allocations == 0 {
        return Err(TraceError::NoAllocations { device });
    }
    let mut left: Vec<Live> = live.into_values().collect();
    left.sort_by_key(|b| b.id);
    t.unfreed = left.len();
    t.ops.extend(left.iter().map(|b| Op::Free { id: b.id, stream: b.stream, size: b.size }));
    Ok(t)
}

/// Reads the trace at `path`, keeping `device`'s records.
pub fn load(path: &Path, device: i32) -> Result<Trace> {
    let why = |e: &dyn fmt::Display| super::invalid(format!("trace {}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| why(&format_args!("cannot open: {e}")))?;
    parse(std::io::BufReader::with_capacity(1 << 20, file), device).map_err(|e| why(&e))
}

/// The most bytes (sizes asked for) live at once, and the index of the first op after which that
/// many are live (`None` for no allocation).
pub fn peak_live(ops: &[Op]) -> (u64, Option<usize>) {
    let (mut live, mut peak, mut at) = (0u64, 0u64, None);
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { size, .. } => {
                // Saturating: a hand-made trace may claim more than 2^64 bytes; it fails later,
                // when allocated, rather than here.
                live = live.saturating_add(size);
                if live > peak || at.is_none() {
                    (peak, at) = (live, Some(i));
                }
            }
            Op::Free { size, .. } => live = live.saturating_sub(size),
        }
    }
    (peak, at)
}

impl Trace {
    /// [`peak_live`] of the trace's ops.
    pub fn peak_live(&self) -> (u64, Option<usize>) {
        peak_live(&self.ops)
    }

    /// Checks what the replay relies on (every allocation freed once, after it, numbers in
    /// range), for traces built by hand rather than parsed.
    pub fn check(&self) -> Result<()> {
        let mut state = vec![0u8; self.allocations];
        for (i, op) in self.ops.iter().enumerate() {
            let (id, stream, want, next) = match *op {
                Op::Alloc { id, stream, .. } => (id, stream, 0, 1),
                Op::Free { id, stream, .. } => (id, stream, 1, 2),
            };
            match state.get_mut(id as usize) {
                Some(s) if *s == want && (stream as usize) < self.streams.len() => *s = next,
                _ => {
                    return Err(super::invalid(format!(
                        "trace op {i} ({op:?}) does not follow its allocation"
                    )))
                }
            }
        }
        if state.iter().any(|&s| s != 2) {
            return Err(super::invalid("the trace leaves allocations live or never makes them"));
        }
        Ok(())
    }
}

/// What the synthetic trace stands for, for the report.
pub const SYNTHETIC: &str = "synthetic (no trace file given): a 12-layer transformer training loop, 16 steps of \
     4 sequences of 128 to 1024 tokens, on 3 streams (compute on the legacy stream, input batches, gradient buckets)";

const LAYERS: usize = 12;
const STEPS: usize = 16;
const HIDDEN: u64 = 768;
const HEADS: u64 = 12;
const BATCH: u64 = 4;
const VOCAB: u64 = 32_000;
const COMPUTE: u64 = 0x0;
const INPUT: u64 = 0x55d0_c3a0_1000;
const BUCKETS: u64 = 0x55d0_c3a0_2000;

#[derive(Clone, Copy)]
struct Blk {
    ptr: u64,
    size: u64,
}

/// Writes trace lines with distinct addresses and a fixed random sequence.
struct Gen {
    out: String,
    rng: u64,
    t: u64,
    next: u64,
}

impl Gen {
    fn rand(&mut self) -> u64 {
        // splitmix64: fixed seed, so the trace is the same on every run and machine.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.rand() % (hi - lo + 1)
    }

    fn line(&mut self, op: char, stream: u64, size: u64, ptr: u64) {
        use std::fmt::Write;
        self.t += 300 + self.rand() % 2000;
        // Writing to a String cannot fail.
        let _ = writeln!(self.out, "{op} {} 0 {stream:#x} {size} {ptr:#x}", self.t);
    }

    fn a(&mut self, size: u64, stream: u64) -> Blk {
        let ptr = self.next;
        self.next += size.div_ceil(512) * 512;
        self.line('a', stream, size, ptr);
        Blk { ptr, size }
    }

    fn f(&mut self, b: Blk, stream: u64) {
        self.line('f', stream, b.size, b.ptr);
    }

    /// A small allocation: 4 bytes to 1 MiB, most of them a few KiB or less.
    fn small(&mut self) -> Blk {
        let e = self.range(2, 19);
        let size = (1 << e) + self.rand() % (1 << e);
        self.a(size, COMPUTE)
    }

    /// Frees the small blocks of `small` and makes `lo..=hi` new ones in their place.
    fn churn_small(&mut self, small: &mut Vec<Blk>, lo: u64, hi: u64) {
        for b in std::mem::take(small) {
            self.f(b, COMPUTE);
        }
        for _ in 0..self.range(lo, hi) {
            let b = self.small();
            small.push(b);
        }
    }

    /// One layer's forward over sequences of `s` tokens from input `x`: its output, and what its
    /// backward reads (`x` among them).
    fn forward_layer(&mut self, x: Blk, s: u64) -> (Blk, Vec<Blk>) {
        let (h, t) = (HIDDEN, BATCH * s);
        let mut keep = vec![x];
        keep.push(self.a(t * h * 2, COMPUTE));
        keep.push(self.a(t * 4, COMPUTE));
        keep.push(self.a(t * 4, COMPUTE));
        keep.push(self.a(t * 3 * h * 2, COMPUTE));
        let mib = self.range(1, 8);
        let workspace = self.a(mib << 20, COMPUTE);
        keep.push(self.a(t * h * 2, COMPUTE));
        keep.push(self.a(BATCH * HEADS * s * 4, COMPUTE));
        self.f(workspace, COMPUTE);
        let proj = self.a(t * h * 2, COMPUTE);
        keep.push(self.a(t * h * 2, COMPUTE));
        self.f(proj, COMPUTE);
        keep.push(self.a(t * h * 2, COMPUTE));
        keep.push(self.a(t * 4, COMPUTE));
        keep.push(self.a(t * 4, COMPUTE));
        keep.push(self.a(t * 4 * h * 2, COMPUTE));
        keep.push(self.a(t * 4 * h * 2, COMPUTE));
        let down = self.a(t * h * 2, COMPUTE);
        let out = self.a(t * h * 2, COMPUTE);
        self.f(down, COMPUTE);
        (out, keep)
    }

    /// One layer's backward over `t` tokens from the gradient `dx`, which it frees with what the
    /// forward kept: the gradient for the layer below.
    fn backward_layer(&mut self, dx: Blk, t: u64, kept: Vec<Blk>) -> Blk {
        let h = HIDDEN;
        let dact = self.a(t * 4 * h * 2, COMPUTE);
        let dup = self.a(t * 4 * h * 2, COMPUTE);
        self.f(dact, COMPUTE);
        let dmid = self.a(t * h * 2, COMPUTE);
        self.f(dup, COMPUTE);
        let dqkv = self.a(t * 3 * h * 2, COMPUTE);
        let mib = self.range(1, 8);
        let workspace = self.a(mib << 20, COMPUTE);
        self.f(workspace, COMPUTE);
        let dnext = self.a(t * h * 2, COMPUTE);
        self.f(dqkv, COMPUTE);
        self.f(dmid, COMPUTE);
        self.f(dx, COMPUTE);
        for b in kept {
            self.f(b, COMPUTE);
        }
        dnext
    }
}

/// Element counts of one layer's parameters: attention in and out, MLP up and down, two norms.
fn layer_params() -> [u64; 10] {
    let h = HIDDEN;
    [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, 2 * h, 2 * h]
}

/// The synthetic trace's text: deterministic, a transformer's training loop (bf16 activations,
/// fp32 Adam states). Parameters and optimizer states live to the end and are never freed;
/// gradients are replaced each step (`zero_grad(set_to_none=True)`); input batches come on their
/// own stream and are freed on the compute stream; gradient buckets go to a third stream; small
/// blocks come and go throughout, and each step has one size-0 call (null, skipped).
pub fn synthetic_text() -> String {
    let mut g = Gen { out: format!("{HEADER}\n"), rng: 0x5eed_c0de, t: 0, next: 0x7f40_0000_0000 };
    let h = HIDDEN;
    let params: Vec<u64> =
        std::iter::once(VOCAB * h).chain((0..LAYERS).flat_map(|_| layer_params())).chain([h, h]).collect();
    for &n in &params {
        g.a(n * 2, COMPUTE);
    }
    let mut grads: Vec<Blk> = Vec::new();
    let mut adam_made = false;
    let mut small: Vec<Blk> = Vec::new();
    for _ in 0..STEPS {
        let s = 128 * g.range(1, 8);
        let t = BATCH * s;
        let ids = g.a(t * 8, INPUT);
        let labels = g.a(t * 8, INPUT);
        let mask = g.a(BATCH * s, INPUT);
        for b in std::mem::take(&mut grads) {
            g.f(b, COMPUTE);
        }
        g.line('a', COMPUTE, 0, 0);

        // Forward: each layer keeps what its backward reads.
        let mut x = g.a(t * h * 2, COMPUTE);
        let mut saved: Vec<Vec<Blk>> = Vec::new();
        for _ in 0..LAYERS {
            let keep;
            (x, keep) = g.forward_layer(x, s);
            g.churn_small(&mut small, 2, 6);
            saved.push(keep);
        }
        let norm = g.a(t * h * 2, COMPUTE);
        let logits = g.a(t * VOCAB * 2, COMPUTE);
        let softmax = g.a(t * VOCAB * 4, COMPUTE);
        let loss = g.a(4, COMPUTE);
        g.f(softmax, COMPUTE);

        // Backward: gradients appear as the layers' activations go.
        let dlogits = g.a(t * VOCAB * 2, COMPUTE);
        g.f(logits, COMPUTE);
        let mut dx = g.a(t * h * 2, COMPUTE);
        g.f(dlogits, COMPUTE);
        g.f(norm, COMPUTE);
        g.f(x, COMPUTE);
        let mut buckets: Vec<Blk> = Vec::new();
        for layer in (0..LAYERS).rev() {
            for n in layer_params() {
                let b = g.a(n * 2, COMPUTE);
                grads.push(b);
            }
            dx = g.backward_layer(dx, t, saved.pop().unwrap_or_default());
            if layer % 2 == 0 {
                let b = g.a(25 << 20, BUCKETS);
                buckets.push(b);
                if buckets.len() > 2 {
                    let old = buckets.remove(0);
                    g.f(old, BUCKETS);
                }
            }
            g.churn_small(&mut small, 1, 4);
        }
        let demb = g.a(VOCAB * h * 2, COMPUTE);
        grads.push(demb);
        for _ in 0..2 {
            let b = g.a(h * 2, COMPUTE);
            grads.push(b);
        }
        g.f(dx, COMPUTE);
        for b in buckets {
            g.f(b, BUCKETS);
        }

        // Optimizer: states made at the first step; per-layer fp32 temporaries.
        if !adam_made {
            for &n in &params {
                g.a(n * 4, COMPUTE);
                g.a(n * 4, COMPUTE);
            }
            adam_made = true;
        }
        let norms = g.a(params.len() as u64 * 4, COMPUTE);
        for _ in 0..LAYERS {
            let tmp = g.a(layer_params().iter().sum::<u64>() * 4, COMPUTE);
            g.f(tmp, COMPUTE);
        }
        g.f(norms, COMPUTE);
        g.f(loss, COMPUTE);
        for b in [ids, labels, mask] {
            g.f(b, COMPUTE);
        }
    }
    for b in small {
        g.f(b, COMPUTE);
    }
    g.out
}

/// The synthetic trace, parsed.
pub fn synthetic() -> Result<Trace> {
    parse(synthetic_text().as_bytes(), 0).map_err(|e| super::invalid(format!("synthetic trace: {e}")))
}

/// What to run.
#[derive(Clone, Debug)]
pub struct TraceConfig {
    /// Measured passes per allocator (after one warm-up pass each).
    pub reps: usize,
    /// Allocate+free pairs per batch of the cached-pair measure; 0 skips it.
    pub pairs: usize,
    /// Sizes of the cached-pair measure.
    pub pair_sizes: Vec<usize>,
}

impl Default for TraceConfig {
    fn default() -> Self {
        TraceConfig { reps: 3, pairs: 1_000_000, pair_sizes: vec![4 << 10, 1 << 20] }
    }
}

/// One allocator's figures over the measured passes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Measured {
    /// Median host time of an allocation over every allocation of every measured pass, ns.
    pub alloc_median_ns: f64,
    /// Its 99th percentile (nearest rank), ns.
    pub alloc_p99_ns: f64,
    /// Median host time of a free, ns.
    pub free_median_ns: f64,
    /// Its 99th percentile, ns.
    pub free_p99_ns: f64,
    /// Median over passes of a whole pass (all calls, then a context synchronise), ms.
    pub total_ms: f64,
    /// Largest physical memory the allocator held during a measured pass, bytes (see
    /// [`AllocatorRow::physical`]).
    pub peak_physical: u64,
    /// Pages the allocator moved from one address to another in a measured pass (median), where
    /// it counts them: each costs the calling thread driver calls.
    pub pages_moved: Option<u64>,
}

/// How an allocator fared.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// It ran.
    Measured(Measured),
    /// The driver or device lacks it: what and why.
    Unsupported(String),
    /// It failed during the replay (its memory was given back and the others went on).
    Failed(String),
}

/// One allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorRow {
    /// Short name for JSON.
    pub key: &'static str,
    /// Name for the table.
    pub name: &'static str,
    /// What its peak physical memory is.
    pub physical: &'static str,
    /// Its figures.
    pub outcome: Outcome,
}

impl AllocatorRow {
    /// The figures, when it ran.
    pub fn measured(&self) -> Option<&Measured> {
        match &self.outcome {
            Outcome::Measured(m) => Some(m),
            _ => None,
        }
    }
}

/// The cached-pair measure for one size: ns per allocate+free pair, or why there is none.
#[derive(Clone, Debug, PartialEq)]
pub struct PairRow {
    /// Bytes per allocation.
    pub size: usize,
    /// cuvmm's stream allocator.
    pub cuvmm_ns: Result<f64, String>,
    /// cuMemAllocAsync / cuMemFreeAsync.
    pub pool_ns: Result<f64, String>,
}

/// cuvmm's goal for a cached allocate+free pair, ns.
pub const PAIR_GOAL_NS: f64 = 100.0;

/// Batches per size of the cached-pair measure (after one shorter warm-up batch).
pub const PAIR_BATCHES: usize = 5;

/// Everything measured.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceReport {
    /// Bytes asked for and live at the trace's peak.
    pub peak_live: u64,
    /// Index of the op that reaches it.
    pub peak_op: usize,
    /// Measured passes per allocator.
    pub reps: usize,
    /// Whether the allocators took turns per pass; false when their caches together might not
    /// fit, and each then ran alone and gave its memory back before the next.
    pub interleaved: bool,
    /// Free device memory before the replay, bytes.
    pub free_at_start: u64,
    /// What `Instant::now()` twice costs, ns: part of every per-call figure.
    pub timer_ns: f64,
    /// cuvmm, the pool, cuMemAlloc, in that order.
    pub rows: Vec<AllocatorRow>,
    /// Allocate+free pairs per batch of the cached-pair measure.
    pub pairs: usize,
    /// The cached-pair measure per size.
    pub pair_rows: Vec<PairRow>,
    /// ns per `cuStreamIsCapturing` on the pair measure's stream, alone (the check cuvmm makes
    /// on each allocation), or why there is none.
    pub capture_query_ns: Option<Result<f64, String>>,
}

impl TraceReport {
    /// `row`'s median allocation and free times over cuvmm's, when both ran.
    pub fn vs_cuvmm(&self, row: &AllocatorRow) -> Option<(f64, f64)> {
        let base = self.rows.first()?.measured()?;
        let m = row.measured()?;
        Some((m.alloc_median_ns / base.alloc_median_ns, m.free_median_ns / base.free_median_ns))
    }
}

/// An allocator as the replay drives it.
trait Side {
    fn alloc(&mut self, size: usize, stream: CUstream) -> Result<u64>;
    fn free(&mut self, ptr: u64, stream: CUstream) -> Result<()>;
    /// Starts a new peak.
    fn reset_peak(&mut self) -> Result<()>;
    /// Physical memory held at most since `reset_peak`, where the allocator knows it.
    fn peak(&mut self) -> Result<Option<u64>>;
    /// Pages moved so far, where the allocator counts them.
    fn moved(&mut self) -> Option<u64> {
        None
    }
    /// Gives cached memory back to the driver.
    fn release(&mut self) -> Result<()>;
    /// Gives cached memory back and undoes any setting the run changed.
    fn finish(&mut self) -> Result<()> {
        self.release()
    }
}

struct CuvmmSide {
    alloc: StreamAllocator,
}

impl Side for CuvmmSide {
    fn alloc(&mut self, size: usize, stream: CUstream) -> Result<u64> {
        // SAFETY: `stream` is one of the replay's streams of this allocator's context, created
        // before the allocator and destroyed after it (see `run`).
        unsafe { self.alloc.allocate_raw(size, stream, GraphMemory::Keep) }.map(u64::from)
    }
    fn free(&mut self, ptr: u64, stream: CUstream) -> Result<()> {
        // SAFETY: `ptr` came from `alloc` and is freed once (the trace is checked); no kernel
        // uses it on any stream; `stream` as in `alloc`.
        unsafe { self.alloc.free_raw(DevicePtr::new(ptr), stream) }
    }
    fn reset_peak(&mut self) -> Result<()> {
        self.alloc.reset_peaks();
        Ok(())
    }
    fn peak(&mut self) -> Result<Option<u64>> {
        Ok(Some(self.alloc.stats().mapped_peak))
    }
    fn moved(&mut self) -> Option<u64> {
        Some(self.alloc.stats().pages_remapped)
    }
    fn release(&mut self) -> Result<()> {
        self.alloc.empty_cache().map(drop)
    }
}

/// The device's default pool, its release threshold raised for the run.
struct PoolSide {
    ctx: Context,
    api: &'static Api,
    pool: CUmemoryPool,
    old_threshold: u64,
    restored: bool,
}

impl PoolSide {
    fn new(ctx: &Context) -> Result<PoolSide> {
        let device = ctx.device();
        match device.attribute(CUdevice_attribute::MEMORY_POOLS_SUPPORTED) {
            Ok(0) => return Err(super::unsupported("cuMemAllocAsync", "the device has no memory pools")),
            Ok(_) => {}
            Err(e) => return Err(super::unsupported("cuMemAllocAsync", e)),
        }
        let api = driver()?.api();
        ctx.bind()?;
        let pool = pool::default_mem_pool(api, device.raw())?;
        // SAFETY: the default pool lives as long as the driver; the release threshold is a
        // cuuint64_t.
        let old_threshold =
            unsafe { pool::get_attribute_u64(api, pool, CUmemPool_attribute::RELEASE_THRESHOLD) }?;
        let mut side = PoolSide { ctx: ctx.clone(), api, pool, old_threshold, restored: true };
        side.set_threshold(u64::MAX)?;
        side.restored = false;
        Ok(side)
    }

    fn set_threshold(&mut self, value: u64) -> Result<()> {
        // SAFETY: the release threshold attribute takes a cuuint64_t; the pool is the device's
        // default pool, which lives as long as the context.
        unsafe { pool::set_attribute_u64(self.api, self.pool, CUmemPool_attribute::RELEASE_THRESHOLD, value) }
    }
}

impl Side for PoolSide {
    fn alloc(&mut self, size: usize, stream: CUstream) -> Result<u64> {
        // SAFETY: `stream` is a live stream of the context, which is current (bound before each
        // pass).
        unsafe { pool::alloc_async(self.api, size, stream) }
    }
    fn free(&mut self, ptr: u64, stream: CUstream) -> Result<()> {
        // SAFETY: `ptr` came from `alloc` and is freed once; no kernel uses it.
        unsafe { pool::free_async(self.api, ptr, stream) }
    }
    fn reset_peak(&mut self) -> Result<()> {
        // SAFETY: the high-water attribute takes a cuuint64_t, and 0 (resetting it) is the only
        // value it accepts.
        unsafe { pool::set_attribute_u64(self.api, self.pool, CUmemPool_attribute::RESERVED_MEM_HIGH, 0) }
    }
    fn peak(&mut self) -> Result<Option<u64>> {
        // SAFETY: the high-water attribute is a cuuint64_t.
        unsafe { pool::get_attribute_u64(self.api, self.pool, CUmemPool_attribute::RESERVED_MEM_HIGH) }
            .map(Some)
    }
    fn release(&mut self) -> Result<()> {
        // Frees are stream-ordered: the pool trims only what their streams have passed.
        self.ctx.synchronize()?;
        // SAFETY: returns the pool's unused memory to the driver; nothing of it is live.
        unsafe { pool::trim_to(self.api, self.pool, 0) }
    }
    fn finish(&mut self) -> Result<()> {
        self.release()?;
        self.set_threshold(self.old_threshold)?;
        self.restored = true;
        Ok(())
    }
}

impl Drop for PoolSide {
    fn drop(&mut self) {
        if !self.restored {
            // After an error: the pool goes back to what the process had, as far as it can.
            let _ = self.ctx.synchronize();
            // SAFETY: as in `release`.
            let _ = unsafe { pool::trim_to(self.api, self.pool, 0) };
            let _ = self.set_threshold(self.old_threshold);
        }
    }
}

struct DriverSide {
    api: &'static Api,
}

impl Side for DriverSide {
    fn alloc(&mut self, size: usize, _stream: CUstream) -> Result<u64> {
        // The context is current (bound before each pass).
        result::mem::alloc(self.api, size)
    }
    fn free(&mut self, ptr: u64, _stream: CUstream) -> Result<()> {
        // SAFETY: `ptr` came from `alloc` and is freed once; no kernel uses it.
        unsafe { result::mem::free(self.api, ptr) }
    }
    fn reset_peak(&mut self) -> Result<()> {
        Ok(())
    }
    fn peak(&mut self) -> Result<Option<u64>> {
        // Measured by the pass itself, at the trace's peak.
        Ok(None)
    }
    fn release(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The trace bound to the replay's streams.
struct Replay<'a> {
    ctx: &'a Context,
    trace: &'a Trace,
    streams: Vec<CUstream>,
    /// Address of each allocation while live, else 0.
    ptrs: Vec<u64>,
    peak_op: usize,
}

/// Per-call times of the measured passes.
#[derive(Default)]
struct Times {
    alloc_ns: Vec<u32>,
    free_ns: Vec<u32>,
}

struct Pass {
    total: Duration,
    /// Device memory in use at the peak op minus before the pass, when sampled.
    sampled: Option<u64>,
}

fn ns(d: Duration) -> u32 {
    u32::try_from(d.as_nanos()).unwrap_or(u32::MAX)
}

impl Replay<'_> {
    /// One pass of the whole trace; every block is freed by its end. With `sample`, device memory
    /// in use is read after the peak op (that time is left out of the total).
    fn pass<S: Side>(&mut self, side: &mut S, mut times: Option<&mut Times>, sample: bool) -> Result<Pass> {
        self.ctx.bind()?;
        let before = if sample { Some(self.ctx.memory_info()?.used() as u64) } else { None };
        let mut sampled = None;
        let mut aside = Duration::ZERO;
        let start = Instant::now();
        for (i, op) in self.trace.ops.iter().enumerate() {
            let r = match *op {
                Op::Alloc { id, stream, size } => {
                    let t = Instant::now();
                    let r = side.alloc(size as usize, self.streams[stream as usize]);
                    let dt = t.elapsed();
                    r.map(|p| {
                        self.ptrs[id as usize] = p;
                        if let Some(times) = times.as_deref_mut() {
                            times.alloc_ns.push(ns(dt));
                        }
                    })
                }
                Op::Free { id, stream, .. } => {
                    let p = self.ptrs[id as usize];
                    let t = Instant::now();
                    let r = side.free(p, self.streams[stream as usize]);
                    let dt = t.elapsed();
                    r.map(|()| {
                        self.ptrs[id as usize] = 0;
                        if let Some(times) = times.as_deref_mut() {
                            times.free_ns.push(ns(dt));
                        }
                    })
                }
            };
            if let Err(e) = r {
                self.clean_up(side);
                return Err(e);
            }
            if let (Some(before), true) = (before, i == self.peak_op) {
                let t = Instant::now();
                match self.ctx.memory_info() {
                    Ok(m) => sampled = Some((m.used() as u64).saturating_sub(before)),
                    Err(e) => {
                        self.clean_up(side);
                        return Err(e);
                    }
                }
                aside += t.elapsed();
            }
        }
        self.ctx.synchronize()?;
        Ok(Pass { total: start.elapsed().saturating_sub(aside), sampled })
    }

    /// Frees what a failed pass left live; errors are moot by then.
    fn clean_up<S: Side>(&mut self, side: &mut S) {
        let stream = self.streams[0];
        for p in self.ptrs.iter_mut().filter(|p| **p != 0) {
            let _ = side.free(*p, stream);
            *p = 0;
        }
        let _ = self.ctx.synchronize();
    }
}

/// One allocator through the run.
struct Slot<S> {
    key: &'static str,
    name: &'static str,
    physical: &'static str,
    side: Option<S>,
    /// Set when it cannot run or failed.
    gone: Option<Outcome>,
    sample: bool,
    times: Times,
    totals_ms: Vec<f64>,
    peaks: Vec<u64>,
    moved: Vec<u64>,
}

impl<S: Side> Slot<S> {
    fn new(key: &'static str, name: &'static str, physical: &'static str, side: Result<S>) -> Slot<S> {
        let (side, gone) = match side {
            Ok(s) => (Some(s), None),
            Err(Error::Unsupported { what, why }) => {
                (None, Some(Outcome::Unsupported(format!("{what}: {why}"))))
            }
            Err(e) if e.is_code(CUresult::ERROR_NOT_SUPPORTED) => {
                (None, Some(Outcome::Unsupported(e.to_string())))
            }
            Err(e) => (None, Some(Outcome::Failed(format!("setting up: {e}")))),
        };
        Slot {
            key,
            name,
            physical,
            side,
            gone,
            sample: false,
            times: Times::default(),
            totals_ms: Vec::new(),
            peaks: Vec::new(),
            moved: Vec::new(),
        }
    }

    /// Records the failure and lets the allocator go, with whatever it holds.
    fn fail(&mut self, what: &str, e: Error) {
        if let Some(mut side) = self.side.take() {
            let _ = side.finish();
        }
        self.gone = Some(Outcome::Failed(format!("{what}: {e}")));
    }

    fn warm(&mut self, r: &mut Replay<'_>) {
        let Some(side) = self.side.as_mut() else { return };
        if let Err(e) = r.pass(side, None, false) {
            self.fail("warm-up pass", e);
        }
    }

    fn measure(&mut self, r: &mut Replay<'_>) {
        let Some(side) = self.side.as_mut() else { return };
        let run = |side: &mut S,
                   r: &mut Replay<'_>,
                   times: &mut Times,
                   sample: bool|
         -> Result<(f64, u64, Option<u64>)> {
            side.reset_peak()?;
            let before = side.moved();
            let p = r.pass(side, Some(times), sample)?;
            let peak = side.peak()?.or(p.sampled).unwrap_or(0);
            let moved = before.zip(side.moved()).map(|(a, b)| b - a);
            Ok((p.total.as_secs_f64() * 1e3, peak, moved))
        };
        match run(side, r, &mut self.times, self.sample) {
            Ok((ms, peak, moved)) => {
                self.totals_ms.push(ms);
                self.peaks.push(peak);
                self.moved.extend(moved);
            }
            Err(e) => self.fail("measured pass", e),
        }
    }

    fn release(&mut self) -> Result<()> {
        match self.side.as_mut() {
            Some(side) => side.release(),
            None => Ok(()),
        }
    }

    fn finish(&mut self) -> Result<()> {
        match self.side.as_mut() {
            Some(side) => side.finish(),
            None => Ok(()),
        }
    }

    fn pairs(&mut self, stream: &Stream, size: usize, pairs: usize) -> Result<f64, String> {
        match (self.side.as_mut(), &self.gone) {
            (Some(side), _) => cached_pairs(side, stream, size, pairs).map_err(|e| e.to_string()),
            (None, Some(Outcome::Unsupported(why))) => Err(format!("unsupported: {why}")),
            (None, Some(Outcome::Failed(why))) => Err(format!("not run: {why}")),
            (None, _) => Err("not run".into()),
        }
    }

    fn row(self) -> AllocatorRow {
        let outcome = match self.gone {
            Some(o) => o,
            None => {
                let mut t = self.times;
                let (alloc_median_ns, alloc_p99_ns) = quantiles(&mut t.alloc_ns);
                let (free_median_ns, free_p99_ns) = quantiles(&mut t.free_ns);
                Outcome::Measured(Measured {
                    alloc_median_ns,
                    alloc_p99_ns,
                    free_median_ns,
                    free_p99_ns,
                    total_ms: median(&self.totals_ms),
                    peak_physical: self.peaks.iter().copied().max().unwrap_or(0),
                    pages_moved: (!self.moved.is_empty()).then(|| {
                        median(&self.moved.iter().map(|&n| n as f64).collect::<Vec<_>>()).round() as u64
                    }),
                })
            }
        };
        AllocatorRow { key: self.key, name: self.name, physical: self.physical, outcome }
    }
}

/// Median and 99th percentile of `v` (see [`super::stats`]), which is sorted; 0 for none.
fn quantiles(v: &mut [u32]) -> (f64, f64) {
    v.sort_unstable();
    (super::stats::median_sorted(v), super::stats::nearest_rank(v, 0.99))
}

/// What two back-to-back `Instant::now()` calls cost, ns (median of 10,000).
fn timer_floor() -> f64 {
    let samples: Vec<f64> = (0..10_000)
        .map(|_| {
            let t = Instant::now();
            t.elapsed().as_nanos() as f64
        })
        .collect();
    median(&samples)
}

/// ns per allocate+free pair of `size` on one stream: median of [`PAIR_BATCHES`] batches of
/// `pairs` (each ending with a synchronise of the stream), after a shorter warm-up batch.
fn cached_pairs<S: Side>(side: &mut S, stream: &Stream, size: usize, pairs: usize) -> Result<f64> {
    let s = stream.raw();
    stream.context().bind()?;
    per_call_ns(
        pairs,
        || {
            let p = side.alloc(size, s)?;
            side.free(std::hint::black_box(p), s)
        },
        || stream.synchronize(),
    )
}

/// ns per call of `call`: the median of [`PAIR_BATCHES`] batches of `n` calls, each batch
/// closed by `after` (inside the timing), after a warm-up batch of a tenth as many.
fn per_call_ns(
    n: usize,
    mut call: impl FnMut() -> Result<()>,
    mut after: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let mut samples = Vec::new();
    for batch in 0..=PAIR_BATCHES {
        let n = if batch == 0 { (n / 10).max(1) } else { n };
        let t = Instant::now();
        for _ in 0..n {
            call()?;
        }
        after()?;
        if batch > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1e9 / n as f64);
        }
    }
    Ok(median(&samples))
}

/// ns per `cuStreamIsCapturing` of `stream` (the question the allocator asks on every
/// allocation), the median of [`PAIR_BATCHES`] batches of `n` after a shorter warm-up batch.
fn capture_queries(stream: &Stream, n: usize) -> Result<f64> {
    let api = driver()?.api();
    stream.context().bind()?;
    let query = || {
        // SAFETY: a live stream.
        std::hint::black_box(unsafe { result::stream::is_capturing(api, stream.raw()) }?);
        Ok(())
    };
    per_call_ns(n, query, || Ok(()))
}

/// Warms each allocator and replays `reps` measured passes on each: taking turns pass by pass
/// when the device holds all three at once (`interleaved`), so that drift in the machine falls
/// on all alike, else one after the other, each released before the next.
fn replay_all(
    (cu, pool, drv): (&mut Slot<CuvmmSide>, &mut Slot<PoolSide>, &mut Slot<DriverSide>),
    r: &mut Replay<'_>,
    reps: usize,
    interleaved: bool,
) -> Result<()> {
    if interleaved {
        cu.warm(r);
        pool.warm(r);
        drv.warm(r);
        for _ in 0..reps {
            cu.measure(r);
            pool.measure(r);
            drv.measure(r);
        }
    } else {
        cu.warm(r);
        (0..reps).for_each(|_| cu.measure(r));
        cu.release()?;
        pool.warm(r);
        (0..reps).for_each(|_| pool.measure(r));
        pool.release()?;
        drv.warm(r);
        (0..reps).for_each(|_| drv.measure(r));
    }
    Ok(())
}

/// Replays `trace` on `ctx`'s device against the three allocators, then measures cached pairs.
pub fn run(ctx: &Context, trace: &Trace, cfg: &TraceConfig) -> Result<TraceReport> {
    if cfg.reps == 0 {
        return Err(super::invalid("reps must be positive"));
    }
    if cfg.pairs > 0 && (cfg.pair_sizes.is_empty() || cfg.pair_sizes.contains(&0)) {
        return Err(super::invalid("pair sizes must be positive"));
    }
    trace.check()?;
    let (peak_live, peak_op) = trace.peak_live();
    let peak_op = peak_op.ok_or_else(|| super::invalid("the trace has no allocation"))?;

    // Streams first: the allocators below may record events on them, so they must outlive them
    // (locals drop in reverse order).
    let streams = trace.streams.iter().map(|_| Stream::non_blocking(ctx)).collect::<Result<Vec<_>>>()?;
    let pair_stream = Stream::non_blocking(ctx)?;
    let api = driver()?.api();
    let free_at_start = ctx.memory_info()?.free as u64;
    // Warm caches of two allocators plus the third's live blocks, with room for fragmentation.
    let interleaved = peak_live.saturating_mul(4) <= free_at_start;
    let timer_ns = timer_floor();

    let mut cu = Slot::new(
        "cuvmm",
        "cuvmm StreamAllocator",
        "stats().mapped_peak: pages mapped plus spare pages",
        StreamAllocator::new(ctx).map(|alloc| CuvmmSide { alloc }),
    );
    let mut pool = Slot::new(
        "cuMemAllocAsync",
        "cuMemAllocAsync pool",
        "CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH of the default pool",
        PoolSide::new(ctx),
    );
    let mut drv = Slot::new(
        "cuMemAlloc",
        "cuMemAlloc/cuMemFree",
        "device memory in use (cuMemGetInfo) after the peak-live op minus before the pass, device-wide",
        Ok(DriverSide { api }),
    );
    drv.sample = true;
    let calls =
        |alloc: bool| trace.ops.iter().filter(|o| matches!(o, Op::Alloc { .. }) == alloc).count() * cfg.reps;
    // Reserved up front, so that no measured call pays for a vector growing.
    for (times, runs) in [
        (&mut cu.times, cu.side.is_some()),
        (&mut pool.times, pool.side.is_some()),
        (&mut drv.times, drv.side.is_some()),
    ] {
        if runs {
            times.alloc_ns.reserve_exact(calls(true));
            times.free_ns.reserve_exact(calls(false));
        }
    }

    let mut r = Replay {
        ctx,
        trace,
        streams: streams.iter().map(Stream::raw).collect(),
        ptrs: vec![0; trace.allocations],
        peak_op,
    };
    replay_all((&mut cu, &mut pool, &mut drv), &mut r, cfg.reps, interleaved)?;

    let mut pair_rows = Vec::new();
    if cfg.pairs > 0 {
        for &size in &cfg.pair_sizes {
            let cuvmm_ns = cu.pairs(&pair_stream, size, cfg.pairs);
            let pool_ns = pool.pairs(&pair_stream, size, cfg.pairs);
            pair_rows.push(PairRow { size, cuvmm_ns, pool_ns });
        }
    }
    let capture_query_ns =
        (cfg.pairs > 0).then(|| capture_queries(&pair_stream, cfg.pairs).map_err(|e| e.to_string()));
    cu.finish()?;
    pool.finish()?;
    let rows = vec![cu.row(), pool.row(), drv.row()];
    Ok(TraceReport {
        peak_live,
        peak_op,
        reps: cfg.reps,
        interleaved,
        free_at_start,
        timer_ns,
        rows,
        pairs: cfg.pairs,
        pair_rows,
        capture_query_ns,
    })
}

// The options of `cuvmm bench trace` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The trace file; without one, a synthetic transformer-like trace.
    path: Option<std::path::PathBuf>,
    /// Measured passes per allocator (after one warm-up pass each).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Allocate+free pairs per batch of the cached-pair measure (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    pairs: usize,
    /// Sizes of the cached-pair measure.
    #[arg(long, default_value = "4KiB,1MiB", value_parser = parse_sizes)]
    pair_sizes: std::vec::Vec<usize>,
    /// Device ordinal to replay on; the trace's records of this device are replayed unless
    /// --trace-device says otherwise.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Replay the trace's records of this device (default: --device).
    #[arg(long)]
    trace_device: Option<i32>,
    /// JSON lines instead of tables.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench trace`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { path, reps, pairs, pair_sizes, device, trace_device, json } = args;
    let records = match trace_device {
        Some(d) => d,
        None => i32::try_from(device).map_err(|_| super::invalid("device ordinal too large"))?,
    };
    // Read before touching the driver: a bad file is reported on any machine.
    let t = match &path {
        Some(p) => load(p, records)?,
        None => synthetic()?,
    };
    let ctx = Context::for_ordinal(device)?;
    let cfg = TraceConfig { reps, pairs, pair_sizes };
    let r = run(&ctx, &t, &cfg)?;
    print_trace(out, &ctx.device().name()?, path.as_deref(), &t, &r, json)?;
    Ok(())
}

/// The trace replay's report.
pub fn print_trace(
    out: &mut impl Write,
    name: &str,
    path: Option<&std::path::Path>,
    t: &Trace,
    r: &TraceReport,
    json: bool,
) -> CliResult {
    let threshold = "release threshold of the default pool raised to u64::MAX for the run, restored after";
    if json {
        return print_trace_json(out, name, path, t, r, threshold);
    }
    let source = match path {
        Some(p) => format!("file {}", p.display()),
        None => SYNTHETIC.to_string(),
    };
    print_trace_summary(out, &source, name, t, r, threshold)?;
    print_trace_rows(out, r)?;
    if !r.pair_rows.is_empty() {
        print_trace_pairs(out, r)?;
    }
    Ok(())
}

/// [`print_trace`] as JSON lines: the trace, each allocator, each pair size, the capture query.
fn print_trace_json(
    out: &mut impl Write,
    name: &str,
    path: Option<&std::path::Path>,
    t: &Trace,
    r: &TraceReport,
    threshold: &str,
) -> CliResult {
    writeln!(
        out,
        "{}",
        json!({"bench": "trace", "device": name, "source": if path.is_some() { "file" } else { "synthetic" },
               "path": path.map(|p| p.display().to_string()), "trace_device": t.device, "ops": t.ops.len(),
               "allocations": t.allocations, "frees": t.frees, "freed_at_end": t.unfreed,
               "null_allocations_skipped": t.null_allocations, "other_device_records_skipped": t.other_devices,
               "streams": t.streams.len(), "peak_live": r.peak_live, "peak_op_index": r.peak_op, "reps": r.reps,
               "interleaved": r.interleaved, "free_at_start": r.free_at_start, "timer_ns": r.timer_ns,
               "pool_release_threshold": threshold})
    )?;
    for row in &r.rows {
        let line = match &row.outcome {
            Outcome::Measured(m) => {
                let vs = r.vs_cuvmm(row);
                json!({"bench": "trace", "allocator": row.key, "alloc_median_ns": m.alloc_median_ns,
                       "alloc_p99_ns": m.alloc_p99_ns, "free_median_ns": m.free_median_ns,
                       "free_p99_ns": m.free_p99_ns, "total_ms": m.total_ms, "peak_physical": m.peak_physical,
                       "peak_physical_is": row.physical, "physical_over_live": m.peak_physical as f64 / r.peak_live as f64,
                       "pages_moved_per_pass": m.pages_moved,
                       "alloc_median_vs_cuvmm": vs.map(|v| v.0), "free_median_vs_cuvmm": vs.map(|v| v.1)})
            }
            Outcome::Unsupported(why) => {
                json!({"bench": "trace", "allocator": row.key, "unsupported": why})
            }
            Outcome::Failed(why) => json!({"bench": "trace", "allocator": row.key, "failed": why}),
        };
        writeln!(out, "{line}")?;
    }
    for p in &r.pair_rows {
        let fig = |v: &Result<f64, String>| match v {
            Ok(ns) => json!(ns),
            Err(why) => json!({"error": why}),
        };
        writeln!(
            out,
            "{}",
            json!({"bench": "trace", "pair_size": p.size, "pairs": r.pairs, "batches": PAIR_BATCHES,
                   "cuvmm_ns": fig(&p.cuvmm_ns), "pool_ns": fig(&p.pool_ns), "goal_ns": PAIR_GOAL_NS})
        )?;
    }
    if let Some(q) = &r.capture_query_ns {
        let v = match q {
            Ok(ns) => json!(ns),
            Err(why) => json!({"error": why}),
        };
        writeln!(out, "{}", json!({"bench": "trace", "capture_query_ns": v}))?;
    }
    Ok(())
}

/// The trace and how it was replayed.
fn print_trace_summary(
    out: &mut impl Write,
    source: &str,
    name: &str,
    t: &Trace,
    r: &TraceReport,
    threshold: &str,
) -> CliResult {
    writeln!(out, "trace: {source}")?;
    writeln!(
        out,
        "  device {} records: {} allocations, {} frees, {} never freed (freed at the end); {} null allocations \
         and {} records of other devices skipped; {} streams",
        t.device,
        t.allocations,
        t.frees,
        t.unfreed,
        t.null_allocations,
        t.other_devices,
        t.streams.len()
    )?;
    writeln!(
        out,
        "  peak live {} (sizes asked for, alive at once), reached at op {} of {}",
        show(r.peak_live as usize),
        r.peak_op + 1,
        t.ops.len()
    )?;
    writeln!(
        out,
        "replayed on {name}, one stream per trace stream, no kernels: 1 warm-up pass, then {} measured passes per allocator{}",
        r.reps,
        if r.interleaved { ", taking turns pass by pass" } else { "" }
    )?;
    if !r.interleaved {
        writeln!(
            out,
            "  each allocator ran alone and gave its cache back before the next: 4x the peak live is more than the {} free at the start",
            show(r.free_at_start as usize)
        )?;
    }
    writeln!(out, "  cuMemAllocAsync: {threshold}, so that it caches like the others")?;
    writeln!(
        out,
        "  host time around each call; the clock's own {:.0} ns is part of every per-call figure",
        r.timer_ns
    )?;
    Ok(())
}

/// One row per allocator, then what each held at its peak and the pages it moved.
fn print_trace_rows(out: &mut impl Write, r: &TraceReport) -> CliResult {
    writeln!(
        out,
        "{:<22} {:>11} {:>11} {:>11} {:>11} {:>10} {:>13} {:>7} {:>11} {:>10}",
        "allocator",
        "alloc ns",
        "alloc p99",
        "free ns",
        "free p99",
        "replay ms",
        "peak physical",
        "/ live",
        "alloc/cuvmm",
        "free/cuvmm"
    )?;
    for row in &r.rows {
        match &row.outcome {
            Outcome::Measured(m) => {
                let (va, vf) = match r.vs_cuvmm(row) {
                    Some((a, f)) => (format!("{a:.2}x"), format!("{f:.2}x")),
                    None => ("-".into(), "-".into()),
                };
                writeln!(
                    out,
                    "{:<22} {:>11.0} {:>11.0} {:>11.0} {:>11.0} {:>10.2} {:>13} {:>7.3} {:>11} {:>10}",
                    row.name,
                    m.alloc_median_ns,
                    m.alloc_p99_ns,
                    m.free_median_ns,
                    m.free_p99_ns,
                    m.total_ms,
                    show(m.peak_physical as usize),
                    m.peak_physical as f64 / r.peak_live as f64,
                    va,
                    vf
                )?;
            }
            Outcome::Unsupported(why) => writeln!(out, "{:<22} unsupported: {why}", row.name)?,
            Outcome::Failed(why) => writeln!(out, "{:<22} failed: {why}", row.name)?,
        }
    }
    writeln!(out, "ns are medians and 99th percentiles over every call of the measured passes; replay ms the median pass")?;
    writeln!(out, "peak physical, the most over the measured passes:")?;
    for row in &r.rows {
        writeln!(out, "  {:<22} {}", row.name, row.physical)?;
    }
    for row in &r.rows {
        if let Outcome::Measured(Measured { pages_moved: Some(n), .. }) = &row.outcome {
            writeln!(
                out,
                "{}: {n} pages moved per measured pass (median), each a few driver calls on the calling thread",
                row.name
            )?;
        }
    }
    Ok(())
}

/// The cached allocate+free pairs, and what the capture check costs.
fn print_trace_pairs(out: &mut impl Write, r: &TraceReport) -> CliResult {
    writeln!(
        out,
        "\nns per cached allocate+free pair of one size on one stream (median of {} batches of {}; cuvmm's goal ≤ {:.0} ns)",
        PAIR_BATCHES,
        r.pairs,
        PAIR_GOAL_NS
    )?;
    writeln!(
        out,
        "{:>9} {:>10} {:>6} {:>16} {:>12}",
        "size", "cuvmm", "goal", "cuMemAllocAsync", "pool/cuvmm"
    )?;
    let mut notes = Vec::new();
    for p in &r.pair_rows {
        let fig = |v: &Result<f64, String>, notes: &mut Vec<String>| match v {
            Ok(ns) => format!("{ns:.1}"),
            Err(why) => {
                notes.push(why.clone());
                format!("[{}]", notes.len())
            }
        };
        let goal = match p.cuvmm_ns {
            Ok(ns) if ns <= PAIR_GOAL_NS => "met",
            Ok(_) => "missed",
            Err(_) => "-",
        };
        let ratio = match (&p.cuvmm_ns, &p.pool_ns) {
            (Ok(c), Ok(q)) => format!("{:.2}x", q / c),
            _ => "-".into(),
        };
        let (c, q) = (fig(&p.cuvmm_ns, &mut notes), fig(&p.pool_ns, &mut notes));
        writeln!(out, "{:>9} {c:>10} {goal:>6} {q:>16} {ratio:>12}", show(p.size))?;
    }
    for (i, why) in notes.iter().enumerate() {
        writeln!(out, "  [{}] {why}", i + 1)?;
    }
    match &r.capture_query_ns {
        Some(Ok(ns)) => writeln!(
            out,
            "cuStreamIsCapturing alone, the capture check cuvmm makes on each allocation: {ns:.1} ns"
        )?,
        Some(Err(why)) => writeln!(out, "cuStreamIsCapturing alone: {why}")?,
        None => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(body: &str) -> String {
        format!("{HEADER}\n{body}")
    }

    fn parse_str(s: &str, device: i32) -> Result<Trace, TraceError> {
        parse(s.as_bytes(), device)
    }

    #[test]
    fn a_good_trace_parses_in_order_with_streams_numbered_by_first_use() {
        let t = parse_str(
            &trace(
                "a 10 0 0x5581c0 4096 0x7f0000000000\n\
                 a 20 0 0x0 100 0x7f0000001000\n\
                 a 25 0 0x1 0 0x0\n\
                 f 30 0 0x1 100 0x7f0000001000\n\
                 a 40 1 0x99 64 0x7e0000000000\n\
                 a 50 0 0x5581c0 512 0x7f0000001000\n\
                 f 60 0 0x5581c0 4096 0x7f0000000000\n",
            ),
            0,
        )
        .unwrap();
        assert_eq!(
            t.ops,
            vec![
                Op::Alloc { id: 0, stream: 0, size: 4096 },
                Op::Alloc { id: 1, stream: 1, size: 100 },
                // 0x0 and 0x1 are the same (legacy) stream.
                Op::Free { id: 1, stream: 1, size: 100 },
                // The address comes back: a new allocation.
                Op::Alloc { id: 2, stream: 0, size: 512 },
                Op::Free { id: 0, stream: 0, size: 4096 },
                // Never freed: freed at the end on its own stream.
                Op::Free { id: 2, stream: 0, size: 512 },
            ]
        );
        assert_eq!(t.streams, vec![0x5581c0, 0x0]);
        assert_eq!((t.allocations, t.frees, t.unfreed), (3, 2, 1));
        assert_eq!((t.null_allocations, t.other_devices), (1, 1));
        t.check().unwrap();
    }

    #[test]
    fn another_device_is_chosen_and_checked_on_its_own() {
        let text = trace(
            "a 10 0 0x10 4096 0x7f0000000000\n\
             a 20 1 0x20 8192 0x7f0000000000\n\
             f 30 1 0x20 8192 0x7f0000000000\n",
        );
        let t = parse_str(&text, 1).unwrap();
        assert_eq!(
            t.ops,
            vec![Op::Alloc { id: 0, stream: 0, size: 8192 }, Op::Free { id: 0, stream: 0, size: 8192 }]
        );
        assert_eq!((t.device, t.other_devices, t.unfreed), (1, 1, 0));
        assert_eq!(parse_str(&text, 2), Err(TraceError::NoAllocations { device: 2 }));
    }

    #[test]
    fn windows_line_ends_and_a_missing_final_newline_are_accepted() {
        let t = parse_str(&format!("{HEADER}\r\na 1 0 0x0 8 0x100\r\nf 2 0 0x0 8 0x100"), 0).unwrap();
        assert_eq!(t.ops.len(), 2);
    }

    #[test]
    fn bad_traces_are_refused_naming_the_line() {
        let cases: &[(&str, TraceError)] = &[
            ("", TraceError::Header { found: String::new() }),
            ("# cuvmm trace v2\n", TraceError::Header { found: "# cuvmm trace v2".into() }),
            (&trace("a 1 0 0x0 8\n"), TraceError::Fields { line: 2, found: 5 }),
            (&trace("a 1 0 0x0 8 0x10 extra\n"), TraceError::Fields { line: 2, found: 7 }),
            (&trace("\n"), TraceError::Fields { line: 2, found: 0 }),
            (&trace("m 1 0 0x0 8 0x10\n"), TraceError::Op { line: 2, found: "m".into() }),
            (
                &trace("a -1 0 0x0 8 0x10\n"),
                TraceError::Number { line: 2, field: "t_ns", found: "-1".into() },
            ),
            (
                &trace("a 1 x 0x0 8 0x10\n"),
                TraceError::Number { line: 2, field: "device", found: "x".into() },
            ),
            (
                &trace("a 1 0 10 8 0x10\n"),
                TraceError::Number { line: 2, field: "stream", found: "10".into() },
            ),
            (
                &trace("a 1 0 0x 8 0x10\n"),
                TraceError::Number { line: 2, field: "stream", found: "0x".into() },
            ),
            (
                &trace("a 1 0 0x0 8k 0x10\n"),
                TraceError::Number { line: 2, field: "size", found: "8k".into() },
            ),
            (&trace("a 1 0 0x0 8 0xg\n"), TraceError::Number { line: 2, field: "ptr", found: "0xg".into() }),
            (
                &trace("a 1 0 0x0 8 0x10000000000000000\n"),
                TraceError::Number { line: 2, field: "ptr", found: "0x10000000000000000".into() },
            ),
            (&trace("a 1 0 0x0 0 0x10\n"), TraceError::Size { line: 2, size: 0 }),
            (&trace("a 1 0 0x0 -4 0x10\n"), TraceError::Size { line: 2, size: -4 }),
            (
                &trace("a 1 0 0x0 8 0x10\na 2 0 0x0 8 0x10\n"),
                TraceError::AllocatedTwice { line: 3, ptr: 0x10, first: 2 },
            ),
            (&trace("a 1 0 0x0 8 0x10\nf 2 0 0x0 8 0x20\n"), TraceError::UnknownFree { line: 3, ptr: 0x20 }),
            (
                &trace("a 1 0 0x0 8 0x10\nf 2 0 0x0 8 0x10\nf 3 0 0x0 8 0x10\n"),
                TraceError::UnknownFree { line: 4, ptr: 0x10 },
            ),
            (&trace("f 2 0 0x0 8 0x0\n"), TraceError::UnknownFree { line: 2, ptr: 0 }),
            (&trace("a 1 0 0x0 8 0x0\n"), TraceError::NoAllocations { device: 0 }),
        ];
        for (text, want) in cases {
            assert_eq!(parse_str(text, 0).as_ref(), Err(want), "{text:?}");
        }
        // Other devices' lines are checked too.
        assert_eq!(
            parse_str(&trace("a 1 0 0x0 8 0x10\na 1 7 0x0 8 0xzz\n"), 0),
            Err(TraceError::Number { line: 3, field: "ptr", found: "0xzz".into() })
        );
        // A truncated last line, as a killed process leaves it.
        assert_eq!(
            parse_str(&trace("a 1 0 0x0 8 0x10\nf 2 0 0x"), 0),
            Err(TraceError::Fields { line: 3, found: 4 })
        );
    }

    #[test]
    fn bytes_that_are_not_text_are_a_read_error_on_their_line() {
        let mut bytes = trace("a 1 0 0x0 8 0x10\n").into_bytes();
        bytes.extend_from_slice(b"f 2 0 0x0 8 \xff\xfe\n");
        assert!(matches!(parse(&bytes[..], 0), Err(TraceError::Read { line: 3, .. })));
    }

    #[test]
    fn errors_read_as_one_line_and_long_fields_are_shortened() {
        let e = parse_str(&trace(&format!("a 1 0 0x0 8 0x{}\n", "f".repeat(100))), 0).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("line 2: ptr `0xfff"), "{msg}");
        assert!(msg.len() < 120 && !msg.contains('\n'), "{msg}");
        assert_eq!(
            TraceError::UnknownFree { line: 9, ptr: 0xab }.to_string(),
            "line 9: free of 0xab, which is not live"
        );
    }

    #[test]
    fn the_peak_is_the_first_op_reaching_the_most_live_bytes() {
        let a = |id, size| Op::Alloc { id, stream: 0, size };
        let f = |id, size| Op::Free { id, stream: 0, size };
        let ops = [a(0, 100), a(1, 50), f(0, 100), a(2, 100), f(1, 50), a(3, 50), f(2, 100), f(3, 50)];
        assert_eq!(peak_live(&ops), (150, Some(1)));
        let ops = [a(0, 10), f(0, 10), a(1, 30), a(2, 5), f(1, 30), f(2, 5)];
        assert_eq!(peak_live(&ops), (35, Some(3)));
        assert_eq!(peak_live(&[]), (0, None));
        // Saturates rather than overflowing on an absurd trace.
        assert_eq!(peak_live(&[a(0, u64::MAX), a(1, 2)]), (u64::MAX, Some(0)));
        let t = parse_str(&trace("a 1 0 0x0 8 0x10\na 2 0 0x0 24 0x20\nf 3 0 0x0 8 0x10\n"), 0).unwrap();
        assert_eq!(t.peak_live(), (32, Some(1)));
    }

    #[test]
    fn the_check_catches_hand_made_traces_the_replay_could_not_run() {
        let a = |id, stream| Op::Alloc { id, stream, size: 8 };
        let f = |id| Op::Free { id, stream: 0, size: 8 };
        let make =
            |ops: Vec<Op>, allocations| Trace { ops, streams: vec![0], allocations, ..Trace::default() };
        make(vec![a(0, 0), f(0)], 1).check().unwrap();
        assert!(make(vec![f(0), a(0, 0)], 1).check().is_err());
        assert!(make(vec![a(0, 0), f(0), f(0)], 1).check().is_err());
        assert!(make(vec![a(0, 0)], 1).check().is_err());
        assert!(make(vec![a(1, 0), f(1)], 1).check().is_err());
        assert!(make(vec![a(0, 1), f(0)], 1).check().is_err());
    }

    #[test]
    fn the_synthetic_trace_is_deterministic_and_transformer_shaped() {
        let text = synthetic_text();
        assert_eq!(text, synthetic_text());
        let t = synthetic().unwrap();
        assert_eq!(t, synthetic().unwrap());
        t.check().unwrap();
        assert_eq!(t.streams, vec![COMPUTE, INPUT, BUCKETS]);
        assert_eq!(t.null_allocations, STEPS);
        assert_eq!(t.other_devices, 0);
        // Parameters, optimizer states and the last step's gradients are never freed.
        assert!(t.unfreed > 3 * (LAYERS * layer_params().len()), "{}", t.unfreed);
        assert!(t.allocations > 8_000, "{}", t.allocations);
        let sizes: Vec<u64> = t
            .ops
            .iter()
            .filter_map(|o| match *o {
                Op::Alloc { size, .. } => Some(size),
                Op::Free { .. } => None,
            })
            .collect();
        let small = sizes.iter().filter(|&&s| s <= 1 << 20).count();
        let large = sizes.iter().filter(|&&s| s >= 16 << 20).count();
        assert!(small > sizes.len() / 4 && large > sizes.len() / 40, "{small} small, {large} large");
        let distinct: std::collections::HashSet<_> = sizes.iter().collect();
        assert!(distinct.len() > 1000, "{}", distinct.len());
        // Input batches are freed on another stream than their own.
        let mut home = vec![u32::MAX; t.allocations];
        let mut crossed = 0;
        for op in &t.ops {
            match *op {
                Op::Alloc { id, stream, .. } => home[id as usize] = stream,
                Op::Free { id, stream, .. } => crossed += usize::from(home[id as usize] != stream),
            }
        }
        assert_eq!(crossed, 3 * STEPS);
        let (peak, at) = t.peak_live();
        assert!(peak > 1 << 30 && peak < 5 << 30, "{peak}");
        assert!(matches!(t.ops[at.unwrap()], Op::Alloc { .. }));
    }

    #[test]
    fn quantiles_are_median_and_nearest_rank_p99() {
        let mut v: Vec<u32> = (1..=200).rev().collect();
        assert_eq!(quantiles(&mut v), (100.5, 198.0));
        assert_eq!(quantiles(&mut [7, 1, 3]), (3.0, 7.0));
        assert_eq!(quantiles(&mut []), (0.0, 0.0));
    }
}
