"""max-autotune for the tile selector: measure the top candidate configs on the GPU
(a benchmark callable, or the grouped GEMM's own), show a progress bar, and cache the
winner in kiln's artifact cache per (kernel hash, size bucket, target), where later
default-mode selections find it.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from typing import Callable, Sequence

from kiln.codegen.triton.gpu_model import GEMM_KINDS, Config, Device, device_model, dtype_name
from kiln.codegen.triton.tile_cost import next_pow2
from kiln.errors import KilnArgumentError


def size_bucket(*sizes: int | None) -> tuple:
    """Sizes rounded up to powers of two: one tuning result serves a bucket of shapes."""
    return tuple(None if s is None else next_pow2(int(s)) for s in sizes)


def tuning_key(kernel_key: str, kind: str, m, n, k, dtype, target: str | Device, *,
               num_experts=None, input_precision: str = "ieee") -> str:
    """The artifact-cache key of a tuned choice: kernel hash, size bucket, target."""
    from kiln.codegen import artifact_cache

    dev = device_model(target)
    return artifact_cache.content_key(
        "kiln-tiles/1", kernel_key, kind, repr(size_bucket(m, n, k, num_experts)),
        dtype_name(dtype), input_precision, dev.arch, dev.name)


def load_choice(key: str) -> Config | None:
    """The config cached under `key`, or None (absent or unreadable)."""
    from kiln.codegen import artifact_cache

    blob = artifact_cache.load(key, "tiles")
    if blob is None:
        return None
    try:
        return Config(**json.loads(blob)["config"])
    except (ValueError, TypeError, KeyError):
        return None


def store_choice(key: str, config: Config, seconds: float) -> None:
    """Cache the measured winner under `key` (JSON: the config and its time)."""
    from kiln.codegen import artifact_cache

    artifact_cache.store(key, json.dumps({"config": asdict(config), "seconds": seconds}).encode(),
                         "tiles")


def autotune(configs: Sequence[Config], benchmark: Callable[[Config], float], *,
             key: str | None = None) -> Config:
    """The fastest of `configs` by `benchmark(config) -> seconds` (a config that fails
    to compile or run is skipped), cached under `key`; a cached choice is reused."""
    if key is not None:
        cached = load_choice(key)
        if cached is not None:
            return cached
    best, best_time = None, math.inf
    for c in progress(configs, desc="kiln: tuning tiles"):
        try:
            seconds = float(benchmark(c))
        except Exception as exc:  # a candidate the compiler or the GPU refuses loses
            print(f"kiln: tile config {c} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        if seconds < best_time:
            best, best_time = c, seconds
    if best is None:
        raise KilnArgumentError("max-autotune: every candidate config failed to run; see the "
                                "messages above")
    if key is not None:
        store_choice(key, best, best_time)
    return best


def progress(items: Sequence, desc: str):
    """Iterate with a progress bar: tqdm or rich when installed, else a line on stderr."""
    try:
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, leave=False)
        return
    except ImportError:
        pass
    try:
        from rich.progress import track

        yield from track(items, description=desc, transient=True)
        return
    except ImportError:
        pass
    total = len(items)
    for i, item in enumerate(items):
        width = 24
        done = width * i // max(total, 1)
        print(f"\r{desc} [{'#' * done}{'.' * (width - done)}] {i}/{total}", end="",
              file=sys.stderr, flush=True)
        yield item
    print(f"\r{desc} [{'#' * 24}] {total}/{total}", file=sys.stderr, flush=True)


def default_benchmark(kind, m, n, k, dtype, dev, num_experts, group_sizes, out_dtype,
                      input_precision) -> Callable[[Config], float]:
    """The grouped GEMM timed on this machine's GPU (gemm: one expert)."""
    from kiln.codegen.triton.targets import KilnNoGpuError

    try:
        import torch
        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        raise KilnNoGpuError(
            "max-autotune measures candidate tile configs on a GPU, and this machine has none "
            "(torch.cuda.is_available() is False)",
            hint="use mode='default' (the analytical selector needs no GPU), or run on a machine "
                 "with an NVIDIA or AMD GPU and a CUDA/ROCm build of torch")
    if kind not in GEMM_KINDS:
        raise KilnArgumentError(f"max-autotune of {kind} kernels needs benchmark=: a callable "
                                "that launches the kernel with a config and returns seconds")
    from kiln.codegen.triton.grouped_gemm import make_benchmark

    experts = 1 if kind == "gemm" else (num_experts or (len(group_sizes) if group_sizes is not None else 1))
    return make_benchmark(m, n, k, dtype, experts, group_sizes=group_sizes, out_dtype=out_dtype,
                          input_precision=input_precision)
