#!/usr/bin/env python3
"""How fast page-locking a pageable buffer for one copy can be: register, copy, unregister.

    python3 tools/register_copy_probe.py

Needs the NVIDIA driver (libcuda.so.1) and numpy; no build. Prints the pinned copy bound for
1 GiB, then for 64 MiB, 256 MiB and 1 GiB of touched pageable memory: cuMemHostRegister +
cuMemHostUnregister on one thread and split over 4, 8 and 16 threads; register + copy to the
device + unregister on one thread; and the driver's own pageable copy. Medians of 5, host clock.
It bounds what the staged pageable path could gain by registering the caller's buffer instead
of copying it through pinned staging buffers (see docs/DECISIONS.md).
"""
import ctypes, time, threading, numpy as np, statistics as st
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what} -> {r}")
ck(cu.cuInit(0), "init")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
ck(cu.cuCtxSetCurrent(ctx), "set")
N = 1 << 30
d = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(N)), "alloc")
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
# pinned bound
hp = ctypes.c_void_p(); ck(cu.cuMemHostAlloc(ctypes.byref(hp), N, 0), "hostalloc")
ctypes.memset(hp, 1, N)
def t(f, reps=5):
    v = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); v.append(time.perf_counter() - t0)
    return st.median(v)
pin_h2d = t(lambda: ck(cu.cuMemcpyHtoD_v2(d.value, hp, N), "h2d"))
pin_d2h = t(lambda: ck(cu.cuMemcpyDtoH_v2(hp, d.value, N), "d2h"))
print(f"pinned 1GiB H2D {N/pin_h2d/1e9:.1f} GB/s  D2H {N/pin_d2h/1e9:.1f} GB/s")
for size in (64 << 20, 256 << 20, 1 << 30):
    a = np.empty(size, dtype=np.uint8); a[:] = np.random.randint(1, 255, size=4096, dtype=np.uint8).repeat(size // 4096)
    p = a.ctypes.data
    def reg_whole():
        ck(cu.cuMemHostRegister_v2(p, size, 0), "reg"); ck(cu.cuMemHostUnregister(p), "unreg")
    r = t(reg_whole)
    # register, copy, unregister (1 thread)
    def rcu():
        ck(cu.cuMemHostRegister_v2(p, size, 0), "reg"); ck(cu.cuMemcpyHtoD_v2(d.value, p, size), "h2d"); ck(cu.cuMemHostUnregister(p), "unreg")
    x = t(rcu)
    plain = t(lambda: ck(cu.cuMemcpyHtoD_v2(d.value, p, size), "h2d pageable"))
    print(f"{size>>20} MiB: register+unregister {size/r/1e9:.1f} GB/s; register+H2D+unregister {size/x/1e9:.1f} GB/s; pageable H2D {size/plain/1e9:.1f} GB/s")
    for threads in (4, 8, 16):
        chunk = size // threads
        def par():
            def w(i):
                q = p + i * chunk
                ck(cu.cuCtxSetCurrent(ctx), "set")
                ck(cu.cuMemHostRegister_v2(q, chunk, 0), "reg")
                ck(cu.cuMemHostUnregister(q), "unreg")
            ts = [threading.Thread(target=w, args=(i,)) for i in range(threads)]
            [z.start() for z in ts]; [z.join() for z in ts]
        y = t(par)
        print(f"   {threads} threads register+unregister {size/y/1e9:.1f} GB/s")
