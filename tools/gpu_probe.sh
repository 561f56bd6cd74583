#!/usr/bin/env bash
# One-off facts from the GPU machine: toolchain, driver, the ABI probe, the entry points' _vN names.
set -x
nvidia-smi; nvcc --version; ls /usr/local/cuda/include/cuda.h; uname -m; cat /proc/devices | grep -i nvidia; ls -la /dev/nvidia* ; ls /dev/nvidia-caps-imex-channels 2>&1
cc -I/usr/local/cuda/include tools/abi_probe.c -o /tmp/abi && /tmp/abi
grep -nE 'define (cuGetProcAddress|cuDeviceGetUuid|cuEventElapsedTime|cuStreamGetCaptureInfo|cuCtxCreate|cuMemcpyHtoDAsync|cuDevicePrimaryCtxRelease|cuIpcOpenMemHandle|cuMemHostRegister|cuStreamDestroy|cuEventDestroy|cuDeviceTotalMem|cuMemGetInfo)\b' /usr/local/cuda/include/cuda.h
grep -nE 'CU_DEVICE_ATTRIBUTE_[A-Z_]+ *= *1[2-4][0-9]' /usr/local/cuda/include/cuda.h | head -40
grep -n 'cuGetProcAddress' /usr/local/cuda/include/cuda.h | head
ls /usr/local/cuda/lib64/stubs 2>/dev/null | head; ldconfig -p | grep libcuda
