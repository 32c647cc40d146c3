"""The `--nccl` part of scripts/gpu_check.py: kiln's NCCL layer on one real GPU.

One GPU means one rank: NCCL refuses two ranks of a communicator on one device, so
nothing here measures bandwidth between GPUs (multi-GPU numbers cannot be measured on
this machine; none are reported). What one H200 can check for real:

1. the library: which libnccl loaded, its version, every symbol kiln calls (K251 names
   what is missing);
2. a single-rank nonblocking communicator (ncclCommInitRankConfig, blocking=0, polled):
   init time, all_reduce on device memory (sum/avg/max, float32/bfloat16) against the
   input, enqueue+completion latency by size;
3. the fault-tolerance calls on that communicator: ncclCommSplit, ncclCommRevoke then
   ncclCommShrink(NCCL_SHRINK_ABORT), ncclCommGetUniqueId (the grow id), each followed
   by an all_reduce on the new communicator; ncclCommGrow needs a second GPU (reported);
4. one-sided: ncclCommWindowRegister, ncclPutSignal to this rank's own window,
   ncclWaitSignal, the data checked;
5. kiln's stack: init_process_group("nccl", world_size=1) over cudaMallocManaged memory
   viewed as numpy (all_reduce, broadcast, all_gather, split).

libnccl: torch's wheels bring nvidia-nccl-cu12, often older than 2.29 (no ncclCommGrow,
no put/signal). Then this part reports "not run" with how to bring a newer one:
KILN_NCCL_LIBRARY=/path/to/libnccl.so.2, or KILN_NCCL_WHEELS=DIR holding an
nvidia-nccl-cu12/-cu13 >= 2.29 wheel, which is unpacked (not installed: torch keeps its
own) and its libnccl.so.2 used.
"""

from __future__ import annotations

import glob
import os
import secrets
import tempfile
import time
import zipfile

import numpy as np

