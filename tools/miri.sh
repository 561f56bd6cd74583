#!/usr/bin/env bash
# Runs the cuvmm library's unit tests (`cargo test -p cuvmm --lib`) under Miri, which checks the
# crate's unsafe code for undefined behaviour. None of those tests needs a CUDA driver: under Miri
# the loader reports no driver without calling dlopen (Miri cannot run foreign code), as on a
# machine without CUDA. Exits 0, saying why, when the nightly toolchain or its Miri component is
# missing; with MIRI_REQUIRED=1 (as in CI) that is a failure instead.
#
#   tools/miri.sh [extra args for the test harness, e.g. a test name filter]
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
  [ "${MIRI_REQUIRED:-0}" = 1 ] && { echo "miri: cannot run: $*"; exit 1; }
  echo "miri: skipped: $*"; exit 0
}
command -v rustup >/dev/null || skip "rustup is not installed"
rustup toolchain list | grep -q '^nightly' || skip "no nightly toolchain (rustup toolchain install nightly --component miri)"
rustup +nightly component list --installed 2>/dev/null | grep -q '^miri' \
  || skip "the nightly toolchain lacks Miri (rustup +nightly component add miri)"
# Miri builds its own standard library from source.
if ! rustup +nightly component list --installed 2>/dev/null | grep -q '^rust-src'; then
  rustup +nightly component add rust-src >/dev/null 2>&1 || skip "rust-src is missing and could not be installed"
fi
cargo +nightly miri setup >/dev/null 2>&1 || skip "cargo miri setup failed (run it by hand to see why)"

# Proptest under Miri: few cases (each runs about a thousand times slower than natively), no fork
# and no timeout (both need processes and clocks Miri does not give), a bounded shrink, a fixed
# seed so that every run tries the same cases and takes the same time, and no regression files
# written into the source tree.
export PROPTEST_CASES="${PROPTEST_CASES:-4}" PROPTEST_FORK=false PROPTEST_TIMEOUT=0
export PROPTEST_MAX_SHRINK_ITERS="${PROPTEST_MAX_SHRINK_ITERS:-64}" PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-1}"
export PROPTEST_DISABLE_FAILURE_PERSISTENCE=1
# One test lists a directory that must be missing: file-system access needs isolation off. No test
# depends on the clock, the environment or randomness from the host.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"

# Skipped: a property test of the chunk planner, safe arithmetic with no unsafe code for Miri to
# check, whose random needs of up to a terabyte can make plans of millions of chunks: seconds
# natively, hours interpreted.
skips=(--skip vmm::layout::tests::plans_cover_the_need_in_aligned_bounded_chunks)
# Skipped: the stream-ordered allocator's logic against its model GPU (heaps, pages, events, sleep):
# no unsafe code (the driver backend is not built into these tests), and thousands of simulated
# operations per property case.
skips+=(--skip alloc::ordered::)
# Skipped: the hand-off's protocol between real sockets, processes, memfds and pidfds, which Miri
# cannot make (its messages' decoding, where the parsing is, runs under Miri).
skips+=(--skip ipc::handoff::tests::)
# Run apart: this test starts cuvmm's release thread, which by design lives until the process
# exits, and Miri reports any thread still running at exit as a leak. Its own run ignores leaks;
# the main run keeps Miri's leak check for every other test.
release=driver::callback::tests::releases_run_inline_normally_and_deferred_inside_a_host_function
log="${TMPDIR:-/tmp}/cuvmm-miri.log"

start=$(date +%s)
set +e
cargo +nightly miri test -p cuvmm --lib -- "${skips[@]}" --skip "$release" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ]; then
  MIRIFLAGS="$MIRIFLAGS -Zmiri-ignore-leaks" cargo +nightly miri test -p cuvmm --lib -- --exact "$release" "$@" 2>&1 \
    | tee -a "$log"
  rc=${PIPESTATUS[0]}
fi
set -e
ran=$(grep -cE '^test .* ok$' "$log" || true)
echo "miri: exit $rc after $(($(date +%s) - start)) s; $ran tests passed under Miri"
exit "$rc"
