#!/usr/bin/env bash
# The GPU machine's part of a release check: every test, the capability report, every example, the
# quick benchmarks. Run from the repository root with .gpu/ staged (../shared/gpu/stage).
set -u
out=${OUT:-/tmp}
bash .gpu/run 2>&1 | tail -14
echo "=== fabric attempt"; .gpu/tests/test-gpu_ipc --include-ignored --exact fabric_is_refused_naming_imex_and_auto_falls_back_to_posix_fds --nocapture 2>&1 | grep -E 'fabric:|auto chose|test result'
echo "=== cuvmm info"; .gpu/bin/cuvmm info | tee $out/info.txt
.gpu/bin/cuvmm info --json > $out/info.json; echo "info --json rc=$? ($(wc -c < $out/info.json) bytes)"
for e in growable_vec vector_add_mmap pinned_vs_pageable events_callbacks ipc_share peer_access; do
  echo "=== example $e"; .gpu/bin/$e > $out/example_$e.txt 2>&1; echo "rc=$?"; tail -3 $out/example_$e.txt
done
echo "=== example overlap_streams"; .gpu/bin/overlap_streams $out/overlap_example.svg | tail -6
echo "=== bench events"; .gpu/bin/cuvmm bench events
echo "=== bench alloc"; .gpu/bin/cuvmm bench alloc
