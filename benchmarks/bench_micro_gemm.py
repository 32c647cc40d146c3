"""kiln's GEMM micro-kernel (kiln/codegen/cpu/microkernel.py) per thread against torch's
(oneDNN/MKL) on the small GPT step's products and the batched GEMM of bench_call.py.

    .venv/bin/python benchmarks/bench_micro_gemm.py [--rounds 60] [--baseline TREE]
    .venv/bin/python benchmarks/bench_micro_gemm.py --gpt --baseline TREE   # the GPT step's GEMMs
    .venv/bin/python benchmarks/bench_micro_gemm.py --b-offset 0,16 --shapes 0,4 --baseline TREE
        # B placed 0 and 16 bytes past a 64-byte boundary (rows aligned / split), shapes 0 and 4

One thread: the kernel as the CPU backend compiles it (`CpuBackend._plan(g, .., "micro")`),
called with kn.set_num_threads(1) so that no launch is split, against torch.matmul(...,
out=) at torch.set_num_threads(1). `--baseline TREE` adds the micro-kernel of another
kiln tree (its microkernel.py loaded beside this one's, emitted into the same backend),
so the two are timed in the same rounds. Two threads (the batched GEMM): this kernel's
batch items claimed by two OpenMP threads from native code (`native_pool.parallel_claim`,
what a split launch runs), `kn.compile(a @ b)` at kiln's default threads, torch at 2.
Inputs are numpy arrays as a user makes them (`rng.standard_normal(...).astype`): a
large one starts 16 bytes past a 64-byte boundary, so B's rows are misaligned
(column `B off`); `a` rows use 64-byte aligned copies.

Per round, per shape, the variants in a shuffled order, each called 3 times in a row and
the last 2 timed (the operands are in cache, as in a training step's back-to-back
calls). Microseconds: median (minimum); ratio torch / kiln by median (minimum).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import kiln as kn  # noqa: E402
from kiln.codegen.cpu import CpuBackend, CpuOptions  # noqa: E402
from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, GemmKernel  # noqa: E402
from kiln.ir import dtypes as dt  # noqa: E402

# (batch, m, n, k, layout): the small GPT step's micro-kernel products (bench_train.py)
# and bench_call.py's batched GEMM; layout "NT" = B transposed in memory, "TN" = A
SHAPES = [(16, 32, 64, 256, "NN"), (64, 32, 32, 16, "NT"), (64, 32, 16, 32, "NN"), (64, 16, 32, 32, "TN"),
          (1, 512, 192, 64, "NT"), (1, 512, 65, 64, "NT"), (1, 512, 64, 65, "NN"), (1, 512, 64, 192, "NN"),
          (1, 192, 64, 512, "TN"), (1, 128, 128, 128, "NN")]


def gemm_kernel(b, m, n, k, layout):
    ta, tb = layout[0] == "T", layout[1] == "T"
    f32 = dt.float32
    a_shape, b_shape = ((b, k, m) if ta else (b, m, k)), ((b, n, k) if tb else (b, k, n))
    return GemmKernel("g", (BufferParam("a", f32, a_shape, IN), BufferParam("b", f32, b_shape, IN),
                            BufferParam("o", f32, (b, m, n), OUT)), (), "a", "b", "o", b, m, n, k,
                      (m * k, 1, m) if ta else (m * k, k, 1), (k * n, 1, k) if tb else (k * n, n, 1),
                      Acc(f32)), a_shape, b_shape


def micro_variant(backend, module, g):
    """`g` compiled as the micro-kernel of `module` (this tree's or a baseline's)."""
    import dataclasses

    from kiln.codegen.cpu import jit
    from kiln.codegen.cpu.ir_builder import Module

    plan = backend._plan(g, set(), "micro")
    plan = dataclasses.replace(plan, outer_extents=(module.row_blocks(g),))
    mod = Module(f32_math=backend.options.f32_math)
    module.emit_micro_gemm(mod, plan.kernel, plan.symbol)
    return backend._wrap([plan], jit.Jitted(backend._optimized(backend._finish(mod.text())), opt_level=3))[0]


def aligned(x):
    raw = np.empty(x.size + 16, x.dtype)
    start = (-(raw.ctypes.data % 64) // x.itemsize) % 16
    out = raw[start:start + x.size].reshape(x.shape)
    out[...] = x
    return out


def time_rounds(fns: dict, rounds: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name in random.sample(list(fns), len(fns)):
            for rep in range(3):
                t0 = time.perf_counter()
                fns[name]()
                if rep:
                    times[name].append(time.perf_counter() - t0)
    return {name: (float(np.median(t)) * 1e6, float(np.min(t)) * 1e6) for name, t in times.items()}


def placed(x: np.ndarray, offset: int) -> np.ndarray:
    """x copied to memory starting `offset` bytes past a 64-byte boundary."""
    raw = np.empty(x.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def one_thread(rounds: int, baseline: str | None, offsets=(None,), shapes=None) -> list[str]:
    import torch

    from kiln.codegen.cpu import microkernel

    torch.set_num_threads(1)
    kn.set_num_threads(1)
    backend = CpuBackend(CpuOptions(threads=1))
    modules = {"kiln": microkernel}
    if baseline:
        spec = importlib.util.spec_from_file_location(
            "baseline_microkernel", os.path.join(baseline, "kiln", "codegen", "cpu", "microkernel.py"))
        modules["baseline"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["baseline"])
    rng = np.random.default_rng(0)
    head = "| batch x m x n x k | layout | B off | " + " | ".join(list(modules) + ["torch 1t"]) + \
        " | torch / kiln |" + (" baseline / kiln |" if baseline else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (b, m, n, k, layout), offset in [(s, o) for i, s in enumerate(SHAPES) if shapes is None or i in shapes
                                         for o in offsets]:
        g, a_shape, b_shape = gemm_kernel(b, m, n, k, layout)
        a = aligned(rng.standard_normal(a_shape).astype(np.float32))
        bm = rng.standard_normal(b_shape).astype(np.float32)
        if offset is not None:
            bm = placed(bm, offset)
        want = (a.transpose(0, 2, 1) if layout[0] == "T" else a).astype(np.float64) @ \
            (bm.transpose(0, 2, 1) if layout[1] == "T" else bm).astype(np.float64)
        fns = {}
        for name, module in modules.items():
            out = np.empty((b, m, n), np.float32)
            ck = micro_variant(backend, module, g)
            ck([a, bm, out], {})
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
            fns[name] = lambda ck=ck, args=[a, bm, out]: ck(args, {})
        ta, tb, to = torch.from_numpy(a), torch.from_numpy(bm), torch.empty(b, m, n)
        ta = ta.transpose(1, 2) if layout[0] == "T" else ta
        tb = tb.transpose(1, 2) if layout[1] == "T" else tb
        fns["torch 1t"] = lambda ta=ta, tb=tb, to=to: torch.matmul(ta, tb, out=to)
        res = time_rounds(fns, rounds)
        cells = [f"{res[x][0]:.1f} ({res[x][1]:.1f})" for x in fns]
        ratio = f"{res['torch 1t'][0] / res['kiln'][0]:.2f}x ({res['torch 1t'][1] / res['kiln'][1]:.2f}x)"
        extra = f" {res['baseline'][0] / res['kiln'][0]:.2f}x ({res['baseline'][1] / res['kiln'][1]:.2f}x) |" \
            if baseline else ""
        lines.append(f"| {b} x {m} x {n} x {k} | {layout} | {bm.ctypes.data % 64} | " + " | ".join(cells)
                     + f" | {ratio} |" + extra)
    return lines


def gpt_step_kernels(rounds: int, baseline: str) -> list[str]:
    """The small GPT step's own micro-kernel GEMMs (bench_train.py's step, traced and
    lowered as kn.compile does; epilogues and strides as they are), this tree's kernel
    against the baseline's, one thread, random inputs, same rounds."""
    import tempfile

    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="micro-gemm-"))
    sys.path.insert(0, HERE)
    import bench_train as bt

    from kiln.codegen.cpu import microkernel
    from kiln.codegen.cpu.autotune import choose_gemm

    spec = importlib.util.spec_from_file_location(
        "baseline_microkernel", os.path.join(baseline, "kiln", "codegen", "cpu", "microkernel.py"))
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    compiled, params, state, x, y, key = bt.kiln_gpt_step()
    compiled(params, state, x, y, key)
    kn.set_num_threads(1)
    program = compiled.compiled_graphs()[0].program
    seen, kernels = set(), []
    for k in program.kernels.values():
        k = getattr(k, "kernel", k)
        if isinstance(k, GemmKernel) and choose_gemm(k).variant == "micro":
            import dataclasses

            anon = dataclasses.replace(k, name="k")
            if anon not in seen:
                seen.add(anon)
                kernels.append(k)
    backend = CpuBackend(CpuOptions(threads=1))
    rng = np.random.default_rng(2)
    lines = ["| GPT step GEMM (batch, m, n, k, B strides) | baseline | kiln | baseline / kiln |", "|---|---|---|---|"]
    total = {"baseline": 0.0, "kiln": 0.0}
    for g in kernels:
        arrays = [rng.uniform(-1, 1, tuple(int(d) for d in b.shape)).astype(b.dtype.np_dtype) for b in g.buffers]
        fns, outs = {}, {}
        for name, module in (("baseline", base), ("kiln", microkernel)):
            args = [a.copy() for a in arrays]
            ck = micro_variant(backend, module, g)
            ck(args, {})
            outs[name] = args
            fns[name] = lambda ck=ck, args=args: ck(args, {})
        np.testing.assert_allclose(outs["kiln"][-1], outs["baseline"][-1], rtol=1e-4, atol=1e-4)
        res = time_rounds(fns, rounds)
        for name in total:
            total[name] += res[name][0]
        lines.append(f"| {g.batch}, {g.m}, {g.n}, {g.k}, {tuple(g.b_strides)} | {res['baseline'][0]:.1f} "
                     f"({res['baseline'][1]:.1f}) | {res['kiln'][0]:.1f} ({res['kiln'][1]:.1f}) | "
                     f"{res['baseline'][0] / res['kiln'][0]:.2f}x ({res['baseline'][1] / res['kiln'][1]:.2f}x) |")
    lines.append(f"| sum of medians ({len(kernels)} distinct kernels) | {total['baseline']:.1f} | "
                 f"{total['kiln']:.1f} | {total['baseline'] / total['kiln']:.2f}x |")
    return lines


