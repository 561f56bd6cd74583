//! The crate's own kernels (`kernels/cuvmm.cu`), embedded as PTX and launched through typed,
//! length-checked wrappers.

use crate::context::Context;
use crate::driver::sys::{CUdevice_attribute, CUfunction};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::memory::{DeviceSlice, DeviceSliceMut};
use crate::module::{LaunchConfig, Module};
use crate::stream::Stream;
use std::ffi::c_void;

/// The PTX the crate embeds: ISA 8.0, target sm_75 (see `kernels/build.sh`).
pub const PTX: &str = include_str!("../kernels/cuvmm.ptx");

/// The host's copy of the pattern kernel's hash: element `i` of `pattern_u32(first, seed)` is
/// `pattern_value(first + i, seed)`.
pub fn pattern_value(index: u64, seed: u32) -> u32 {
    let mut x = (index as u32) ^ ((index >> 32) as u32).wrapping_mul(0x9e37_79b9) ^ seed;
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^= x >> 16;
    x
}

/// The host's copy of the busy kernel: what [`Kernels::busy_f32`] makes of an element `x` with
/// `iters` multiply-adds. `f32::mul_add` is the fused `fmaf` the kernel uses, so the two agree bit
/// for bit.
pub fn busy_value(x: f32, iters: u32) -> f32 {
    (0..iters).fold(x, |v, _| v.mul_add(0.999, 0.001))
}

/// Zeroes the 8-byte counter at `ptr` in `stream` order. Callers pass a live counter that
/// outlives the stream's use of it (device owners synchronise before freeing).
fn zero_u64(stream: &Stream, ptr: u64) -> Result<()> {
    stream.context().bind()?;
    // SAFETY: `ptr` is 8 bytes (two 32-bit words) of live device memory, per the callers.
    unsafe {
        crate::driver::result::mem::memset_d32_async(crate::driver::driver()?.api(), ptr, 0, 2, stream.raw())
    }
}

/// The loaded kernels of one context.
pub struct Kernels {
    module: Module,
    fill: CUfunction,
    pattern: CUfunction,
    check: CUfunction,
    checksum: CUfunction,
    checksum4: CUfunction,
    vadd: CUfunction,
    busy: CUfunction,
    copy4: CUfunction,
    max_blocks: u32,
}

// SAFETY: the function handles belong to `module`, which is Send and Sync and lives as long as self;
// launching a function is a thread-safe driver call.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

const BLOCK: u32 = 256;

macro_rules! params {
    ($($v:expr),*) => { [$((&$v) as *const _ as *mut c_void),*] };
}

impl Kernels {
    /// Loads the embedded PTX into `ctx`.
    pub fn load(ctx: &Context) -> Result<Kernels> {
        let module = Module::from_ptx(ctx, PTX)?;
        let f = |name| module.function(name).map(|f| f.raw());
        let sms = ctx.device().attribute(CUdevice_attribute::MULTIPROCESSOR_COUNT)?.max(1) as u32;
        Ok(Kernels {
            fill: f("cuvmm_fill_u32")?,
            pattern: f("cuvmm_pattern_u32")?,
            check: f("cuvmm_check_pattern_u32")?,
            checksum: f("cuvmm_checksum_u32")?,
            checksum4: f("cuvmm_checksum_u32x4")?,
            vadd: f("cuvmm_vector_add_f32")?,
            busy: f("cuvmm_busy_f32")?,
            copy4: f("cuvmm_copy_u32x4")?,
            // Exactly as many blocks as can be resident at once (2048 threads per multiprocessor
            // on sm_75 to sm_90 = 8 blocks of 256): one wave, no straggling second one; the
            // kernels stride over the rest.
            max_blocks: sms * 8,
            module,
        })
    }

    /// The context the kernels are loaded into.
    pub fn context(&self) -> &Context {
        self.module.context()
    }

    fn launch(&self, f: CUfunction, n: usize, stream: &Stream, params: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if !stream.context().same_as(self.module.context()) {
            return Err(Error::invalid("the stream belongs to another context than the kernels"));
        }
        let cfg = LaunchConfig::grid_stride(n as u64, BLOCK, self.max_blocks);
        self.module.context().bind()?;
        // SAFETY: `f` is one of this module's kernels, and each public wrapper passes exactly its
        // parameter list (types as in kernels/cuvmm.cu) with device views valid for `n` elements.
        unsafe { crate::module::launch_raw(f, cfg, stream, params) }
    }

    /// Queues a copy of `bytes` from `src` to `dst` on `stream` by the multiprocessors: `src` may
    /// be pinned host memory, which they read over the bus, leaving the copy engines alone.
    ///
    /// # Safety
    /// `src` and `dst` are 16-byte aligned addresses the device can read and write for `bytes`
    /// bytes (a multiple of 16), until the copy completes, and nothing else writes `dst` or `src`
    /// meanwhile.
    pub(crate) unsafe fn copy_raw(&self, stream: &Stream, src: u64, dst: u64, bytes: usize) -> Result<()> {
        if src % 16 != 0 || dst % 16 != 0 || bytes % 16 != 0 {
            return Err(Error::invalid("a kernel copy moves aligned 16-byte words"));
        }
        let n4 = (bytes / 16) as u64;
        // Four words in flight per thread: a quarter as many threads as words, at most one wave.
        self.launch(self.copy4, (n4 as usize).div_ceil(4), stream, &mut params!(src, dst, n4))
    }

