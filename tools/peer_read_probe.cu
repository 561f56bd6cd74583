// How fast can a kernel read a peer GPU's memory through a VMM peer mapping, and is it the
// kernel's shape that keeps it below the copy engine? GPU 1 reads 1 GiB that GPU 0 created with
// cuMemCreate (mapped read-only, or read-write with argument 3, for GPU 1) and sums it; the sum is
// checked against one taken on GPU 0. Variants: the load instruction (ld.global.nc, plain ld,
// L2::256B / L2::128B prefetch hints, L1::no_allocate, evict-first), loads in flight per thread
// (2-16), blocks per SM (1-8) and block size, warp-contiguous instead of grid-stride order, and
// Hopper bulk copies into shared memory (cp.async.bulk, 2-12 stages of 16-32 KiB). References in
// the same run: cuMemcpyPeerAsync and cuMemcpyDtoDAsync of the same bytes, and the crate's kernel
// shape reading local memory. Medians of 7 after 2 warm-ups, CUDA events; every call checked.
// Then the other direction of travel: GPU 0 pushing the bytes into a cuMemCreate allocation of
// GPU 1 mapped read-write for GPU 0 (a copy kernel with plain, streaming and write-through stores,
// 1-8 blocks per SM, 2-8 stores in flight per thread, and a kernel that only writes), and GPU 1
// pulling them into its own memory with a copy kernel, against cuMemcpyPeerAsync queued on either
// GPU's stream. After every pushed or pulled copy GPU 1 sums the destination (zeroed before).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o peer_read_probe tools/peer_read_probe.cu -lcuda
//   ./peer_read_probe      # two GPUs with peer access; prints GB/s per variant
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorName(r_, &s); printf("FAIL %s: %s line %d\n", #x, s, __LINE__); exit(1);} } while (0)
#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { printf("FAIL %s: %s line %d\n", #x, cudaGetErrorName(r_), __LINE__); exit(1);} } while (0)
typedef unsigned long long u64;
__device__ __forceinline__ u64 sum4(uint4 a) { return (u64)a.x + a.y + a.z + a.w; }
__device__ __forceinline__ void red(u64 s, u64 *out) {
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0 && s) atomicAdd(out, s);
}
template <int MODE> __device__ __forceinline__ uint4 ld(const uint4 *p) {
  uint4 a;
  if (MODE == 0) a = __ldg(p);
  else if (MODE == 1) a = *p;
  else if (MODE == 2) asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(p));
  else if (MODE == 3) asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(p));
  else if (MODE == 4) asm volatile("ld.global.nc.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "l"(p));
  else if (MODE == 5) a = __ldcs(p);
  return a;
}
// Grid-stride, U loads in flight per thread.
template <int MODE, int U> __global__ void k_stride(const uint4 *__restrict__ p, u64 n4, u64 *out) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
  u64 s = 0;
  for (; i + (U - 1) * stride < n4; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) v[k] = ld<MODE>(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < U; ++k) s += sum4(v[k]);
  }
  for (; i < n4; i += stride) s += sum4(ld<MODE>(p + i));
  red(s, out);
}
// Each warp reads U consecutive 512-byte lines per iteration (warp-contiguous 512*U bytes), warps strided.
template <int MODE, int U> __global__ void k_warp(const uint4 *__restrict__ p, u64 n4, u64 *out) {
  const u64 warps = (u64)gridDim.x * blockDim.x / 32;
  const u64 w = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  u64 s = 0;
  const u64 per = 32 * U;  // uint4 per warp step
  for (u64 base = w * per; base + per <= n4; base += warps * per) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) v[k] = ld<MODE>(p + base + k * 32 + lane);