def two_threads(rounds: int) -> list[str]:
    """The batched GEMM on two threads: the micro-kernel claimed natively, kn.compile, torch."""
    import torch

    from kiln.codegen.cpu.native_pool import parallel_claim

    torch.set_num_threads(2)
    kn.set_num_threads(2)
    claim = parallel_claim()
    b, m, n, k, layout = SHAPES[0]
    g, a_shape, b_shape = gemm_kernel(b, m, n, k, layout)
    rng = np.random.default_rng(1)
    a = rng.standard_normal(a_shape).astype(np.float32)
    bm = rng.standard_normal(b_shape).astype(np.float32)
    out = np.empty((b, m, n), np.float32)
    ck = CpuBackend(CpuOptions(threads=2))._compile_plans(
        [CpuBackend(CpuOptions(threads=2))._plan(g, set(), "micro")])[0]
    f = kn.compile(lambda x, y: x @ y)
    fns = {"kn.compile (default threads)": lambda: f(a, bm)}
    if claim is not None:
        bufs = (ctypes.c_void_p * 3)(a.ctypes.data, bm.ctypes.data, out.ctypes.data)
        sizes = (ctypes.c_int64 * 1)()
        total = ck._count({})
        fns["micro-kernel, 2 threads claim items natively"] = \
            lambda: claim(ck.address, bufs, sizes, total, total // b, 2)
    ta, tb, to = torch.from_numpy(a), torch.from_numpy(bm), torch.empty(b, m, n)
    fns["torch 2t"] = lambda: torch.matmul(ta, tb, out=to)
    for fn in fns.values():
        fn()
    np.testing.assert_allclose(f(a, bm).numpy(), a @ bm, rtol=1e-4, atol=1e-4)
    res = time_rounds(fns, rounds)
    lines = [f"| {b} x {m} x {n} x {k} on 2 threads | us, median (minimum) | torch 2t / this |", "|---|---|---|"]
    for name, (med, low) in res.items():
        lines.append(f"| {name} | {med:.1f} ({low:.1f}) | {res['torch 2t'][0] / med:.2f}x "
                     f"({res['torch 2t'][1] / low:.2f}x) |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--baseline", help="another kiln tree: its micro-kernel timed in the same rounds")
    ap.add_argument("--gpt", action="store_true", help="with --baseline: only the GPT step's own GEMMs")
    ap.add_argument("--b-offset", help="comma-separated byte offsets of B past a 64-byte boundary "
                                       "(default: where numpy puts it); one-thread table only")
    ap.add_argument("--shapes", help="comma-separated indexes into SHAPES (default: all); one-thread table only")
    args = ap.parse_args()
    if args.b_offset or args.shapes:
        offsets = tuple(int(o) for o in args.b_offset.split(",")) if args.b_offset else (None,)
        shapes = {int(i) for i in args.shapes.split(",")} if args.shapes else None
        print("\n".join(one_thread(args.rounds, args.baseline, offsets, shapes)))
        return 0
    if args.gpt and args.baseline:
        print("\n".join(gpt_step_kernels(args.rounds, args.baseline)))
        return 0
    print("\n".join(one_thread(args.rounds, args.baseline)))
    print()
    print("\n".join(two_threads(args.rounds * 3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
