#!/usr/bin/env bash
# Runs the PyTorch proof scripts against one libcuvmm.so and reports every result.
#
#   tests/python/run_all.sh BUNDLE_DIR          # uses BUNDLE_DIR/lib/libcuvmm.so
#
# Results go to $OUT_DIR (default BUNDLE_DIR/results): one JSON and one log per run, and
# summary.txt. Every script runs even when an earlier one failed; the exit status is 1 if any
# failed. With BUNDLE_DIR/bin/cuvmm it also records a training run's allocations and runs
# `cuvmm bench trace` on them and `cuvmm bench sleep`.
# Knobs: PYTHON (default python3), TRAIN_ARGS, SLEEP_ARGS, TMS_ARGS, VLLM_ARGS, VLLM_GOALS_ARGS, MP_ARGS (extra arguments), NCCL=0|1
# (default: run the all-reduce when the machine has two or more GPUs).
set -u -o pipefail

if [ $# -ne 1 ] || [ ! -d "$1" ]; then
    echo "usage: $0 BUNDLE_DIR   (with BUNDLE_DIR/lib/libcuvmm.so)" >&2
    exit 2
fi
BUNDLE=$(cd "$1" && pwd)
export CUVMM_LIB="$BUNDLE/lib/libcuvmm.so"
if [ ! -f "$CUVMM_LIB" ]; then
    echo "no $CUVMM_LIB" >&2
    exit 2
fi
# NVLink multicast off for every process started from here (NCCL, PyTorch, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8

HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-$BUNDLE/results}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
failed=0

# run NAME CMD...: runs CMD in the scripts' folder, log to NAME.log, one summary line. PASS needs
# exit status 0 and the run's own checks passed, as its log states them: a Python script's RESULT
# lines must all say "pass": true (and there must be one); with EXPECT set (an extended regular
# expression), a line must match it, e.g. a benchmark's check line with the value it must have.
run() {
    local name=$1; shift
    local log="$OUT_DIR/$name.log" t0 t1 rc
    echo "=== $name: $*" >&2
    t0=$(date +%s.%N)
    (cd "$HERE" && "$@") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    local status=PASS
    if [ "$rc" -ne 0 ]; then
        status="FAIL(rc=$rc)"
    elif [ "$1" = "$PY" ] && ! (cd "$HERE" && "$PY" -c 'import sys, _common; sys.exit(not _common.log_passed(sys.argv[1]))' "$log"); then
        status="FAIL(checks)"
    elif [ -n "${EXPECT:-}" ] && ! grep -Eq "$EXPECT" "$log"; then
        status="FAIL(checks)"
    fi
    [ "$status" = PASS ] || failed=1
    printf '%-28s %-12s %8ss\n' "$name" "$status" "$secs" | tee -a "$SUMMARY" >&2
}

$PY -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' \
    | tee "$OUT_DIR/env.txt" >&2
echo "libcuvmm: $CUVMM_LIB" | tee -a "$OUT_DIR/env.txt" >&2

# a. training under the three allocators, then the comparison
for a in native cuvmm cuvmm-pool; do
    run "train_$a" $PY train.py --alloc "$a" --json "$OUT_DIR/train_$a.json" ${TRAIN_ARGS:-}
done
run compare $PY compare.py "$OUT_DIR/train_native.json" "$OUT_DIR/train_cuvmm.json" "$OUT_DIR/train_cuvmm-pool.json"

# The same training once more, recording its allocations, and the trace replayed against the
# driver's allocators; then sleep and wake of 16 GiB beside the copy bounds (bundle binaries).
if [ -x "$BUNDLE/bin/cuvmm" ]; then
    CUVMM_ALLOC_CONF="trace=$OUT_DIR/train.trace" run train_traced $PY train.py --alloc cuvmm \
        --json "$OUT_DIR/train_traced.json" ${TRAIN_ARGS:-}
    run bench_trace "$BUNDLE/bin/cuvmm" bench trace "$OUT_DIR/train.trace"
    EXPECT='^elements changed across sleep and wake: 0$' run bench_sleep "$BUNDLE/bin/cuvmm" bench sleep
fi

# What another user's frees alone cost a copy that follows them (the wake's conditions below).
run copy_after_free $PY copy_after_free.py --json "$OUT_DIR/copy_after_free.json"

# b-d. both ways
for a in cuvmm cuvmm-pool; do
    run "two_streams_$a" $PY two_streams.py --alloc "$a" --json "$OUT_DIR/two_streams_$a.json"
    run "graph_capture_$a" $PY graph_capture.py --alloc "$a" --json "$OUT_DIR/graph_capture_$a.json"
    run "sleep_wake_$a" $PY sleep_wake.py --alloc "$a" --json "$OUT_DIR/sleep_wake_$a.json" ${SLEEP_ARGS:-}
