//! The entry points PyTorch's pluggable allocator calls besides malloc and free, each with the
//! signature of its hook (`CUDAPluggableAllocator(...).allocator().set_*_fn`): the empty cache
//! of `torch.cuda.empty_cache`, the uses of `Tensor.record_stream`, the limit of
//! `torch.cuda.set_per_process_memory_fraction`. They return nothing, as the hooks do; a refusal
//! is kept for `cuvmm_last_error` and written to stderr once.

use crate::{allocator, guard, plain, reported};
use cuvmm_lib::alloc::DevicePtr;
use cuvmm_lib::driver::sys::CUstream;
use std::ffi::{c_int, c_void};

/// PyTorch's pluggable-allocator hooks, each with its hook's signature (they return nothing; a
/// refusal is kept for cuvmm_last_error).
///
/// cuvmm_empty_cache_all (set_reset_fn, torch.cuda.empty_cache): cuvmm_empty_cache(-1): frees the
/// blocks whose frees waited for other streams once that work is done, then gives every idle page
/// of every device used back to the driver.
#[no_mangle]
pub extern "C" fn cuvmm_empty_cache_all() {
    crate::cuvmm_empty_cache(-1);
}

/// set_record_stream_fn, Tensor.record_stream: the block at `ptr`, of cuvmm_malloc, is used on
/// `stream` too. Its free records an event on each such stream other than the free's and the
/// block goes to no request, on any stream, until they have completed (checked at each request of
/// the device; cuvmm_empty_cache and a request out of memory wait for them), as PyTorch's caching
/// allocator does; it then is freed on the free's stream, so that stream and the recorded ones
/// must still be alive then. A recorded stream being captured runs nothing, so the free does not
/// wait for it; a free captured with it makes its stream join it in the graph. A `ptr` that is not
/// the start of a live block of cuvmm_malloc (memory received from another process, inside a
/// block, or freed) is ignored, as PyTorch's allocator ignores memory it did not hand out; what a
/// block recorded goes with its free.
#[no_mangle]
pub extern "C" fn cuvmm_record_stream(ptr: *mut c_void, stream: CUstream) {
    guard("cuvmm_record_stream", (), || {
        if ptr.is_null() {
            return Err(plain("null pointer".into()));
        }
        let addr = DevicePtr::new(ptr as usize as u64);
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

/// set_memory_fraction_fn, torch.cuda.set_per_process_memory_fraction: requests that would take
/// the bytes handed out on `device` (cuvmm_stats_t.live) past `fraction` of its memory fail as out
/// of memory; 1 removes the limit, 0 (or a fraction rounding to 0 bytes) refuses every request as
/// PyTorch's allocator does, a value outside 0..1 is refused.
#[no_mangle]
pub extern "C" fn cuvmm_set_memory_fraction(fraction: f64, device: c_int) {
    guard("cuvmm_set_memory_fraction", (), || {
        allocator(device)?.set_memory_fraction(fraction).map_err(reported)
    })
}

#[cfg(test)]
#[path = "hooks_tests.rs"]
mod tests;
