//! VmmVec on a GPU: a property-based op sequence against a host model, out of memory, leaks.

use cuvmm::vmm::ChunkPolicy;
use cuvmm::{Context, Error, VmmVec};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

const MIB: usize = 1 << 20;

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

#[derive(Clone, Debug)]
enum Op {
    Push(u32),
    Extend(Vec<u32>),
    Resize(usize, u32),
    Truncate(usize),
    Clear,
    Shrink,
    Reserve(usize),
    Get(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => any::<u32>().prop_map(Op::Push),
        4 => prop::collection::vec(any::<u32>(), 0..2000).prop_map(Op::Extend),
        3 => (0usize..1_500_000, any::<u32>()).prop_map(|(n, v)| Op::Resize(n, v)),
        2 => (0usize..1_500_000).prop_map(Op::Truncate),
        1 => Just(Op::Clear),
        2 => Just(Op::Shrink),
        2 => (0usize..800_000).prop_map(Op::Reserve),
        3 => (0usize..1_600_000).prop_map(Op::Get),
    ]
}

fn apply(v: &mut VmmVec<u32>, model: &mut Vec<u32>, op: &Op) -> cuvmm::Result<()> {
    match op {
        Op::Push(x) => {
            v.push(*x)?;
            model.push(*x);
        }
        Op::Extend(xs) => {
            v.extend_from_slice(xs)?;
            model.extend_from_slice(xs);
        }
        Op::Resize(n, x) => {
            v.resize(*n, *x)?;
            model.resize(*n, *x);
        }
        Op::Truncate(n) => {
            v.truncate(*n);
            model.truncate(*n);
        }
        Op::Clear => {
            v.clear();
            model.clear();
        }
        Op::Shrink => v.shrink_to_fit()?,
        Op::Reserve(n) => v.reserve(*n)?,
        Op::Get(i) => assert_eq!(v.get(*i)?, model.get(*i).copied()),
    }
    Ok(())
}

fn run_ops(v: &mut VmmVec<u32>, ops: &[Op]) {
    let mut model = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let base = v.device_ptr();
        let before = v.raw().reserved();
        apply(v, &mut model, op).unwrap_or_else(|e| panic!("op {i} {op:?}: {e}"));
        assert_eq!(v.len(), model.len(), "op {i} {op:?}");
        assert!(v.capacity() >= v.len());
        if v.raw().reserved() == before {
            assert_eq!(v.device_ptr(), base, "the base moved without a relocation");
        }
        if matches!(op, Op::Shrink) {
            // Every chunk that lay wholly past the end is gone.
            assert!(v.raw().chunks().last().map_or(true, |c| c.offset() < v.len() * 4), "op {i}");
            assert_eq!(v.raw().chunks().iter().map(|c| c.len()).sum::<usize>(), v.mapped_bytes());
        }
        if i % 100 == 99 || i + 1 == ops.len() {
            assert_eq!(v.to_vec().unwrap(), model, "contents after op {i}");
        }
    }
}

