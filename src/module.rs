//! Loading PTX and launching kernels.
//!
//! Reach for it to run your own kernels: [`Module::from_ptx`], then [`Function::launch`] with
//! views' addresses; order them with the views' `prepare_read` / `prepare_write` (see
//! [`crate::stream::order`]).

use crate::context::Context;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use crate::stream::Stream;
use std::ffi::{c_void, CString};

/// Zero bytes after the PTX text: more than the driver reads of an image's start before it knows
/// what it holds (8 bytes of a 5-byte text, about 20 of one that looks like an ELF file).
const IMAGE_SLACK: usize = 64;

/// A loaded module (`cuModuleLoadData`). Unloaded on drop, after the context's work is done.
pub struct Module {
    ctx: Context,
    raw: CUmodule,
}

// SAFETY: a module handle may be used from any thread; this type binds its context before use and
// never dereferences the handle.
unsafe impl Send for Module {}
// SAFETY: as above; looking up functions and launching are thread-safe driver calls.
unsafe impl Sync for Module {}

impl Module {
    /// JIT-compiles and loads PTX text. Text that starts as a compiled image would (an ELF
    /// cubin) is refused: it is not PTX, and the driver would parse it as one.
    pub fn from_ptx(ctx: &Context, ptx: &str) -> Result<Module> {
        if ptx.contains('\0') {
            return Err(Error::invalid("PTX text contains a NUL byte"));
        }
        if ptx.as_bytes().starts_with(b"\x7fELF") {
            return Err(Error::invalid("not PTX text: it starts as an ELF image (a cubin) does"));
        }
        // `cuModuleLoadData` takes no length: it reads the first bytes to tell PTX from other
        // images, some tens of bytes even of a shorter text (measured with driver 580), so zeroes
        // follow the NUL to keep that read inside the buffer.
        let mut image = Vec::with_capacity(ptx.len() + IMAGE_SLACK);
        image.extend_from_slice(ptx.as_bytes());
        image.resize(ptx.len() + IMAGE_SLACK, 0);
        ctx.bind()?;
        // SAFETY: the image is NUL-terminated PTX text, followed by zeroes further than the driver
        // looks ahead, and outlives the call.
        let raw = unsafe { result::module::load_data(driver()?.api(), image.as_ptr().cast()) }?;
        Ok(Module { ctx: ctx.clone(), raw })
    }

    /// A kernel by its (unmangled) name.
    pub fn function(&self, name: &str) -> Result<Function<'_>> {
        let cname = CString::new(name).map_err(|_| Error::invalid("kernel name contains a NUL byte"))?;
        self.ctx.bind()?;
        // SAFETY: the module is live while `self` is.
        let raw = unsafe { result::module::get_function(driver()?.api(), self.raw, &cname) }?;
        Ok(Function { module: self, raw })
    }

    /// The module's context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        crate::driver::callback::release_in(&self.ctx, self.raw, |api, raw| {
            // Kernels of this module may still be queued: wait for the (current) context.
            let _ = result::ctx::synchronize(api);
            // SAFETY: unloaded once; nothing of it runs any more.
            crate::error::record_drop(unsafe { result::module::unload(api, raw) });
        });
    }
}

/// Grid and block shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch for a grid-stride kernel over `n` elements: `block` threads a block, at most
    /// `max_blocks` blocks (at least one).
    pub fn grid_stride(n: u64, block: u32, max_blocks: u32) -> LaunchConfig {
        let blocks = n.div_ceil(block.max(1) as u64).clamp(1, max_blocks.max(1) as u64) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (block.max(1), 1, 1), shared_bytes: 0 }
    }
}

/// A kernel in a loaded module.
pub struct Function<'m> {
    module: &'m Module,
    raw: CUfunction,
}

impl Function<'_> {
    /// Queues the kernel on `stream`.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, in order, each to a value of exactly the
    /// parameter's type; every device pointer among them must stay valid until the kernel finishes,
    /// and the kernel must stay inside the memory it is given.
    pub unsafe fn launch(
        &self,
        cfg: LaunchConfig,
        stream: &Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if !stream.context().same_as(&self.module.ctx) {
            return Err(Error::invalid("the stream belongs to another context than the kernel"));
        }
        self.module.ctx.bind()?;
        // SAFETY: the caller vouches for the parameters; the module and stream are live.
        unsafe { launch_raw(self.raw, cfg, stream, params) }
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUfunction {
        self.raw
    }
}

/// `cuLaunchKernel` with a [`LaunchConfig`], for a function handle the caller keeps alive.
///
/// # Safety
/// `f` must be a live kernel of the current context, and `params` as [`Function::launch`] requires.
pub(crate) unsafe fn launch_raw(
    f: CUfunction,
    cfg: LaunchConfig,
    stream: &Stream,
    params: &mut [*mut c_void],
) -> Result<()> {
    let (g, b) = (cfg.grid, cfg.block);
    // SAFETY: forwarded from the caller.
    unsafe { result::module::launch_kernel(driver()?.api(), f, g, b, cfg.shared_bytes, stream.raw(), params) }
}