    /// `dst[i] = value`, queued on `stream`.
    pub fn fill_u32(&self, stream: &Stream, dst: &mut DeviceSliceMut<'_, u32>, value: u32) -> Result<()> {
        let _turn = dst.prepare_write(stream)?;
        let (p, n) = (dst.ptr(), dst.len() as u64);
        self.launch(self.fill, dst.len(), stream, &mut params!(p, n, value))
    }

    /// `dst[i] = pattern_value(first + i, seed)`, queued on `stream`.
    pub fn pattern_u32(
        &self,
        stream: &Stream,
        dst: &mut DeviceSliceMut<'_, u32>,
        first: u64,
        seed: u32,
    ) -> Result<()> {
        let _turn = dst.prepare_write(stream)?;
        let (p, n) = (dst.ptr(), dst.len() as u64);
        self.launch(self.pattern, dst.len(), stream, &mut params!(p, n, first, seed))
    }

    /// How many elements of `src` differ from `pattern_value(first + i, seed)`. Waits for `stream`.
    pub fn count_pattern_mismatches(
        &self,
        stream: &Stream,
        src: &DeviceSlice<'_, u32>,
        first: u64,
        seed: u32,
    ) -> Result<u64> {
        let _turn = src.prepare_read(stream)?;
        let out = self.counter(stream)?;
        let (p, n, o) = (src.ptr(), src.len() as u64, out.ptr());
        self.launch(self.check, src.len(), stream, &mut params!(p, n, first, seed, o))?;
        Self::read_counter(stream, &out)
    }

    /// The wrapping sum of `src`'s elements. Waits for `stream`.
    pub fn checksum_u32(&self, stream: &Stream, src: &DeviceSlice<'_, u32>) -> Result<u64> {
        let mut out = DeviceBuffer::<u64>::new(self.module.context(), 1)?;
        self.checksum_u32_queued(stream, src, &mut out.as_mut_slice())?;
        Self::read_counter(stream, &out)
    }

    /// Queues the wrapping sum of `src` into `out[0]` (zeroed first, in stream order) without
    /// waiting: for timing the kernel alone.
    pub fn checksum_u32_queued(
        &self,
        stream: &Stream,
        src: &DeviceSlice<'_, u32>,
        out: &mut DeviceSliceMut<'_, u64>,
    ) -> Result<()> {
        if out.is_empty() {
            return Err(Error::invalid("the checksum needs a one-element output"));
        }
        let _turns = crate::stream::order::turns(&[src.tracker(), out.tracker()])?;
        let (_r, _w) = (src.prepare_read(stream)?, out.prepare_write(stream)?);
        let o = out.ptr();
        zero_u64(stream, o)?;
        // 16-byte loads over the aligned bulk, 4-byte loads over the rest.
        let (mut p, mut n) = (src.ptr(), src.len() as u64);
        if p % 16 == 0 && n >= 4 {
            let n4 = n / 4;
            self.launch(self.checksum4, n4 as usize, stream, &mut params!(p, n4, o))?;
            p += n4 * 16;
            n -= n4 * 4;
        }
        if n > 0 {
            self.launch(self.checksum, n as usize, stream, &mut params!(p, n, o))?;
        }
        Ok(())
    }

    /// A device counter zeroed in stream order, so the kernel that follows on `stream` sees zero.
    fn counter(&self, stream: &Stream) -> Result<DeviceBuffer<u64>> {
        let out = DeviceBuffer::<u64>::new(self.module.context(), 1)?;
        zero_u64(stream, out.ptr())?;
        Ok(out)
    }

    fn read_counter(stream: &Stream, out: &DeviceBuffer<u64>) -> Result<u64> {
        stream.synchronize()?;
        Ok(out.to_vec()?[0])
    }

    /// `c = a + b` elementwise, queued on `stream`; the three lengths must match.
    pub fn vector_add_f32(
        &self,
        stream: &Stream,
        a: &DeviceSlice<'_, f32>,
        b: &DeviceSlice<'_, f32>,
        c: &mut DeviceSliceMut<'_, f32>,
    ) -> Result<()> {
        if a.len() != b.len() || a.len() != c.len() {
            return Err(Error::invalid(format!(
                "vector_add lengths differ: {}, {}, {}",
                a.len(),
                b.len(),
                c.len()
            )));
        }
        let _turns = crate::stream::order::turns(&[a.tracker(), b.tracker(), c.tracker()])?;
        let _r = (a.prepare_read(stream)?, b.prepare_read(stream)?, c.prepare_write(stream)?);
        let (pa, pb, pc, n) = (a.ptr(), b.ptr(), c.ptr(), c.len() as u64);
        self.launch(self.vadd, c.len(), stream, &mut params!(pa, pb, pc, n))
    }

    /// `iters` dependent multiply-adds on each element of `p`, queued on `stream` (each element
    /// becomes [`busy_value`] of it).
    pub fn busy_f32(&self, stream: &Stream, p: &mut DeviceSliceMut<'_, f32>, iters: u32) -> Result<()> {
        let _turn = p.prepare_write(stream)?;
        let (ptr, n) = (p.ptr(), p.len() as u64);
        self.launch(self.busy, p.len(), stream, &mut params!(ptr, n, iters))
    }
}