fn runner(seed: u8) -> TestRunner {
    TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn random_op_sequences_match_a_host_vec() {
    let ctx = ctx();
    for seed in 0..8u8 {
        let mut r = runner(seed);
        let ops = prop::collection::vec(op(), 1000).new_tree(&mut r).unwrap().current();
        // Small chunks, so that sequences cross many chunk boundaries and shrink often.
        let policy = ChunkPolicy { min_chunk: 2 * MIB, max_chunk: 4 * MIB, growth_percent: 25 };
        let mut v = VmmVec::<u32>::builder(&ctx).chunk_policy(policy).build().unwrap();
        run_ops(&mut v, &ops);
    }
    for seed in 100..103u8 {
        let mut r = runner(seed);
        let ops = prop::collection::vec(op(), 1000).new_tree(&mut r).unwrap().current();
        // A reservation of 4 MiB: growth relocates the mapping to larger ranges, still without a copy.
        let mut v = VmmVec::<u32>::builder(&ctx).reserve_address_space(4 * MIB).build().unwrap();
        run_ops(&mut v, &ops);
        assert!(v.raw().reserved() > 4 * MIB, "the sequence was meant to outgrow the reservation");
    }
}

fn used(ctx: &Context) -> usize {
    ctx.memory_info().unwrap().used()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_memory_during_growth_leaves_the_vector_intact() {
    let ctx = ctx();
    let baseline = used(&ctx);
    let total = ctx.device().total_memory().unwrap();
    {
        let mut v = VmmVec::<u32>::new(&ctx).unwrap();
        let data: Vec<u32> = (0..3_000_000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        v.extend_from_slice(&data).unwrap();
        let (ptr, mapped, chunks) = (v.device_ptr(), v.mapped_bytes(), v.raw().chunk_count());
        // Inside the reservation (it is as large as the device), more than is free.
        let err = v.reserve(total / 4 - v.len() - 1).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        // Far more than the device holds: refused before anything is planned.
        let err = v.resize(total, 7).unwrap_err();
        assert_eq!(err.kind(), cuvmm::ErrorKind::Refused(cuvmm::Refusal::LargerThanDevice), "{err}");
        assert_eq!(
            (v.device_ptr(), v.mapped_bytes(), v.raw().chunk_count(), v.len()),
            (ptr, mapped, chunks, data.len())
        );
        assert_eq!(v.to_vec().unwrap(), data);
        // Still usable.
        v.push(99).unwrap();
        v.extend_from_slice(&[1, 2, 3]).unwrap();
        assert_eq!(v.to_vec().unwrap()[data.len()..], [99, 1, 2, 3]);
    }
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_thousand_grow_shrink_drop_cycles_return_all_memory() {
    let ctx = ctx();
    // Warm up allocations the driver keeps for itself.
    drop(VmmVec::<u8>::with_capacity(&ctx, 64 * MIB).unwrap());
    let baseline = used(&ctx);
    // 2 MiB chunks, so that shrinking to 1 MiB must leave exactly one chunk mapped.
    let policy = ChunkPolicy { min_chunk: 2 * MIB, max_chunk: 2 * MIB, growth_percent: 0 };
    for i in 0..1000usize {
        let mut v = VmmVec::<u8>::builder(&ctx).chunk_policy(policy).build().unwrap();
        v.resize((i % 7 + 1) * 3 * MIB, i as u8).unwrap();
        v.truncate(MIB);
        v.shrink_to_fit().unwrap();
        assert_eq!(v.mapped_bytes(), 2 * MIB);
        v.resize(5 * MIB, 1).unwrap();
        assert_eq!(v.get(5 * MIB - 1).unwrap(), Some(1));
    }
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_are_typed_errors() {
    let ctx = ctx();
    let mut v = VmmVec::<u64>::new(&ctx).unwrap();
    v.extend_from_slice(&[1, 2, 3]).unwrap();
    assert!(matches!(v.reserve(usize::MAX), Err(Error::InvalidArgument(_))));
    assert!(matches!(v.reserve(usize::MAX / 4), Err(Error::InvalidArgument(_))));
    let mut out = [0u64; 2];
    assert!(matches!(v.copy_range_to_host(2..4, &mut out), Err(Error::InvalidArgument(_))));
    assert!(matches!(v.copy_range_to_host(0..3, &mut out), Err(Error::InvalidArgument(_))));
    v.copy_range_to_host(1..3, &mut out).unwrap();
    assert_eq!(out, [2, 3]);
    assert_eq!(v.get(3).unwrap(), None);
    let bad = ChunkPolicy { min_chunk: 0, max_chunk: 0, growth_percent: 0 };
    assert!(matches!(VmmVec::<u8>::builder(&ctx).chunk_policy(bad).build(), Err(Error::InvalidArgument(_))));
    assert_eq!(v.to_vec().unwrap(), [1, 2, 3]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn growth_never_moves_the_base_and_resize_fills_any_element_size() {
    let ctx = ctx();
    let mut v = VmmVec::<[u8; 12]>::new(&ctx).unwrap();
    let base = v.device_ptr();
    let x = [1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
    v.resize(700_001, x).unwrap();
    v.push([0xff; 12]).unwrap();
    assert_eq!(v.device_ptr(), base);
    let all = v.to_vec().unwrap();
    assert!(all[..700_001].iter().all(|e| *e == x));
    assert_eq!(all[700_001], [0xff; 12]);
    let mut w = VmmVec::<f32>::with_capacity(&ctx, 1000).unwrap();
    w.resize(1000, 1.5).unwrap();
    assert!(w.to_vec().unwrap().iter().all(|&f| f == 1.5));
    w.resize(2000, 0.0).unwrap();
    assert!(w.to_vec().unwrap()[1000..].iter().all(|&f| f == 0.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunks_created_ahead_are_used_and_everything_returns() {
    let ctx = ctx();
    let before = ctx.memory_info().unwrap().used();
    {
        let policy = ChunkPolicy { min_chunk: 2 << 20, max_chunk: 64 << 20, growth_percent: 100 };
        let mut v = VmmVec::<u32>::builder(&ctx).chunk_policy(policy).create_ahead(true).build().unwrap();
        let mut model = Vec::new();
        for i in 0..40u32 {
            let chunk: Vec<u32> = (0..(1u32 << 20)).map(|j| j ^ i.wrapping_mul(0x9e37_79b9)).collect();
            v.extend_from_slice(&chunk).unwrap();
            model.extend_from_slice(&chunk);
            assert!(v.raw().ahead_bytes() > 0, "step {i}: no chunk is being made ahead");
            assert!(v.raw().ahead_bytes() <= 4 * (64 << 20), "step {i}: more than four chunks made ahead");
        }
        assert_eq!(v.to_vec().unwrap(), model);
        v.truncate(1 << 20);
        v.shrink_to_fit().unwrap();
        assert_eq!(v.raw().ahead_bytes(), 0, "a chunk made for the old size is let go");
        v.extend_from_slice(&model[..1 << 21]).unwrap();
        assert_eq!(v.get((1 << 20) + 5).unwrap(), Some(model[5]));
    }
    // Every chunk made ahead, the one still being made included, is released by the drop.
    let after = ctx.memory_info().unwrap().used();
    assert!(after <= before + (2 << 20), "before {before}, after {after}");
}

/// Built with the defaults, a vector appended to 4 GiB in 64 MiB steps makes its chunks ahead:
/// the data is right, the memory it holds beyond its capacity stays within what it has mapped
/// (and 1 GiB), and all of it returns when it is dropped. A small vector holds nothing ahead.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_default_vector_makes_chunks_ahead_within_what_it_has_mapped() {
    let ctx = ctx();
    let mut small = VmmVec::<u32>::new(&ctx).unwrap();
    small.resize(1000, 7).unwrap();
    assert_eq!(small.raw().ahead_bytes(), 0);
    drop(small);
    let before = used(&ctx);
    {
        let mut v = VmmVec::<u8>::new(&ctx).unwrap();
        let step = 64 * MIB;
        for i in 0..64usize {
            v.resize((i + 1) * step, i as u8 | 1).unwrap();
            let (mapped, ahead) = (v.mapped_bytes(), v.raw().ahead_bytes());
            assert!(ahead > 0 && ahead <= mapped.min(1 << 30), "step {i}: {ahead} ahead of {mapped}");
            let held = used(&ctx).saturating_sub(before);
            assert!(
                held <= mapped + ahead + 2 * MIB,
                "step {i}: {held} in use, {mapped} mapped, {ahead} ahead"
            );
        }
        for i in 0..64usize {
            assert_eq!(v.get(i * step).unwrap(), Some(i as u8 | 1));
            assert_eq!(v.get((i + 1) * step - 1).unwrap(), Some(i as u8 | 1));
        }
        println!("growths that waited for a chunk made ahead: {} of 64", v.raw().ahead_waits().0);
    }
    let after = used(&ctx);
    assert!(after <= before + 2 * MIB, "before {before}, after {after}");
}
