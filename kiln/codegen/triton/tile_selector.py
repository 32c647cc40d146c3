"""The analytical tile selector: ranks block configurations from a model of the GPU.

On by default, with no measurement (ROCm's "Origami" idea): every candidate config
(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) is first checked against
the target's hard limits, then given an estimated run time, and the list is sorted.

The GPU model and a config's legality live in gpu_model.py, the time model in
tile_cost.py, max-autotune's measuring and caching in tile_autotune.py; this module
ranks the candidates and chooses.

`select_tiles(kind, m, n, k, dtype, target)` -> [Config] best first; `rank(...)` gives
the `Estimate`s (the time breakdown), `explain(...)` a table of them for `kiln dump`
and debugging; `python -m kiln.codegen.triton.tile_selector grouped_gemm 8192 1408 2048
--experts 64 --target gfx942` prints it. `mode="max-autotune"` measures the top
candidates on the GPU (a benchmark callable or the grouped GEMM's own), shows a
progress bar, and caches the winner on disk per (kernel hash, size bucket, target) in
kiln's artifact cache; later default-mode calls with that kernel hash put the measured
winner first.

Kinds and sizes (the contract of kiln/codegen/triton/tiling.py, whose `_tiles` this replaces):
    gemm             m, n, k of the product
    grouped_gemm     m = tokens (sum of the group sizes), n, k; num_experts= or group_sizes=
    pointwise        m = elements; n = tensors read + written (default 2)
    reduction_inner  m = rows, k = reduced elements (contiguous)   ("reduction" is an alias)
    reduction_outer  m = rows, k = reduced elements (rows contiguous)
    reduction_full   k = reduced elements
A size of None (symbolic) is modelled at a typical value (REPRESENTATIVE).
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import Callable, Iterable, Sequence

import numpy as np

# device_for_name, mma_path and shared_memory are re-exported: scripts, tests and the
# grouped GEMM reach the GPU model through this module
from kiln.codegen.triton.gpu_model import (  # noqa: F401
    DEVICES, DTYPE_BYTES, DTYPE_CLASS, GEMM_KINDS, KINDS, Config, Device, device_for_name,
    device_model, dtype_class, dtype_name, illegal_reason, mma_path, shared_memory,
)
from kiln.codegen.triton.tile_autotune import autotune, default_benchmark, load_choice, tuning_key
from kiln.codegen.triton.tile_cost import (
    Estimate, RowGroups, gemm_estimate, next_pow2, stream_estimate,
)
from kiln.errors import KilnArgumentError, KilnDTypeError

REPRESENTATIVE = {"m": 4096, "n": 4096, "k": 4096, "elements": 1 << 20}
# the names kiln/codegen/cute/select.py reaches for, from before the split
_Groups, _BYTES, _gemm_estimate = RowGroups, DTYPE_BYTES, gemm_estimate


# -- candidates and ranking ------------------------------------------------------------------------

def _pow2_range(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _gemm_candidates(dev: Device, rows_max: int, n: int, k: int) -> Iterable[Config]:
    bms = [v for v in (16, 32, 64, 128, 256) if v <= max(16, 2 * next_pow2(rows_max))]
    bns = [v for v in (16, 32, 64, 128, 256) if v <= max(16, 2 * next_pow2(n))]
    bks = [v for v in (16, 32, 64, 128, 256) if v <= max(16, next_pow2(k))]
    stages = (1, 2, 3) if dev.vendor == "rocm" else (2, 3, 4, 5)
    for bm, bn, bk, gm, w, s in itertools.product(bms, bns, bks, (1, 8), (2, 4, 8), stages):
        yield Config(bm, bn, bk, gm, w, s)


def _group_rows(m: int, num_experts: int | None, group_sizes) -> tuple[np.ndarray, np.ndarray]:
    """(distinct group sizes, how many groups of each); balanced when only E is known."""
    if group_sizes is not None:
        sizes = np.asarray(group_sizes, dtype=np.int64).reshape(-1)
        rows, counts = np.unique(sizes[sizes > 0], return_counts=True)
        if rows.size == 0:
            rows, counts = np.array([0]), np.array([1])
        return rows, counts
    e = max(1, int(num_experts or 1))
    base, extra = divmod(int(m), e)
    rows = np.array([base + 1, base] if extra else [base])
    counts = np.array([extra, e - extra] if extra else [e])
    keep = (counts > 0) & (rows > 0)
    return (rows[keep], counts[keep]) if keep.any() else (np.array([0]), np.array([1]))


def rank(kind: str, m: int | None, n: int | None = None, k: int | None = None, dtype="float16",
         target: str | Device = "sm_90", *, num_experts: int | None = None, group_sizes=None,
         out_dtype=None, input_precision: str = "ieee") -> list[Estimate]:
    """Every legal candidate's Estimate, fastest first.

    Estimates within 0.5% are ties, decided by the most slack (the lower compute bound:
    in a memory-bound shape every config streams the same bytes, and the one with
    compute to spare is the robust choice), then less memory traffic, less padded work, a natural register
    load (GEMMs: about 64 accumulators per thread on AMD, 128 on NVIDIA; memory-bound
    kernels: two 16-byte vectors per thread), less shared memory,
    wider GROUP_M bands, and finally the config's fields, so the order is deterministic."""
    dev = device_model(target)
    kind = "reduction_inner" if kind == "reduction" else kind
    if kind not in KINDS:
        raise KilnArgumentError(f"tile selector: unknown kernel kind {kind!r}; kinds are "
                                f"{', '.join(KINDS)} (and 'reduction')")
    if kind in GEMM_KINDS:
        ests = _rank_gemm(kind, dev, m, n, k, dtype, num_experts, group_sizes, out_dtype,
                          input_precision)
    elif kind == "pointwise":
        ests = _rank_pointwise(dev, m, n, dtype)
    else:
        ests = _rank_reduction(kind, dev, m, k, dtype)
    if kind in GEMM_KINDS:  # accumulators per thread
        natural = 64 if dev.vendor == "rocm" else 128
    else:  # elements per thread: two 16-byte vectors in flight
        natural = max(4, 32 // _elem_bytes(dtype))
    threads = lambda c: c.num_warps * dev.warp_size  # noqa: E731
    pressure = lambda e: abs(math.log2(  # noqa: E731
        max(e.config.block_m * e.config.block_n / threads(e.config), 1) / natural))
    if kind not in GEMM_KINDS:  # memory-bound: within 0.5%, register pressure decides
        return sorted(ests, key=lambda e: (_bucket(e.time), pressure(e), _bucket(e.compute),
                                           e.config))
    return sorted(ests, key=lambda e: (
        _bucket(e.time), _bucket(e.compute), _bucket(e.dram + e.l2), e.padded_flops, pressure(e),
        e.shared_memory, -e.config.group_m, e.config))


def _bucket(seconds: float) -> int:
    """Times within 0.5% of each other fall in one bucket."""
    return round(math.log(max(seconds, 1e-12)) / math.log(1.005))


def _rank_gemm(kind, dev, m, n, k, dtype, num_experts, group_sizes, out_dtype, input_precision):
    m = REPRESENTATIVE["m"] if m is None else int(m)
    n = REPRESENTATIVE["n"] if n is None else int(n)
    k = REPRESENTATIVE["k"] if k is None else int(k)
    if min(m, n, k) < 0:
        raise KilnArgumentError(f"tile selector: sizes must be >= 0, got m={m}, n={n}, k={k}")
    cls = dtype_class(dtype, input_precision)
    if dev.peak_tflops.get(cls) is None and cls != "tf32":
        raise KilnDTypeError(f"tile selector: {dev.name} ({dev.arch}) has no matrix instruction "
                             f"for {dtype_name(dtype)}; float8 needs sm_90+ or gfx942+")
    out_bytes = DTYPE_BYTES[dtype_class(out_dtype)] if out_dtype is not None else (
        2 if cls == "fp8" else DTYPE_BYTES[cls])
    if kind == "gemm":
        rows, counts = np.array([max(m, 1)]), np.array([1])
    else:
        rows, counts = _group_rows(m, num_experts, group_sizes)
    groups = RowGroups(rows, counts, max(n, 1), max(k, 1))
    persistent = kind == "grouped_gemm"
    out = []
    for c in _gemm_candidates(dev, groups.max_rows, groups.n, groups.k):
        if illegal_reason(kind, c, dev, dtype, input_precision) is None:
            out.append(gemm_estimate(dev, cls, out_bytes, c, groups, persistent))
    return out


def _elem_bytes(dtype) -> int:
    name = dtype_name(dtype)
    if name in DTYPE_CLASS:
        return DTYPE_BYTES[DTYPE_CLASS[name]]
    return int(np.dtype(name).itemsize)


def _rank_pointwise(dev, m, n, dtype):
    elements = REPRESENTATIVE["elements"] if m is None else max(1, int(m))
    streams = 2 if n is None else max(1, int(n))
    b = _elem_bytes(dtype)
    out = []
    for block, w in itertools.product(_pow2_range(64, 8192), (1, 2, 4, 8, 16)):
        c = Config(block, 1, 1, 1, w, 1)
        if block > max(64, 2 * next_pow2(elements)) or illegal_reason("pointwise", c, dev) is not None:
            continue
        per_thread = block / (w * dev.warp_size)
        reads = max(1, streams - 1)
        out.append(stream_estimate(dev, c, -(-elements // block), block * b * streams,
                                   block * b * reads, 0.0, per_thread * b))
    return out


def _rank_reduction(kind, dev, m, k, dtype):
    rows = 1 if kind == "reduction_full" else (REPRESENTATIVE["m"] if m is None else max(1, int(m)))
    length = REPRESENTATIVE["k"] if k is None else max(1, int(k))
    b = _elem_bytes(dtype)
    clock = dev.clock_ghz * 1e9
    out = []
    for x, r, w in itertools.product(_pow2_range(1, 128), _pow2_range(16, 16384), (1, 2, 4, 8, 16)):
        if x > next_pow2(rows) or r > max(16, next_pow2(length)):
            continue
        c = Config(x, r, 1, 1, w, 1)
        if illegal_reason(kind, c, dev) is not None:
            continue
        loops = -(-length // r)
        # a loop step costs its bookkeeping; the cross-warp combine a shared-memory
        # round per halving
        threads = w * dev.warp_size
        overhead = (loops * 20 + math.log2(threads) * 40) / clock
        per_thread = x * min(r, length) / threads
        if kind == "reduction_outer":  # rows are contiguous: a thread's run is across rows
            vector = min(x, per_thread) * b
        else:
            vector = min(r, length, per_thread) * b
        out.append(stream_estimate(dev, c, -(-rows // x), x * length * b, x * min(r, length) * b,
                                   overhead, vector))
    return out


# -- choosing: default (analytical) and max-autotune (measured, cached) --------------------------------

def select_tiles(kind: str, m: int | None, n: int | None = None, k: int | None = None,
                 dtype="float16", target: str | Device = "sm_90", *, num_experts: int | None = None,
                 group_sizes=None, out_dtype=None, input_precision: str = "ieee",
                 mode: str = "default", top: int | None = None, kernel_key: str | None = None,
                 benchmark: Callable[[Config], float] | None = None,
                 candidates: int = 8) -> list[Config]:
    """Legal configs for one kernel, best first.

    mode="default": the analytical ranking (or, when `kernel_key` is given and this
    kernel was tuned before for this size bucket and target, the measured winner first).
    mode="max-autotune": measure the first `candidates` configs with `benchmark(config)
    -> seconds` (default: the grouped GEMM on this machine's GPU), cache the winner.

        >>> select_tiles("grouped_gemm", 8192, 1408, 2048, "bfloat16", "gfx942",
        ...              num_experts=64)[0]                        # doctest: +SKIP
        Config(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=2)
    """
    if mode not in ("default", "max-autotune"):
        raise KilnArgumentError(f"tile selector: mode must be 'default' or 'max-autotune', "
                                f"got {mode!r}")
    ests = rank(kind, m, n, k, dtype, target, num_experts=num_experts, group_sizes=group_sizes,
                out_dtype=out_dtype, input_precision=input_precision)
    configs = [e.config for e in ests]
    if not configs:
        raise KilnArgumentError(f"tile selector: no legal {kind} config for {dtype} on {target}")
    dev = device_model(target)
    key = None
    if kernel_key is not None or mode == "max-autotune":
        key = tuning_key(kernel_key or kind, kind, m, n, k, dtype, dev,
                         num_experts=num_experts, input_precision=input_precision)
    if mode == "max-autotune":
        if benchmark is None:
            benchmark = default_benchmark(kind, m, n, k, dtype, dev, num_experts, group_sizes,
                                          out_dtype, input_precision)
        best = autotune(configs[:candidates], benchmark, key=key)
        configs = [best] + [c for c in configs if c != best]
    elif key is not None:
        tuned = load_choice(key)
        if tuned is not None and tuned in configs:
            configs = [tuned] + [c for c in configs if c != tuned]
    return configs[:top] if top else configs


# -- explaining ---------------------------------------------------------------------------------------

def explain(kind: str, m, n=None, k=None, dtype="float16", target: str | Device = "sm_90", *,
            top: int = 8, **kwargs) -> str:
    """A table of the best `top` configs and the model's time breakdown for each."""
    dev = device_model(target)
    ests = rank(kind, m, n, k, dtype, dev, **kwargs)
    sizes = f"m={m} n={n} k={k}" + "".join(f" {a}={v}" for a, v in kwargs.items()
                                           if a in ("num_experts",) and v is not None)
    lines = [f"tile selector: {kind} {sizes} {dtype_name(dtype)} on {dev.name} ({dev.arch}, "
             f"{dev.units} {'CUs' if dev.vendor == 'rocm' else 'SMs'}): {len(ests)} legal configs",
             f"{'#':>3} {'config':<46} {'est us':>8} {'compute':>8} {'dram':>8} {'l2':>8} "
             f"{'tiles':>6} {'waves':>5} {'w.eff':>5} {'smem':>7} {'regs':>5} {'occ':>3} "
             f"{'path':<8} bound"]
    for i, e in enumerate(ests[:top]):
        lines.append(f"{i:>3} {str(e.config):<46} {e.time * 1e6:>8.2f} {e.compute * 1e6:>8.2f} "
                     f"{e.dram * 1e6:>8.2f} {e.l2 * 1e6:>8.2f} {e.tiles:>6} {e.waves:>5} "
                     f"{e.wave_efficiency:>5.2f} {e.shared_memory:>7} {e.registers:>5.0f} "
                     f"{e.occupancy:>3} {e.path:<8} {e.bound}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kiln.codegen.triton.tile_selector",
                                     description="Show the analytical tile selector's ranking.")
    parser.add_argument("kind", choices=KINDS + ("reduction",))
    parser.add_argument("m", type=int)
    parser.add_argument("n", type=int, nargs="?")
    parser.add_argument("k", type=int, nargs="?")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--target", default="sm_90", help="sm_80 sm_90 sm_100 gfx90a gfx942 gfx950, "
                                                          "or a device: " + " ".join(DEVICES))
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    print(explain(args.kind, args.m, args.n, args.k, args.dtype, args.target, top=args.top,
                  num_experts=args.experts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
