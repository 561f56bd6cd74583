#!/usr/bin/env python3
"""What the driver charges a receiving process for 64 buffers of 256 MiB made by another one,
opened in a fresh process each way, the order alternating, medians of --reps runs (ms):

    python3 import_floor.py [WAYS] [REPS]      # WAYS: comma-separated, all by default

legacy : cuIpcOpenMemHandle of each of 64 cuMemAlloc buffers (what PyTorch's CUDA IPC opens)
torch  : pickle.loads of the ForkingPickler pickle of 64 tensors under PyTorch's allocator, then a
         kernel reading each (its kernels loaded before)
torchcold: the same, the kernels' module loaded by that first read (CUDA's lazy loading)
v128   : per buffer a reservation, two 128 MiB allocations imported and mapped, one access grant
         (what a receiver maps of a block on cuvmm's default pages)
v128one: one reservation for all 128 allocations and one access grant
v128pg : an access grant per allocation
v256   : one 256 MiB allocation per buffer (a whole block, export_threshold)
v128t4 : v128 over four threads at once
v512s  : 32 allocations of 512 MiB, each imported once; per buffer a reservation and two 128 MiB
         pieces of one allocation mapped at their offsets, one access grant (pages carved from
         larger physical allocations). Not in the default list: the driver refuses a map of part of
         an allocation (CUDA_ERROR_NOT_SUPPORTED, driver 580), whatever the offset
v512w  : 32 allocations of 512 MiB, each imported once and mapped whole (512 MiB pages)
Each way but torch then writes a byte of each buffer (cuMemsetD8) and synchronises ("touch").
The sender's export of each allocation is timed once (median, and the process's first).
"""
import ctypes as C
import io
import json
import pickle
import socket
import statistics
import subprocess
import sys
import threading
import time

from _common import (CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOCATION_TYPE_PINNED,
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_LOCATION_TYPE_DEVICE, CuAccessDesc,
                     CuAllocProp, CuLocation, cu_check)

N = 64
SZ = 256 << 20
cu = C.CDLL("libcuda.so.1")


def ck(r, what):
    cu_check(cu, r, what)


class IpcH(C.Structure):  # CUipcMemHandle, passed by value
    _fields_ = [("r", C.c_char * 64)]


def ctx():
    ck(cu.cuInit(0), "init")
    dev = C.c_int()
    ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
    c = C.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(C.byref(c), dev), "retain")
    ck(cu.cuCtxSetCurrent(c), "set")


def prop():
    return CuAllocProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                       requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                       location=CuLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0))


EXP = []


def create(size):
    h = C.c_uint64()
    ck(cu.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(prop()), C.c_uint64(0)), "create")
    fd = C.c_int()
    t0 = time.perf_counter()
    ck(cu.cuMemExportToShareableHandle(C.byref(fd), h, 1, C.c_uint64(0)), "export")
    EXP.append(time.perf_counter() - t0)
    return h.value, fd.value


def reserve(size, align):
    p = C.c_uint64()
    ck(cu.cuMemAddressReserve(C.byref(p), C.c_size_t(size), C.c_size_t(align), C.c_uint64(0), C.c_uint64(0)), "reserve")
    return p.value


def imp(fd):
    h = C.c_uint64()
    ck(cu.cuMemImportFromShareableHandle(C.byref(h), C.c_void_p(fd), 1), "import")
    return h.value


def mmap(va, size, h, offset=0):
    ck(cu.cuMemMap(C.c_uint64(va), C.c_size_t(size), C.c_size_t(offset), C.c_uint64(h), C.c_uint64(0)), "map")