#pragma unroll
    for (int k = 0; k < U; ++k) s += sum4(v[k]);
  }
  red(s, out);  // warp w takes steps w, w + warps, ...: every step once when per divides n4
}
// TMA bulk copies into shared memory, STAGES tiles of TILE bytes per block in flight.
__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
template <int STAGES, int TILE> __global__ void k_tma(const unsigned char *g, u64 nbytes, u64 *out) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) u64 bar[STAGES];
  const u64 ntiles = nbytes / TILE;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s, u64 t) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar[s])), "r"(TILE) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(sm + s * TILE)), "l"(g + t * TILE), "r"(TILE), "r"(sa(&bar[s])) : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) { u64 t = blockIdx.x + (u64)s * gridDim.x; if (t < ntiles) issue(s, t); }
  u64 acc = 0;
  for (u64 k = 0;; ++k) {
    const int s = k % STAGES;
    const u64 t = blockIdx.x + k * gridDim.x;
    if (t >= ntiles) break;
    const unsigned phase = (k / STAGES) & 1;
    unsigned done = 0;
    while (!done) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(sa(&bar[s])), "r"(phase) : "memory");
    const uint4 *t4 = (const uint4 *)(sm + s * TILE);
    for (int i = threadIdx.x; i < TILE / 16; i += blockDim.x) acc += sum4(t4[i]);
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 nt = t + (u64)STAGES * gridDim.x;
      if (nt < ntiles) { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); issue(s, nt); }
    }
  }
  red(acc, out);
}
template <int ST> __device__ __forceinline__ void st4(uint4 *q, uint4 v) {
  if (ST == 0) *q = v;
  else if (ST == 1) __stcs(q, v);
  else __stwt(q, v);
}
// Grid-stride copy, U loads then U stores in flight per thread.
template <int ST, int U> __global__ void k_copy(const uint4 *__restrict__ s, uint4 *__restrict__ d, u64 n4) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n4; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) v[k] = __ldg(s + i + k * stride);
#pragma unroll
    for (int k = 0; k < U; ++k) st4<ST>(d + i + k * stride, v[k]);
  }
  for (; i < n4; i += stride) st4<ST>(d + i, __ldg(s + i));
}
__device__ __forceinline__ uint32_t pat(u64 i) { return (uint32_t)(i * 2654435761u) ^ 0x9e3779b9u; }
// Writes k_fill's pattern, 16 bytes a store: nothing read.
template <int ST> __global__ void k_write(uint4 *d, u64 n4) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n4; i += (u64)gridDim.x * blockDim.x)
    st4<ST>(d + i, make_uint4(pat(4 * i), pat(4 * i + 1), pat(4 * i + 2), pat(4 * i + 3)));
}
__global__ void k_fill(uint32_t *p, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) p[i] = (uint32_t)(i * 2654435761u) ^ 0x9e3779b9u;
}
int sms1;
CUstream st; cudaEvent_t e0, e1; u64 *dout; u64 expect;
double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
template <class F> double timeit(const char *name, u64 bytes, F launch, bool check = true) {
  std::vector<double> v;
  for (int r = 0; r < 9; ++r) {
    RK(cudaMemsetAsync(dout, 0, 8, st));
    RK(cudaEventRecord(e0, st));
    launch();
    RK(cudaGetLastError());
    RK(cudaEventRecord(e1, st));
    RK(cudaEventSynchronize(e1));
    float ms; RK(cudaEventElapsedTime(&ms, e0, e1));
    if (check) { u64 got; RK(cudaMemcpy(&got, dout, 8, cudaMemcpyDeviceToHost)); if (got != expect) { printf("%-44s WRONG SUM %llu vs %llu\n", name, got, expect); return 0; } }
    if (r >= 2) v.push_back(bytes / (ms / 1e3) / 1e9);
  }
  double m = med(v);
  printf("%-44s %7.1f GB/s (min %.1f max %.1f)\n", name, m, *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
  fflush(stdout);
  return m;
}
int main(int argc, char **argv) {
  const u64 bytes = 1ull << 30;
  const u64 n4 = bytes / 16;
  CK(cuInit(0));
  CUdevice d0, d1; CK(cuDeviceGet(&d0, 0)); CK(cuDeviceGet(&d1, 1));
  int can; CK(cuDeviceCanAccessPeer(&can, d1, d0)); printf("can access peer %d\n", can);
  if (!can) { printf("GPU 1 cannot access GPU 0: no peer path to measure\n"); return 2; }
  RK(cudaSetDevice(0));
  // VMM allocation on GPU 0.
  CUmemAllocationProp prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  size_t gran; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)); printf("granularity %zu\n", gran);
  CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, bytes, &prop, 0));
  CUdeviceptr va; CK(cuMemAddressReserve(&va, bytes, 0, 0, 0)); CK(cuMemMap(va, bytes, 0, h, 0));
  const int accmode = argc > 1 ? atoi(argv[1]) : 1;  // 1: peer read-only, 3: read-write
  CUmemAccessDesc acc[2] = {}; acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE; acc[0].location.id = 0; acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  acc[1].location.type = CU_MEM_LOCATION_TYPE_DEVICE; acc[1].location.id = 1; acc[1].flags = accmode == 1 ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(va, bytes, acc, 2));
  k_fill<<<1024, 256>>>((uint32_t *)va, bytes / 4); RK(cudaDeviceSynchronize());
  // Expected sum computed on GPU 0 locally.
  RK(cudaMalloc(&dout, 8)); RK(cudaMemset(dout, 0, 8));
  k_stride<0, 8><<<132 * 8, 256>>>((const uint4 *)va, n4, dout); RK(cudaDeviceSynchronize());
  RK(cudaMemcpy(&expect, dout, 8, cudaMemcpyDeviceToHost)); RK(cudaFree(dout));
  RK(cudaSetDevice(1));
  cudaDeviceProp dp; RK(cudaGetDeviceProperties(&dp, 1)); sms1 = dp.multiProcessorCount; printf("%s SMs %d\n", dp.name, sms1);
  RK(cudaMalloc(&dout, 8)); CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING)); RK(cudaEventCreate(&e0)); RK(cudaEventCreate(&e1));
  unsigned char *local; RK(cudaMalloc(&local, bytes));
  const uint4 *p = (const uint4 *)va;
  CUcontext c0, c1;
  CK(cuDevicePrimaryCtxRetain(&c0, d0));
  CK(cuDevicePrimaryCtxRetain(&c1, d1));
  timeit("cuMemcpyPeerAsync (reference)", bytes, [&] { CK(cuMemcpyPeerAsync((CUdeviceptr)local, c1, va, c0, bytes, st)); }, false);
  timeit("cuMemcpyDtoDAsync (UVA, peer src)", bytes, [&] { CK(cuMemcpyDtoDAsync((CUdeviceptr)local, va, bytes, st)); }, false);
  const int S = sms1;
