"""CUDA symmetric memory on a real GPU: two processes on one GPU (the IPC path works
between processes, and one H200 is what there is), bounded in time.

Each process joins a 2-rank tcp group, allocates `symmetric_memory((n,), "float32",
pg, device="cuda:0")` (cuMemAlloc, cuIpcGetMemHandle, handles through the store,
cuIpcOpenMemHandle), then: writes its buffer and reads the peer's through its mapping
(checked), a signal/wait ping-pong (median round trip), a device copy from the peer's
mapped buffer into its own (cuMemcpyDtoD, GB/s), `torch.from_dlpack(sym.peer(1))` on
the same address when torch is there, and close(). The parent prints what they measured.

    python scripts/gpu_check_symmetric.py                 # alone
    python scripts/gpu_check.py --nccl                    # as a section of the NCCL part
    python scripts/gpu_check_symmetric.py --fake DIR      # the script's logic on a CPU
                                                          # machine, over the test suite's
                                                          # fake driver (no numbers)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELEMENTS = 16 << 20  # 64 MiB of float32 per rank
ROUND_TRIPS = 200
LIMIT_S = 120.0  # the whole pair, setup included


def worker(rank: int, address: str, token: str, out: str, fake: str | None, elements: int) -> None:
    """One of the two ranks (a subprocess of `measure`)."""
    sys.path.insert(0, ROOT)
    import kiln.distributed as dist

    driver = None
    if fake:
        from tests.runtime.fake_cuda_memory import FakeMemoryDriver

        driver = FakeMemoryDriver(fake)
        driver.cuMemcpyDtoD = lambda dst, src, n: driver._copy("cuMemcpyDtoD", dst, src, n)
    result: dict = {"rank": rank}
    pg = dist.init_process_group("tcp", rank=rank, world_size=2, store=address, token=token,
                                 timeout=30.0, host_store=False)  # a failed peer: 30 s at most
    try:
        t0 = time.perf_counter()
        sym = dist.symmetric_memory((elements,), "float32", pg, device="cuda:0", driver=driver)
        result["setup_ms"] = (time.perf_counter() - t0) * 1e3
        drv, peer = sym.driver, 1 - rank
        mine = np.arange(elements, dtype=np.float32) * (rank + 1)
        sym.buffer.copy_from(mine)
        sym.barrier()
        theirs = sym.peer(peer).numpy()
        result["peer_read"] = bool(np.array_equal(theirs, np.arange(elements, dtype=np.float32)
                                                  * (peer + 1)))
        sym.barrier()
        times = []
        for _ in range(ROUND_TRIPS):
            t0 = time.perf_counter()
            if rank == 0:
                sym.signal(1)
                sym.wait_signal(1)
            else:
                sym.wait_signal(0)
                sym.signal(0)
            times.append(time.perf_counter() - t0)
        result["round_trip_us"] = float(np.median(times) * 1e6)
        sym.barrier()
        nbytes = sym.buffer.nbytes
        for turn in range(2):  # one copier at a time: the other's buffer stays still
            if rank == turn:
                reps = 10
                t0 = time.perf_counter()
                for _ in range(reps):  # the peer's buffer, through the IPC mapping, into ours
                    status = drv.cuMemcpyDtoD(sym.buffer.address, sym.peer(peer).address, nbytes)
                    status = status[0] if isinstance(status, tuple) else status
                    if status != drv.CUresult.CUDA_SUCCESS:
                        raise RuntimeError("cuMemcpyDtoD: %s" % status)
                drv.cuCtxSynchronize()
                result["copy_gb_s"] = nbytes * reps / (time.perf_counter() - t0) / 1e9
                result["copied"] = bool(np.array_equal(sym.buffer.numpy(),
                                                       sym.peer(peer).numpy()))
            sym.barrier()
        if not fake:
            result["dlpack"] = _torch_view(sym, peer, sym.peer(peer).numpy())
        sym.barrier()
        sym.close()
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        result.update(ok=False, error="%s: %s" % (type(exc).__name__, exc))
    finally:
        with open(out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _torch_view(sym, peer: int, want: np.ndarray) -> str:
    try:
        import torch
    except ImportError:
        return "not run: no torch"
    view = torch.from_dlpack(sym.peer(peer))
    same = view.data_ptr() == sym.peer(peer).address
    ok = same and bool(torch.equal(view.cpu(), torch.from_numpy(want)))
    del view
    return "ok (same address, same values)" if ok else "WRONG (same address: %s)" % same


def measure(fake: str | None = None, elements: int = ELEMENTS) -> list[dict]:
    """Run the two ranks; their results (bounded by LIMIT_S)."""
    sys.path.insert(0, ROOT)
    from kiln.distributed.store import StoreServer

    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token)
    folder = tempfile.mkdtemp(prefix="kiln-sym-check-")
    outs = [os.path.join(folder, "rank%d.json" % r) for r in range(2)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    try:
        for rank in range(2):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(rank),
                   server.address, token, outs[rank], "--elements", str(elements)]
            procs.append(subprocess.Popen(cmd + (["--fake", fake] if fake else []), env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + LIMIT_S
        logs = []
        for proc in procs:
            try:
                logs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            except subprocess.TimeoutExpired:
                logs.append(b"still running after %.0f s: killed" % LIMIT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
    results = []
    for rank, out in enumerate(outs):
        if os.path.exists(out):
            with open(out) as f:
                results.append(json.load(f))
        else:
            results.append({"rank": rank, "ok": False,
                            "error": logs[rank].decode(errors="replace")[-1500:]})
    shutil.rmtree(folder, ignore_errors=True)
    return results


def rows(results: list[dict]) -> list[list]:
    """One table row per rank."""
    out = []
    for r in results:
        if not r.get("ok"):
            out.append([r["rank"], "FAILED: %s" % r.get("error", "?"), "", "", "", "", ""])
            continue
        out.append([r["rank"], "%.1f" % r["setup_ms"],
                    "ok" if r["peer_read"] else "WRONG", "%.1f" % r["round_trip_us"],
                    "%.1f" % r["copy_gb_s"], "ok" if r["copied"] else "WRONG",
                    r.get("dlpack", "not run")])
    return out


HEADER = ["rank", "setup ms", "peer read", "signal round trip µs (median of %d)" % ROUND_TRIPS,
          "peer→own DtoD GB/s", "copy checked", "torch.from_dlpack(peer)"]


def run(report, table) -> None:
    """gpu_check.py's section."""
    results = measure()
    report.add("CUDA symmetric memory, 2 processes on one GPU (IPC handles through the store)",
               table(HEADER, rows(results)) + "\n\nOne GPU: the peer copy is within one "
               "device's memory, not NVLink between GPUs (none here).")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=4, metavar=("RANK", "STORE", "TOKEN", "OUT"))
    parser.add_argument("--fake", help="use the test suite's fake CUDA driver, device memory "
                                       "as files in this folder (no GPU; checks the logic only)")
    parser.add_argument("--elements", type=int, default=ELEMENTS)
    args = parser.parse_args(argv)
    if args.worker:
        rank, address, token, out = args.worker
        worker(int(rank), address, token, out, args.fake, args.elements)
        return 0
    results = measure(args.fake, args.elements)
    print("| " + " | ".join(HEADER) + " |")
    for row in rows(results):
        print("| " + " | ".join(str(c) for c in row) + " |")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
