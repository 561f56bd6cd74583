//! The entry points PyTorch's pluggable allocator calls besides malloc and free, each with the
//! signature of its hook (`CUDAPluggableAllocator(...).allocator().set_*_fn`): the empty cache
//! of `torch.cuda.empty_cache`, the uses of `Tensor.record_stream`, the limit of
//! `torch.cuda.set_per_process_memory_fraction`. They return nothing, as the hooks do; a refusal
//! is kept for `cuvmm_last_error` and written to stderr once.

use crate::{allocator, guard, plain, reported};
use cuvmm_lib::driver::sys::CUstream;
use std::ffi::{c_int, c_void};

/// `torch.cuda.empty_cache()`: frees the blocks whose frees waited for other streams once that
/// work is done, then gives every idle page of every device used back to the driver.
#[no_mangle]
pub extern "C" fn cuvmm_empty_cache_all() {
    crate::cuvmm_empty_cache(-1);
}

/// `Tensor.record_stream(stream)` for the block at `ptr`: its free waits for the work queued on
/// `stream` by then, as in PyTorch's caching allocator (see cuvmm.h). Any other pointer is
/// ignored, as PyTorch's allocator ignores memory it did not hand out.
#[no_mangle]
pub extern "C" fn cuvmm_record_stream(ptr: *mut c_void, stream: CUstream) {
    guard("cuvmm_record_stream", (), || {
        if ptr.is_null() {
            return Err(plain("null pointer".into()));
        }
        let addr = ptr as usize as u64;
        // PyTorch forwards the call for every tensor, received ones included: the allocator
        // that handed the block out records it, and every other pointer is ignored.
        for (_, a) in crate::allocators() {
            if a.record_stream(addr, stream) {
                break;
            }
        }
        Ok(())
    })
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`: requests that would take the
/// bytes handed out on `device` past `fraction` of its memory fail as out of memory; 1 removes
/// the limit, 0 refuses every request.
#[no_mangle]
pub extern "C" fn cuvmm_set_memory_fraction(fraction: f64, device: c_int) {
    guard("cuvmm_set_memory_fraction", (), || {
        allocator(device)?.set_memory_fraction(fraction).map_err(reported)
    })
}

#[cfg(test)]
#[path = "hooks_tests.rs"]
mod tests;