def access(va, size):
    a = CuAccessDesc(CuLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    ck(cu.cuMemSetAccess(C.c_uint64(va), C.c_size_t(size), C.byref(a), C.c_size_t(1)), "access")


class T:
    def __init__(self):
        self.t = {}

    def add(self, k, dt):
        self.t[k] = self.t.get(k, 0.0) + dt


def open_vmm(fds, page, mode, tm):
    per = SZ // page
    if mode == "one":
        t0 = time.perf_counter()
        va = reserve(N * SZ, page)
        tm.add("reserve", time.perf_counter() - t0)
        for i, fd in enumerate(fds):
            t0 = time.perf_counter()
            h = imp(fd)
            t1 = time.perf_counter()
            mmap(va + i * page, page, h)
            t2 = time.perf_counter()
            tm.add("import", t1 - t0)
            tm.add("map", t2 - t1)
        t0 = time.perf_counter()
        access(va, N * SZ)
        tm.add("access", time.perf_counter() - t0)
        return [va + k * SZ for k in range(N)]
    bases = []
    for k in range(len(fds) // per):
        t0 = time.perf_counter()
        va = reserve(SZ, page)
        bases.append(va)
        tm.add("reserve", time.perf_counter() - t0)
        for j in range(per):
            t0 = time.perf_counter()
            h = imp(fds[k * per + j])
            t1 = time.perf_counter()
            mmap(va + j * page, page, h)
            t2 = time.perf_counter()
            tm.add("import", t1 - t0)
            tm.add("map", t2 - t1)
            if mode == "pg":
                access(va + j * page, page)
                tm.add("access", time.perf_counter() - t2)
        if mode != "pg":
            t0 = time.perf_counter()
            access(va, SZ)
            tm.add("access", time.perf_counter() - t0)
    return bases


def open_slabs(fds, whole, tm):
    bases = []
    piece = SZ // 2
    for fd in fds:
        t0 = time.perf_counter()
        h = imp(fd)
        tm.add("import", time.perf_counter() - t0)
        for k in range(1 if whole else 2):
            span = 2 * SZ if whole else SZ
            t0 = time.perf_counter()
            va = reserve(span, piece)
            t1 = time.perf_counter()
            if whole:
                mmap(va, span, h)
            else:
                for j in range(2):
                    mmap(va + j * piece, piece, h, (2 * k + j) * piece)
            t2 = time.perf_counter()
            access(va, span)
            tm.add("reserve", t1 - t0)
            tm.add("map", t2 - t1)
            tm.add("access", time.perf_counter() - t2)
            bases += [va, va + SZ] if whole else [va]
    return bases


def touch(bases, tm):
    t0 = time.perf_counter()
    for b in bases:
        ck(cu.cuMemsetD8_v2(C.c_uint64(b + SZ - 1), C.c_ubyte(7), C.c_size_t(1)), "memset")
    ck(cu.cuCtxSynchronize(), "sync")
    tm.add("touch", time.perf_counter() - t0)


def recv_all(sock):
    buf = io.BytesIO()
    while True:
        b = sock.recv(1 << 20)
        if not b:
            return buf.getvalue()
        buf.write(b)


def child(variant, sockfd):
    sock = socket.socket(fileno=sockfd)
    tm = T()
    if variant in ("torch", "torchcold"):
        import torch
        # The kernels the timed read runs (uint8 stack and sum), loaded before; "torchcold" loads
        # float32 ones only, so its timed read loads the module the first kernel needs.
        x = torch.ones(1024, dtype=torch.float32 if variant == "torchcold" else torch.uint8, device="cuda")
        torch.stack([x[-1 - k] for k in range(N)]).sum().item()
        data = recv_all(sock)
        t0 = time.perf_counter()
        ts = pickle.loads(data)
        t1 = time.perf_counter()
        torch.stack([t[-1] for t in ts]).sum().item()
        t2 = time.perf_counter()
        tm.add("loads", t1 - t0)
        tm.add("kernel", t2 - t1)
        tm.add("total", t2 - t0)
        print(json.dumps(tm.t))
        return
    ctx()
    if variant == "legacy":
        data = recv_all(sock)
        t0 = time.perf_counter()
        first = None
        bases = []
        for i in range(N):
            p = C.c_uint64()
            h = IpcH.from_buffer_copy(data[i * 64:(i + 1) * 64])
            ts = time.perf_counter()
            ck(cu.cuIpcOpenMemHandle_v2(C.byref(p), h, C.c_uint(1)), "ipcopen")
            bases.append(p.value)
            if first is None:
                first = time.perf_counter() - ts
        tm.add("total", time.perf_counter() - t0)
        tm.add("first", first)
        touch(bases, tm)
        print(json.dumps(tm.t))
        return
    fds = []
    while len(fds) < variant_pages(variant):
        msg, got, _, _ = socket.recv_fds(sock, 16, 250)
        fds += got
    page = (256 if variant == "v256" else 128) << 20
    t0 = time.perf_counter()
    if variant == "v128t4":
        per = len(fds) // 4
        ths = [threading.Thread(target=open_vmm, args=(fds[i * per:(i + 1) * per], page, "tensor", T())) for i in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    elif variant in ("v512s", "v512w"):
        bases = open_slabs(fds, variant == "v512w", tm)
        tm.add("opened", time.perf_counter() - t0)
        touch(bases, tm)
    else:
        mode = {"v128": "tensor", "v256": "tensor", "v128one": "one", "v128pg": "pg"}[variant]
        bases = open_vmm(fds, page, mode, tm)
        tm.add("opened", time.perf_counter() - t0)
        touch(bases, tm)
    tm.add("total", time.perf_counter() - t0)
    print(json.dumps(tm.t))


def variant_pages(v):
    return {"v256": 64, "v512s": 32, "v512w": 32}.get(v, 128)


def main():
    import torch
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing  # noqa: F401  (installs reductions)
    torch.empty(1, device="cuda")
    # legacy allocations
    legacy = []
    handles = b""
    for _ in range(N):
        p = C.c_uint64()
        ck(cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(SZ)), "alloc")
        h = IpcH()
        ck(cu.cuIpcGetMemHandle(C.byref(h), p), "ipcget")
        handles += bytes(h)
        legacy.append(p.value)
    v128 = [create(128 << 20)[1] for _ in range(2 * N)]
    v256 = [create(256 << 20)[1] for _ in range(N)]
    v512 = [create(512 << 20)[1] for _ in range(N // 2)]
    print("export us median", round(statistics.median(EXP) * 1e6, 1), "first", round(EXP[0] * 1e6, 1), "sum ms", round(sum(EXP) * 1e3, 2))
    tensors = [torch.full((SZ,), k, dtype=torch.uint8, device="cuda") for k in range(N)]
    torch.cuda.synchronize()
    variants = sys.argv[1].split(",") if len(sys.argv) > 1 else ["legacy", "torch", "torchcold", "v128", "v128one", "v128pg", "v256", "v128t4", "v512w"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    res = {v: [] for v in variants}
    for r in range(reps):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            a, b = socket.socketpair()
            p = subprocess.Popen([sys.executable, __file__, "--child", v, str(b.fileno())], pass_fds=[b.fileno()],
                                 stdout=subprocess.PIPE)
            b.close()
            if v == "legacy":
                a.sendall(handles)
            elif v in ("torch", "torchcold"):
                buf = io.BytesIO()
                t0 = time.perf_counter()
                ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(tensors)
                res.setdefault("torch_dumps", []).append(time.perf_counter() - t0)
                a.sendall(buf.getvalue())
            else:
                fds = {"v256": v256, "v512s": v512, "v512w": v512}.get(v, v128)
                for i in range(0, len(fds), 250):
                    socket.send_fds(a, [b"x"], fds[i:i + 250])
            a.shutdown(socket.SHUT_WR)
            out, _ = p.communicate(timeout=300)
            a.close()
            res[v].append(json.loads(out.decode().strip().splitlines()[-1]))
    for v in variants:
        keys = res[v][0].keys()
        print(v, {k: round(statistics.median([x[k] for x in res[v]]) * 1e3, 2) for k in keys}, "ms")
    if "torch_dumps" in res:
        print("torch dumps", [round(x * 1e3, 2) for x in res["torch_dumps"]], "ms")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
