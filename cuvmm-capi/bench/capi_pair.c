/* capi_pair: the cost of one cached cuvmm_malloc + cuvmm_free pair as a C caller sees it (through
 * dlopen, as PyTorch's pluggable allocator calls libcuvmm.so), beside the driver calls a request
 * on a created stream makes (cuStreamIsCapturing + cuStreamGetId) and cuCtxGetCurrent.
 *
 * Usage: capi_pair [LIBCUVMM] [PAIRS]
 *   LIBCUVMM  libcuvmm.so (absent or empty: ../lib/libcuvmm.so beside this program, as a bundle
 *             lays it out)
 *   PAIRS     pairs per batch (default 50000). Each figure is measured with the stack at 16
 *             offsets across a 4 KiB page (see `measure`): at each, the median of 7 batches after
 *             one warm-up batch; printed, the median of those 16 and their fastest and slowest.
 * The driver is CUVMM_LIBCUDA when set (the fake driver of the CPU tests), else libcuda.so.1.
 * Prints one line per figure, "RESULT <what> <size>: <median> ns/pair (min .. max)", device 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libgen.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUcontext;

enum { BATCHES = 7, OFFSETS = 16 };
static long pairs = 50000;

static void *(*cuvmm_malloc)(ssize_t, int, CUstream);
static void (*cuvmm_free)(void *, ssize_t, int, CUstream);
static const char *(*cuvmm_last_error)(void);
static CUresult (*cuStreamIsCapturing)(CUstream, int *);
static CUresult (*cuStreamGetId)(CUstream, unsigned long long *);
static CUresult (*cuCtxGetCurrent)(CUcontext *);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* What one measured call does; nonzero stops the program. */
typedef int (*op_fn)(CUstream s, ssize_t size);

static int capi_pair(CUstream s, ssize_t size) {
  void *p = cuvmm_malloc(size, 0, s);
  if (!p) return 1;
  cuvmm_free(p, size, 0, s);
  return 0;
}

static int stream_calls(CUstream s, ssize_t size) {
  (void)size;
  int status;
  unsigned long long id;
  return cuStreamIsCapturing(s, &status) || cuStreamGetId(s, &id);
}

static int current_context(CUstream s, ssize_t size) {
  (void)s, (void)size;
  CUcontext c;
  return cuCtxGetCurrent(&c) != 0;
}

/* The median of BATCHES batches of `op`, after one, run with the stack OFFSET bytes lower. */
static __attribute__((noinline)) int at_offset(size_t offset, double *median, const char *what,
                                               const char *size_name, op_fn op, CUstream s, ssize_t size) {
  volatile char *pad = __builtin_alloca(offset + 1);
  pad[0] = 0;
  double ns[BATCHES];
  for (int b = -1; b < BATCHES; b++) {
    double t0 = now();
    for (long i = 0; i < pairs; i++) {
      if (op(s, size)) {
        fprintf(stderr, "capi_pair: %s %s failed: %s\n", what, size_name,
                cuvmm_last_error ? cuvmm_last_error() : "");
        return 1;
      }
    }
    if (b >= 0) ns[b] = (now() - t0) / (double)pairs;
  }
  qsort(ns, BATCHES, sizeof ns[0], by_value);
  *median = ns[BATCHES / 2];
  return 0;
}

/* Where the caller's stack lies within a 4 KiB page moved the pair by up to half on one host,
 * with the same instructions (likely loads waiting for stores that share their address's low 12
 * bits, on the stack and in the allocator's data), and the kernel places each process's stack at
 * random. So each figure is measured at OFFSETS places across a page:
 * the median of their medians, the fastest and the slowest. */
static int measure(const char *what, const char *size_name, op_fn op, CUstream s, ssize_t size) {
  double at[OFFSETS];
  for (int k = 0; k < OFFSETS; k++)
    if (at_offset((size_t)k * (4096 / OFFSETS), &at[k], what, size_name, op, s, size)) return 1;
  qsort(at, OFFSETS, sizeof at[0], by_value);
  printf("RESULT %s %s: %.1f ns/pair (min %.1f max %.1f)\n", what, size_name, at[OFFSETS / 2], at[0],
         at[OFFSETS - 1]);
  return 0;
}

static void *need(void *lib, const char *name) {
  void *f = dlsym(lib, name);
  if (!f) {
    fprintf(stderr, "capi_pair: %s not found\n", name);
    exit(2);
  }
  return f;
}

int main(int argc, char **argv) {
  char fallback[4096];
  const char *path = argc > 1 && *argv[1] ? argv[1] : NULL;
  if (!path) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return fprintf(stderr, "capi_pair: give the path of libcuvmm.so\n"), 2;
    self[n] = 0;
    snprintf(fallback, sizeof fallback, "%s/../lib/libcuvmm.so", dirname(self));
    path = fallback;
  }
  if (argc > 2) pairs = atol(argv[2]);
  if (pairs <= 0) return fprintf(stderr, "capi_pair: PAIRS must be positive\n"), 2;
  const char *driver = getenv("CUVMM_LIBCUDA");
  void *cu = dlopen(driver && *driver ? driver : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  void *lib = cu ? dlopen(path, RTLD_NOW) : NULL;
  if (!lib) return fprintf(stderr, "capi_pair: %s\n", dlerror()), 2;
  /* Through the entry-point table, as libcuvmm.so finds them (the fake driver exports no other). */
  CUresult (*get)(const char *, void **, int, unsigned long long) = need(cu, "cuGetProcAddress");
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuStreamCreate)(CUstream *, unsigned);
  if (get("cuInit", (void **)&cuInit, 2000, 0) ||
      get("cuDevicePrimaryCtxRetain", (void **)&cuDevicePrimaryCtxRetain, 7000, 0) ||
      get("cuCtxSetCurrent", (void **)&cuCtxSetCurrent, 4000, 0) ||
      get("cuStreamCreate", (void **)&cuStreamCreate, 2000, 0) ||
      get("cuStreamIsCapturing", (void **)&cuStreamIsCapturing, 10000, 0) ||
      get("cuStreamGetId", (void **)&cuStreamGetId, 12000, 0) ||
      get("cuCtxGetCurrent", (void **)&cuCtxGetCurrent, 4000, 0))
    return fprintf(stderr, "capi_pair: driver entry points missing\n"), 2;
  cuvmm_malloc = need(lib, "cuvmm_malloc");
  cuvmm_free = need(lib, "cuvmm_free");
  cuvmm_last_error = need(lib, "cuvmm_last_error");

  CUcontext ctx;
  CUstream created;
  if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx) || cuStreamCreate(&created, 1))
    return fprintf(stderr, "capi_pair: no device 0 or no stream\n"), 2;

  static const struct { const char *name; ssize_t bytes; } sizes[] = {
      {"4KiB", 4 << 10}, {"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"16MiB", 16 << 20}};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    if (measure("cuvmm_malloc+cuvmm_free legacy-stream", sizes[i].name, capi_pair, NULL, sizes[i].bytes) ||
        measure("cuvmm_malloc+cuvmm_free created-stream", sizes[i].name, capi_pair, created, sizes[i].bytes))
      return 1;
  }
  if (measure("cuStreamIsCapturing+cuStreamGetId", "-", stream_calls, created, 0) ||
      measure("cuCtxGetCurrent", "-", current_context, created, 0))
    return 1;
  return 0;
}