SIZES = [(4 << 10, "4 KiB"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB")]


def _wheel_library() -> str | None:
    """libnccl.so.2 from a wheel in KILN_NCCL_WHEELS (unpacked to a temp folder)."""
    folder = os.environ.get("KILN_NCCL_WHEELS")
    wheels = sorted(glob.glob(os.path.join(folder, "nvidia_nccl_cu1*.whl"))) if folder else []
    if not wheels:
        return None
    out = tempfile.mkdtemp(prefix="kiln-nccl-")
    with zipfile.ZipFile(wheels[-1]) as zf:
        names = [n for n in zf.namelist() if n.endswith("lib/libnccl.so.2")]
        if not names:
            return None
        zf.extract(names[0], out)
        return os.path.join(out, names[0])


def wheels_hint() -> str:
    return ("kiln needs libnccl >= 2.29. On a machine with network access: `pip download "
            "--no-deps --only-binary=:all: --python-version 3.12 --platform "
            "manylinux_2_28_x86_64 -d shared/wheels/nccl 'nvidia-nccl-cu12>=2.29'` (~300 MB: "
            "more than the device tool's 64 MiB carry, so it travels in shared/), then run with "
            "KILN_NCCL_WHEELS=shared/wheels/nccl")


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def run(torch, report, table, quick: bool) -> None:
    from kiln.distributed import nccl_api as api
    from kiln.distributed.errors import NcclUnavailable
    from kiln.distributed.nccl_comm import NcclComm
    from kiln.distributed.nccl_lib import LibNccl, library_candidates

    if not os.environ.get("KILN_NCCL_LIBRARY"):
        lib = _wheel_library()
        if lib:
            os.environ["KILN_NCCL_LIBRARY"] = lib
    try:
        nccl = LibNccl()
    except NcclUnavailable as exc:
        report.add("NCCL library", "**not run**: %s\n\n%s" % (exc.message, wheels_hint()))
        return
    version = nccl.get_version()
    missing = [s for s in api.REQUIRED_SYMBOLS if not hasattr(nccl.lib, s)]
    report.add("NCCL library", table(["library", "version", "symbols kiln calls", "missing"], [[
        getattr(nccl.lib, "_name", library_candidates()[0]), api.version_text(version),
        len(api.REQUIRED_SYMBOLS), ", ".join(missing) or "none"]]))
    torch.cuda.set_device(0)
    stream = torch.cuda.current_stream().cuda_stream
    rows, timing = [], []

    def check(name, fn):
        try:
            rows.append([name, fn()])
        except Exception as exc:  # noqa: BLE001 - one row failing must not hide the rest
            rows.append([name, "FAILED: %s: %s" % (type(exc).__name__, exc)])

    t0 = time.perf_counter()
    _, uid = nccl.get_unique_id()
    comm = NcclComm.init(nccl, 1, uid, 0, timeout=60.0)
    init_ms = (time.perf_counter() - t0) * 1e3
    rows.append(["ncclCommInitRankConfig (nonblocking, 1 rank)", "ok, %.1f ms" % init_ms])

    def all_reduce_on(c, dtype=torch.float32, op="sum", n=1 << 16):
        x = torch.randn(n, device="cuda").to(dtype)
        want = x.clone()
        npdt = np.dtype(np.float32) if dtype == torch.float32 else _bf16()
        c.all_reduce(x.data_ptr(), x.data_ptr(), n, npdt, op, stream).wait(timeout=30)
        torch.cuda.synchronize()
        ok = torch.equal(x, want)  # one rank: every reduction is the identity
        return "ok" if ok else "WRONG: max diff %g" % float((x.float() - want.float()).abs().max())

    for dtype in (torch.float32, torch.bfloat16):
        for op in ("sum", "avg", "max"):
            check("all_reduce %s %s" % (str(dtype).split(".")[-1], op),
                  lambda d=dtype, o=op: all_reduce_on(comm, d, o))
    for nbytes, label in SIZES[:2] if quick else SIZES:
        x = torch.ones(nbytes // 4, device="cuda")
        ms = _median_ms(lambda: comm.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(),
                                                np.float32, "sum", stream).wait(timeout=30),
                        10 if quick else 50)
        timing.append([label, "%.3f" % ms])

    def split():
        sub = comm.split(0, 0, rank=0, size=1)
        res = all_reduce_on(sub)
        sub.free()
        return "ncclCommSplit: " + res

    def revoke_shrink():
        victim = NcclComm.init(nccl, 1, nccl.get_unique_id()[1], 0, timeout=60.0)
        victim.revoke()
        small = victim.shrink([], abort_pending=True)
        res = all_reduce_on(small)
        grow_id = small.grow_id()
        small.free()
        victim.free()
        return "revoke + ncclCommShrink(ABORT): %s; grow id %d bytes" % (res, len(grow_id))

    check("split (color 0)", split)
    check("revoke, shrink in abort mode, grow id", revoke_shrink)
    rows.append(["ncclCommGrow", "not run: a joiner needs a second GPU (NCCL refuses two "
                                 "ranks of one communicator on one device)"])
    check("window: ncclCommWindowRegister + ncclPutSignal to self + ncclWaitSignal",
          lambda: _window_self(torch, comm, stream))
    check("kiln ProcessGroup on nccl (1 rank, managed memory)", lambda: _process_group(nccl))
    comm.free()
    report.add("NCCL on one GPU", table(["check", "result"], rows))
    report.add("NCCL all_reduce latency, 1 rank (enqueue + event completion, median)",
               table(["size", "ms"], timing) + "\n\nOne rank moves no data between GPUs: this "
               "is the call and completion overhead kiln adds around NCCL, not a bandwidth.")


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _window_self(torch, comm, stream) -> str:
    n = 1 << 12
    target = torch.zeros(n, device="cuda")
    src = torch.arange(n, device="cuda", dtype=torch.float32)
    win = comm.register_window(target.data_ptr(), target.numel() * 4)
    try:
        comm.put_signal(src.data_ptr(), n * 4, 0, win, 0, stream).wait(timeout=30)
        comm.wait_signal({0: 1}, stream).wait(timeout=30)
        torch.cuda.synchronize()
        return "ok" if torch.equal(target, src) else "WRONG data after the put"
    finally:
        comm.deregister_window(win)


def _process_group(nccl) -> str:
    """init_process_group("nccl") with world_size 1 over cudaMallocManaged numpy views."""
    import ctypes

    from cuda.bindings import runtime as rt

    import kiln.distributed as dist
    from kiln.distributed.nccl_groups import set_nccl_api
    from kiln.distributed.store import StoreServer

    def managed(n):
        err, ptr = rt.cudaMallocManaged(n * 4, rt.cudaMemAttachGlobal)
        if int(err) != 0:
            raise RuntimeError("cudaMallocManaged: %s" % err)
        raw = (ctypes.c_float * n).from_address(int(ptr))
        return np.frombuffer(raw, np.float32), int(ptr)

    set_nccl_api(nccl)
    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token)
    ptrs = []
    try:
        pg = dist.init_process_group("nccl", rank=0, world_size=1, store=server.address,
                                     token=token, timeout=60.0, host_store=False)
        x, p = managed(1024)
        ptrs.append(p)
        x[:] = np.arange(1024)
        pg.all_reduce(x).wait()
        rt.cudaDeviceSynchronize()
        out, p = managed(1024)
        ptrs.append(p)
        pg.all_gather(out, x).wait()
        pg.broadcast(x, src=0).wait()
        sub = pg.split(color=0)
        sub.all_reduce(x, op="max").wait()
        rt.cudaDeviceSynchronize()
        ok = np.array_equal(x, np.arange(1024)) and np.array_equal(out, x)
        return "ok (all_reduce, all_gather, broadcast, split)" if ok else "WRONG results"
    finally:
        dist.destroy_process_group()
        server.close()
        for p in ptrs:
            rt.cudaFree(p)
