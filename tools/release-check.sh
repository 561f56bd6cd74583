#!/usr/bin/env bash
# The GPU part of a release check, run inside a bundle made by tools/gpu-bundle (copy
# tools/release-check.sh into it, or run it as `bash /path/to/release-check.sh BUNDLE`): every test,
# the capability report, every example, the quick benchmarks. Outputs go to $OUT (default /tmp).
set -u
cd "${1:-$(dirname "$0")}" || exit 1
out=${OUT:-/tmp}
./run 2>&1 | tail -17
echo "=== fabric attempt"; tests/test-gpu_ipc --include-ignored --exact fabric_is_refused_naming_imex_and_auto_falls_back_to_posix_fds --nocapture 2>&1 | grep -E 'fabric:|auto chose|test result'
echo "=== cuvmm info"; bin/cuvmm info | tee "$out/info.txt"
bin/cuvmm info --json > "$out/info.json"; echo "info --json rc=$? ($(wc -c < "$out/info.json") bytes)"
for e in growable_vec vector_add_mmap pinned_vs_pageable overlap_streams events_callbacks ipc_share peer_access cudarc_launch; do
  echo "=== example $e"; bin/$e > "$out/example_$e.txt" 2>&1; echo "rc=$?"; tail -3 "$out/example_$e.txt"
done
echo "=== bench events"; bin/cuvmm bench events
echo "=== bench alloc"; bin/cuvmm bench alloc
echo "=== bench order"; bin/cuvmm bench order
