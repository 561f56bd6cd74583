//! A driver call failing part-way through a VmmVec growth leaves the vector as it was and leaks
//! nothing. Needs `--features fault-injection` and a GPU.

use cuvmm::driver::sys::CUresult;
use cuvmm::faults;
use cuvmm::vmm::ChunkPolicy;
use cuvmm::{Context, VmmVec};

const MIB: usize = 1 << 20;

fn used(ctx: &Context) -> usize {
    let m = ctx.memory_info().unwrap();
    m.total - m.free
}

/// Grows by three 2 MiB chunks with the `skip`-th call to `call` failing, checks nothing changed.
fn fail_growth(ctx: &Context, reserve: usize, call: &str, skip: usize) {
    let policy = ChunkPolicy { min_chunk: 2 * MIB, max_chunk: 2 * MIB, growth_percent: 0 };
    let mut v =
        VmmVec::<u32>::builder(ctx).chunk_policy(policy).reserve_address_space(reserve).build().unwrap();
    let data: Vec<u32> = (0..(MIB as u32)).map(|i| i ^ 0xa5a5_a5a5).collect(); // 4 MiB: two chunks
    v.extend_from_slice(&data).unwrap();
    let before = (v.device_ptr(), v.len(), v.mapped_bytes(), v.raw().chunk_count(), v.raw().reserved());
    faults::inject(call, skip, CUresult::ERROR_OUT_OF_MEMORY);
    let err = v.reserve(3 * MIB / 2).unwrap_err(); // 6 MiB more: three chunks
    assert_eq!(faults::clear(), 0, "the fault in {call} was not reached");
    assert!(err.is_out_of_memory(), "{call}: {err}");
    assert!(err.to_string().starts_with(&format!("{call} failed")), "{err}");
    let after = (v.device_ptr(), v.len(), v.mapped_bytes(), v.raw().chunk_count(), v.raw().reserved());
    assert_eq!(before, after, "{call} #{skip}");
    assert_eq!(v.to_vec().unwrap(), data);
    // And the vector still grows.
    v.reserve(3 * MIB / 2).unwrap();
    v.push(7).unwrap();
    assert_eq!(v.get(data.len()).unwrap(), Some(7));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_failing_driver_call_in_a_growth_leaves_the_vector_intact() {
    let ctx = Context::for_ordinal(0).unwrap();
    fail_growth(&ctx, 64 * MIB, "cuMemCreate", 0); // warm-up, and a first check
    let baseline = used(&ctx);
    for call in ["cuMemCreate", "cuMemMap", "cuMemSetAccess"] {
        for skip in 0..3 {
            // Inside the reservation.
            fail_growth(&ctx, 64 * MIB, call, skip);
            // Past it: the relocation path (the existing two chunks are re-mapped first).
            fail_growth(&ctx, 4 * MIB, call, skip);
        }
    }
    fail_growth(&ctx, 4 * MIB, "cuMemAddressReserve", 0);
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}