done
# Out of memory through MemPool is PyTorch's exception, whatever oom= says.
run pool_oom $PY pool_oom.py --json "$OUT_DIR/pool_oom.json"
# Out of memory through change_current_allocator is torch.OutOfMemoryError too, and the process goes on.
run oom_raises $PY oom_raises.py --json "$OUT_DIR/oom_raises.json"
# A convolution near the limit falls back (smaller cuDNN workspace) under cuvmm as under PyTorch's allocator.
run conv_oom $PY conv_oom.py --json "$OUT_DIR/conv_oom.json"
# PyTorch's allocator contract under cuvmm: empty_cache, record_stream, the memory fraction, the
# statistics functions, torch.compile with CUDA graphs (the record_stream run without the hooks
# must fail: it is the proof that the hook matters, so only its RESULT is kept, not counted).
for a in cuvmm native; do
    run "torch_empty_cache_$a" $PY torch_empty_cache.py --alloc "$a" --json "$OUT_DIR/torch_empty_cache_$a.json"
done
run record_stream $PY record_stream.py --json "$OUT_DIR/record_stream.json"
(cd "$HERE" && $PY record_stream.py --no-hook) > "$OUT_DIR/record_stream_no_hook.txt" 2>&1 || true
run memory_fraction $PY memory_fraction.py --json "$OUT_DIR/memory_fraction.json"
run torch_stats $PY torch_stats.py --json "$OUT_DIR/torch_stats.json"
run compile_graphs $PY compile_graphs.py --json "$OUT_DIR/compile_graphs.json"
# CUDA graph trees (the default) under cuvmm and, as the reference, PyTorch's allocator; snapshots.
for a in cuvmm native; do
    run "compile_reduce_overhead_$a" $PY compile_reduce_overhead.py --alloc "$a" --json "$OUT_DIR/compile_reduce_overhead_$a.json"
done
run memory_snapshot $PY memory_snapshot.py --out "$OUT_DIR/memory_snapshot" --json "$OUT_DIR/memory_snapshot.json"
# torch_memory_saver's API on cuvmm, beside torch_memory_saver where it is installed.
run tms_compare $PY tms_compare.py --json "$OUT_DIR/tms_compare.json" ${TMS_ARGS:-}
run vllm_compare $PY vllm_compare.py --json "$OUT_DIR/vllm_compare.json" ${VLLM_ARGS:-}
# First and later sleeps through vLLM's API and the C ABI (unprepared and prepared) against their goals.
run vllm_sleep_goals $PY vllm_sleep_goals.py --json "$OUT_DIR/vllm_sleep_goals.json" ${VLLM_GOALS_ARGS:-}
# A MemPool on cuvmm with expandable segments on: which segments PyTorch makes expandable.
run pool_expandable $PY pool_expandable.py --json "$OUT_DIR/pool_expandable.json"
# torch.multiprocessing on cuvmm memory beside PyTorch's allocator; weight sync with an IPC event.
run mp_share $PY mp_share.py --json "$OUT_DIR/mp_share.json" ${MP_ARGS:-}
run weight_sync $PY weight_sync.py --json "$OUT_DIR/weight_sync.json"
run share_safety $PY share_safety.py --json "$OUT_DIR/share_safety.json"
# A sender freeing tensors a receiver still maps (resize_(0), resize_, out=): nothing aliased.
run share_free $PY share_free.py --json "$OUT_DIR/share_free.json"
# A receiver that returns holding what it received exits with status 0.
run receiver_exit $PY receiver_exit.py --json "$OUT_DIR/receiver_exit.json"

# e. all-reduce, where there are GPUs for it
gpus=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NCCL:-auto}" = 1 ] || { [ "${NCCL:-auto}" = auto ] && [ "$gpus" -ge 2 ]; }; then
    for a in native cuvmm; do
        run "nccl_allreduce_$a" $PY -m torch.distributed.run --standalone --nproc_per_node=2 \
            nccl_allreduce.py --alloc "$a" --json "$OUT_DIR/nccl_allreduce_$a.json"
    done
    run compare_nccl $PY compare.py "$OUT_DIR/nccl_allreduce_native.json" "$OUT_DIR/nccl_allreduce_cuvmm.json"
else
    echo "nccl_allreduce: skipped ($gpus GPU(s))" | tee -a "$SUMMARY" >&2
fi

echo >&2
echo "summary ($OUT_DIR):" >&2
cat "$SUMMARY" >&2
grep -h '^RESULT ' "$OUT_DIR"/*.log > "$OUT_DIR/results.jsonl" || true
exit $failed