#define STRIDE(M, U, B, T) timeit("stride mode " #M " U" #U " blocks/SM " #B " thr " #T, bytes, [&] { k_stride<M, U><<<S * B, T, 0, st>>>(p, n4, dout); })
  STRIDE(0, 8, 8, 256);  // the crate's kernel shape
  STRIDE(0, 8, 1, 256); STRIDE(0, 8, 2, 256); STRIDE(0, 8, 4, 256); STRIDE(0, 8, 2, 1024);
  STRIDE(0, 16, 8, 256); STRIDE(0, 4, 8, 256); STRIDE(0, 2, 8, 256);
  STRIDE(1, 8, 8, 256); STRIDE(2, 8, 8, 256); STRIDE(3, 8, 8, 256); STRIDE(4, 8, 8, 256); STRIDE(5, 8, 8, 256);
  STRIDE(2, 4, 8, 256); STRIDE(2, 16, 4, 256);
#define WARP(M, U, B, T) timeit("warp-contig mode " #M " U" #U " blocks/SM " #B " thr " #T, bytes, [&] { k_warp<M, U><<<S * B, T, 0, st>>>(p, n4, dout); })
  WARP(0, 4, 8, 256); WARP(0, 8, 8, 256); WARP(2, 8, 8, 256); WARP(0, 8, 4, 256); WARP(0, 16, 4, 256);
