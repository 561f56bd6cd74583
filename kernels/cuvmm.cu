// cuvmm's kernels. Built to PTX by kernels/build.sh; the crate embeds kernels/cuvmm.ptx.
// Plain C ABI names (extern "C") so the crate finds them with cuModuleGetFunction.
// Every kernel is grid-stride, so any launch size covers any n.
#include <stdint.h>

__device__ __forceinline__ uint32_t mix32(uint64_t i, uint32_t seed) {
  // A cheap integer hash (murmur3 finaliser): fresh, non-zero-looking data for any index and seed.
  uint32_t x = (uint32_t)i ^ (uint32_t)(i >> 32) * 0x9e3779b9u ^ seed;
  x ^= x >> 16; x *= 0x85ebca6bu; x ^= x >> 13; x *= 0xc2b2ae35u; x ^= x >> 16;
  return x;
}

#define GRID_STRIDE(i, n) \
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (n); i += (uint64_t)gridDim.x * blockDim.x)

extern "C" __global__ void cuvmm_fill_u32(uint32_t *p, uint64_t n, uint32_t value) {
  GRID_STRIDE(i, n) p[i] = value;
}

// p[i] = mix32(first + i, seed): the pattern tests and IPC write on one side and check on the other.
extern "C" __global__ void cuvmm_pattern_u32(uint32_t *p, uint64_t n, uint64_t first, uint32_t seed) {
  GRID_STRIDE(i, n) p[i] = mix32(first + i, seed);
}

// Counts the elements that differ from the pattern into *mismatches (which the caller zeroes).
extern "C" __global__ void cuvmm_check_pattern_u32(const uint32_t *p, uint64_t n, uint64_t first, uint32_t seed,
                                                   unsigned long long *mismatches) {
  unsigned long long bad = 0;
  GRID_STRIDE(i, n) bad += (p[i] != mix32(first + i, seed));
  if (bad) atomicAdd(mismatches, bad);
}

// Sum of all elements (wrapping) into *sum (which the caller zeroes).
extern "C" __global__ void cuvmm_checksum_u32(const uint32_t *p, uint64_t n, unsigned long long *sum) {
  unsigned long long s = 0;
  GRID_STRIDE(i, n) s += p[i];
  if (s) atomicAdd(sum, s);
}

// The same sum over 16-byte words, eight independent read-only loads in flight per thread and one
// atomic per warp: enough memory-level parallelism to stream from a peer GPU over NVLink. p must
// be 16-byte aligned; n4 counts uint4s.
__device__ __forceinline__ unsigned long long sum4(const uint4 a) {
  return (unsigned long long)a.x + a.y + a.z + a.w;
}

extern "C" __global__ void cuvmm_checksum_u32x4(const uint4 *__restrict__ p, uint64_t n4, unsigned long long *sum) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  unsigned long long s = 0;
  for (; i + 7 * stride < n4; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __ldg(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < 8; ++k) s += sum4(v[k]);
  }
  for (; i < n4; i += stride) s += sum4(__ldg(p + i));
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0 && s) atomicAdd(sum, s);
}

extern "C" __global__ void cuvmm_vector_add_f32(const float *a, const float *b, float *c, uint64_t n) {
  GRID_STRIDE(i, n) c[i] = a[i] + b[i];
}

// A compute kernel of adjustable cost: `iters` dependent fused multiply-adds per element.
// x <- x * 0.999 + 0.001 converges towards 1 and never overflows, whatever iters is.
extern "C" __global__ void cuvmm_busy_f32(float *p, uint64_t n, uint32_t iters) {
  GRID_STRIDE(i, n) {
    float x = p[i];
    for (uint32_t k = 0; k < iters; ++k) x = fmaf(x, 0.999f, 0.001f);
    p[i] = x;
  }
}

// dst[i] = src[i] over 16-byte words, four loads in flight per thread: the staging ring's copy of
// a filled slot (pinned host memory, read over the bus by the multiprocessors) into device memory,
// for when the copy engines are busy with the driver's own work. Both 16-byte aligned; n4 counts
// uint4s.
extern "C" __global__ void cuvmm_copy_u32x4(const uint4 *__restrict__ src, uint4 *__restrict__ dst, uint64_t n4) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n4; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[i + k * stride] = v[k];
  }
  for (; i < n4; i += stride) dst[i] = src[i];
}
