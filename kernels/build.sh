#!/usr/bin/env bash
# Rebuilds kernels/cuvmm.ptx from kernels/cuvmm.cu. Needs nvcc 13.0; the pinned PyPI wheels give one:
#   python3 -m venv /tmp/nvcc && /tmp/nvcc/bin/pip install nvidia-cuda-nvcc==13.0.88 \
#     nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 'nvidia-cuda-runtime==13.0.*'
#   NVCC=/tmp/nvcc/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc kernels/build.sh
#
# nvcc 13.0 writes PTX ISA 9.0, which only drivers >= 580 load. These kernels use nothing newer than
# ISA 8.0 (CUDA 12.0), so the header is lowered to `.version 8.0` and ptxas then checks the result at
# that version: the embedded PTX loads on any driver >= 525 (CUDA 12.0) and any GPU from sm_75 on.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
PTXAS=${PTXAS:-$(dirname "$(command -v "$NVCC" || echo "$NVCC")")/ptxas}
"$NVCC" --version | tail -2
"$NVCC" -ptx -arch=compute_75 -O3 -std=c++17 -o cuvmm.ptx.tmp cuvmm.cu
grep -q '^\.version 9\.0$' cuvmm.ptx.tmp || { echo "unexpected PTX version: $(grep '^\.version' cuvmm.ptx.tmp)"; exit 1; }
sed -i 's/^\.version 9\.0$/.version 8.0/' cuvmm.ptx.tmp
"$PTXAS" -arch=sm_75 -o /dev/null cuvmm.ptx.tmp
"$PTXAS" -arch=sm_90 -o /dev/null cuvmm.ptx.tmp
mv cuvmm.ptx.tmp cuvmm.ptx
grep -E '^\.(version|target|address_size)' cuvmm.ptx
grep -c '^\.visible \.entry' cuvmm.ptx | sed 's/^/kernels: /'