#define TMA(ST, TILE, B) do { auto k = k_tma<ST, TILE>; RK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, ST * TILE)); \
  timeit("tma stages " #ST " tile " #TILE " blocks/SM " #B, bytes, [&] { k<<<S * B, 256, ST * TILE, st>>>((const unsigned char *)va, bytes, dout); }); } while (0)
  TMA(4, 16384, 1); TMA(8, 16384, 1); TMA(4, 32768, 1); TMA(6, 32768, 1); TMA(2, 32768, 2); TMA(4, 16384, 2); TMA(3, 16384, 4); TMA(12, 16384, 1);
  // Local reads for scale.
  RK(cudaMemcpyAsync(local, (void *)va, bytes, cudaMemcpyDefault, st)); RK(cudaStreamSynchronize(st));
  timeit("local read, crate shape", bytes, [&] { k_stride<0, 8><<<S * 8, 256, 0, st>>>((const uint4 *)local, n4, dout); });
  timeit("cuMemcpyPeerAsync (reference, again)", bytes, [&] { CK(cuMemcpyPeerAsync((CUdeviceptr)local, c1, va, c0, bytes, st)); }, false);
  // Pushing and pulling into GPU 1's memory.
  CUmemAllocationProp prop1 = prop; prop1.location.id = 1;
  CUmemGenericAllocationHandle h1; CK(cuMemCreate(&h1, bytes, &prop1, 0));
  CUdeviceptr vb; CK(cuMemAddressReserve(&vb, bytes, 0, 0, 0)); CK(cuMemMap(vb, bytes, 0, h1, 0));
  CUmemAccessDesc accb[2] = {acc[0], acc[1]}; accb[0].flags = accb[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(vb, bytes, accb, 2));
  // va needs read-write for GPU 1 only as a destination; here it is a source for both.
  CUstream st0; cudaEvent_t f0, f1;
  RK(cudaSetDevice(0)); CK(cuStreamCreate(&st0, CU_STREAM_NON_BLOCKING)); RK(cudaEventCreate(&f0)); RK(cudaEventCreate(&f1));
  cudaDeviceProp dp0; RK(cudaGetDeviceProperties(&dp0, 0)); const int S0 = dp0.multiProcessorCount;
  // on: 0 or 1, the GPU whose stream runs it. Zeroes vb, times launch, sums vb on GPU 1.
  auto xfer = [&](const char *name, int on, bool check, auto launch) {
    std::vector<double> v;
    for (int r = 0; r < 9; ++r) {
      RK(cudaSetDevice(1)); RK(cudaMemsetAsync((void *)vb, 0, bytes, st)); RK(cudaStreamSynchronize(st));
      RK(cudaSetDevice(on));
      CUstream s = on ? st : st0; cudaEvent_t a = on ? e0 : f0, b = on ? e1 : f1;
      RK(cudaEventRecord(a, s)); launch(s); RK(cudaGetLastError()); RK(cudaEventRecord(b, s)); RK(cudaEventSynchronize(b));
      float ms; RK(cudaEventElapsedTime(&ms, a, b));
      RK(cudaSetDevice(1));
      if (check) {
        RK(cudaMemsetAsync(dout, 0, 8, st));
        k_stride<0, 8><<<sms1 * 8, 256, 0, st>>>((const uint4 *)vb, n4, dout); RK(cudaGetLastError());
        u64 got; RK(cudaMemcpyAsync(&got, dout, 8, cudaMemcpyDeviceToHost, st)); RK(cudaStreamSynchronize(st));
        if (got != expect) { printf("%-44s WRONG SUM %llu vs %llu\n", name, got, expect); return 0.0; }
      }
      if (r >= 2) v.push_back(bytes / (ms / 1e3) / 1e9);
    }
    double m = med(v);
    printf("%-44s %7.1f GB/s (min %.1f max %.1f)\n", name, m, *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
    fflush(stdout);
    return m;
  };
  const uint4 *a4 = (const uint4 *)va; uint4 *b4 = (uint4 *)vb;
  xfer("cuMemcpyPeerAsync on GPU 1's stream", 1, true, [&](CUstream s) { CK(cuMemcpyPeerAsync(vb, c1, va, c0, bytes, s)); });
  xfer("cuMemcpyPeerAsync on GPU 0's stream", 0, true, [&](CUstream s) { CK(cuMemcpyPeerAsync(vb, c1, va, c0, bytes, s)); });
#define PUSH(STM, U, B) xfer("push copy st" #STM " U" #U " blocks/SM " #B, 0, true, [&](CUstream s) { k_copy<STM, U><<<S0 * B, 256, 0, s>>>(a4, b4, n4); })
  PUSH(0, 8, 8); PUSH(0, 4, 8); PUSH(0, 2, 8); PUSH(0, 8, 4); PUSH(0, 8, 2); PUSH(0, 8, 1); PUSH(0, 4, 2);
  PUSH(1, 8, 8); PUSH(1, 4, 4); PUSH(2, 8, 8); PUSH(2, 4, 4);
#define WRITE(STM, B) xfer("push write-only st" #STM " blocks/SM " #B, 0, true, [&](CUstream s) { k_write<STM><<<S0 * B, 256, 0, s>>>(b4, n4); })
  WRITE(0, 8); WRITE(0, 2); WRITE(1, 8); WRITE(1, 2);
#define PULL(U, B) xfer("pull copy U" #U " blocks/SM " #B, 1, true, [&](CUstream s) { k_copy<0, U><<<sms1 * B, 256, 0, s>>>(a4, b4, n4); })
  PULL(8, 8); PULL(4, 4);
  xfer("cuMemcpyPeerAsync on GPU 1's stream, again", 1, true, [&](CUstream s) { CK(cuMemcpyPeerAsync(vb, c1, va, c0, bytes, s)); });
  xfer("cuMemcpyPeerAsync on GPU 0's stream, again", 0, true, [&](CUstream s) { CK(cuMemcpyPeerAsync(vb, c1, va, c0, bytes, s)); });
  PUSH(0, 8, 8); PUSH(1, 4, 4);
  printf("done\n");
  return 0;
}
