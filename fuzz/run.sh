#!/bin/sh
# Fuzzes one target for a while: fuzz/run.sh TARGET [SECONDS] (default 60).
#
# New inputs go to fuzz/corpus/TARGET (git-ignored, created here so a fresh checkout works); the
# checked-in seeds in fuzz/seeds/TARGET are read, never written. Crashes land in
# fuzz/artifacts/TARGET. Needs the nightly toolchain, cargo-fuzz and a C++ compiler.
set -eu
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 TARGET [SECONDS]   (targets: header, recv, growth, handoff)" >&2
    exit 2
fi
target=$1
seconds=${2:-60}
cd "$(dirname "$0")/.."
if [ ! -f "fuzz/fuzz_targets/$target.rs" ]; then
    echo "$0: no fuzz target named $target in fuzz/fuzz_targets" >&2
    exit 2
fi
mkdir -p "fuzz/corpus/$target" "fuzz/seeds/$target"
# The first corpus directory receives new inputs, so the seeds stay as generated.
exec cargo +nightly fuzz run "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds"
