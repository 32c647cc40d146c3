"""Row max/min reductions on the CPU backend: the integer-key path of
kiln/codegen/cpu/minmax_keys.py against the `llvm.maximum` path it replaced, same run.

    .venv/bin/python benchmarks/bench_minmax_reduce.py [--repeat 30]

Kernels (Kernel IR, compiled by two fresh CpuBackend instances, one thread each so the
comparison is of the loops, not of the pool): the row max of a (2048, 1024) float32
matrix, and the same under a causal mask (`select(r0 <= o0 % 1024, x, -inf)`, the
shape of attention's softmax row max). Prints medians and minimums in milliseconds and
the ratio old / new, and checks both paths give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kiln.codegen.cpu import CpuBackend, CpuOptions, minmax_keys
from kiln.codegen.kernel_ir import (
    IN, OUT, BufferParam, Const, IndexValue, Kernel, Load, Loop, Op, Reduce, ReduceRef, Store,
    loop_var,
)
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

M, K = symbol("M"), symbol("K")
o0, r0 = loop_var("o0"), loop_var("r0")


def row_kernel(op: str, masked: bool) -> Kernel:
    """out[o0] = op over r0 of x[o0, r0] (optionally causally masked)."""
    f32 = dt.float32
    x = Load("x", K * o0 + r0, f32)
    if masked:
        keep = Op("le", (IndexValue(r0, dt.int64), IndexValue(o0 % K, dt.int64)), dt.bool_)
        x = Op("select", (keep, x, Const(float("-inf"), f32)), f32)
    return Kernel(f"row_{op}", (BufferParam("x", f32, (M, K), IN), BufferParam("o", f32, (M,), OUT)),
                  ("M", "K"), (Loop("o0", M),),
                  (Reduce("m", op, (Loop("r0", K),), x, f32), Store("o", o0, ReduceRef("m", f32))))


def compile_with(keys: bool, kernel: Kernel):
    minmax_keys.ENABLED = keys
    try:
        return CpuBackend(CpuOptions(threads=1)).compile(kernel)
    finally:
        minmax_keys.ENABLED = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 1024)).astype(np.float32)
    sizes = {"M": 2048, "K": 1024}
    print("| kernel | llvm.maximum path (ms) | key path (ms) | old / new (medians, minimums) |")
    print("|---|---|---|---|")
    for op, masked in (("max", False), ("max", True), ("min", False)):
        k = row_kernel(op, masked)
        fns = {keys: compile_with(keys, k) for keys in (False, True)}
        outs = {keys: np.empty(2048, np.float32) for keys in fns}
        times: dict = {False: [], True: []}
        for _ in range(args.repeat):  # alternate, so load hits both alike
            for keys, f in fns.items():
                t0 = time.perf_counter()
                f([x, outs[keys]], sizes)
                times[keys].append((time.perf_counter() - t0) * 1e3)
        assert outs[False].tobytes() == outs[True].tobytes(), "paths disagree"
        med = {k_: statistics.median(v) for k_, v in times.items()}
        mn = {k_: min(v) for k_, v in times.items()}
        name = f"row {op} (2048, 1024) f32" + (" causal-masked" if masked else "")
        print(f"| {name} | {med[False]:.3f} ({mn[False]:.3f}) | {med[True]:.3f} ({mn[True]:.3f}) | "
              f"{med[False] / med[True]:.2f}x ({mn[False] / mn[True]:.2f}x) |")


if __name__ == "__main__":
    main()
