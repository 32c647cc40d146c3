"""The batched small-matrix CPU kernels (kiln/codegen/cpu/linalg_*.py) against
numpy.linalg (LAPACK per matrix) on 4096 matrices of 8x8, 16x16 and 32x32 (and 64x64),
float32 and float64: cholesky, qr, eigh, svd (issue 15's benchmark; target >= 5x faster
than numpy).

    .venv/bin/python benchmarks/bench_linalg.py [--quick] [--cpu-time] [--batch 4096] [--out benchmarks/results/linalg.md]

The kernels are called directly (kiln.codegen.cpu.linalg_native, after one warm-up call
that compiles them), so the rows show the kernels whatever the routing rule decides;
the last column is the path kn.linalg takes for that operand (linalg_route.path). numpy
runs with OpenBLAS limited to one thread, as kiln's own pool holds the machine's cores
(kiln uses kn.get_num_threads() threads). numpy and kiln alternate in rounds so load
drift on the shared machine hits both alike; ratios are numpy / kiln from the same run.

--cpu-time: both on ONE thread, timed by the process's CPU time (time.process_time)
instead of the wall clock: on a machine shared with other jobs this measures the work
each side does, undisturbed by time spent waiting for a core (its own results section).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, timings, write_section  # noqa: E402

from kiln.codegen.cpu import linalg_native, linalg_route  # noqa: E402
from kiln.runtime.threads import blas_single_thread, get_num_threads  # noqa: E402


def _operands(batch: int, n: int, dtype, rng):
    a = rng.standard_normal((batch, n, n)).astype(dtype)
    spd = (a @ a.transpose(0, 2, 1) + n * np.eye(n)).astype(dtype)
    return a, spd


CASES = {
    "cholesky": (linalg_native.cholesky, np.linalg.cholesky, "spd"),
    "qr": (linalg_native.qr, np.linalg.qr, "a"),
    "eigh": (linalg_native.eigh, np.linalg.eigh, "spd"),
    "svd": (linalg_native.svd, lambda x: np.linalg.svd(x, full_matrices=False), "a"),
}


# beyond the issue's sizes: all four at 64 x 64 (the kernels' limit), so the routing
# rule rests on a measurement there too
EXTRA = {64: ("cholesky", "qr", "eigh", "svd")}


def cpu_timings(fn, repeat: int, warmup: int = 1) -> tuple[float, float]:
    """(median, minimum) process CPU time of `fn()` over `repeat` runs after `warmup`."""
    return timings(fn, repeat, warmup, clock=time.process_time)


def _fresh_copy(x: np.ndarray) -> np.ndarray:
    """The floor of any batched op on x: its bytes read once into a fresh array (whose
    pages fault in, as every op's output's do)."""
    out = np.empty_like(x)
    np.copyto(out, x)
    return out


def run(batch: int, sizes, rounds: int, repeat: int, timings=timings) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n in list(sizes) + sorted(EXTRA):
        for dtype in (np.float32, np.float64):
            a, spd = _operands(batch, n, dtype, rng)
            floor = timings(lambda: _fresh_copy(a), repeat)[0]
            for op, (mine, ref, which) in CASES.items():
                if n in EXTRA and n not in sizes and op not in EXTRA[n]:
                    continue
                x = spd if which == "spd" else a
                mine(x)  # compile (both kernels) outside the timing
                k_med, k_min, n_med, n_min = [], [], [], []
                for _ in range(rounds):
                    med, low = timings(lambda: mine(x), repeat)
                    k_med.append(med), k_min.append(low)
                    with blas_single_thread():
                        med, low = timings(lambda: ref(x), repeat)
                    n_med.append(med), n_min.append(low)
                km, nm = float(np.median(k_med)), float(np.median(n_med))
                rows.append(dict(op=op, n=n, dtype=np.dtype(dtype).name, kiln=km, kiln_min=min(k_min),
                                 numpy=nm, numpy_min=min(n_min), ratio=nm / km, floor=floor,
                                 path=linalg_route.path(op, x.shape, dtype)))
                print(f"{op:8s} {n:3d} {np.dtype(dtype).name:8s} kiln {km * 1e3:8.2f} ms  numpy {nm * 1e3:8.2f} ms"
                      f"  {nm / km:5.2f}x  -> {rows[-1]['path']}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--out", default=None, help="write the table into this markdown file")
    p.add_argument("--cpu-time", action="store_true", help="one thread each, CPU time (see the docstring)")
    args = p.parse_args()
    rounds, repeat = (1, 3) if args.quick else (3, 5)
    load = os.getloadavg()
    if args.cpu_time:
        import kiln as kn
        from kiln.runtime.threads import set_blas_num_threads

        kn.set_num_threads(1)
        set_blas_num_threads(1)
    rows = run(args.batch, (8, 16, 32), rounds, repeat, cpu_timings if args.cpu_time else timings)
    if args.out:
        lines = [
            "## Batched small-matrix linear algebra (benchmarks/bench_linalg.py"
            + (", one thread each, CPU time)" if args.cpu_time else ", wall clock)"), "",
            f"Command: `.venv/bin/python benchmarks/bench_linalg.py{' --quick' if args.quick else ''}"
            f"{' --cpu-time' if args.cpu_time else ''} "
            f"--batch {args.batch} --out {args.out}`  ",
            f"Machine: {cpu_model()}, {os.cpu_count()} CPUs (kiln threads: {get_num_threads()}; "
            f"SIMD lanes {linalg_native.simd_bits()} bits)  ",
            f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load average at start "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the machine is shared by ~8 agents)  ",
            f"Batch: {args.batch} matrices per call; {rounds} alternating rounds x {repeat} runs; medians "
            "of round medians, minimums over all runs; ratio = numpy median / kiln median (same run). "
            "numpy with OpenBLAS on one thread. The last column is the path kn.linalg takes for "
            "that operand by the rule (kiln/codegen/cpu/linalg_route.py), set from these measurements. "
            "`copy floor`: the median time to copy the batch into a fresh array (its bytes read once, "
            "an output's pages faulted in), which no op on it can beat.", "",
            "| op | n | dtype | kiln median ms | kiln min ms | numpy median ms | numpy min ms | numpy / kiln "
            "| copy floor ms | kn.linalg path |",
            "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['op']} | {r['n']} | {r['dtype']} | {r['kiln'] * 1e3:.2f} | {r['kiln_min'] * 1e3:.2f} "
                         f"| {r['numpy'] * 1e3:.2f} | {r['numpy_min'] * 1e3:.2f} | {r['ratio']:.2f}x "
                         f"| {r['floor'] * 1e3:.2f} | {r['path']} |")
        write_section(args.out, "bench_linalg_cpu" if args.cpu_time else "bench_linalg", "\n".join(lines),
                      title="# Batched linear algebra benchmark")


if __name__ == "__main__":
    main()
