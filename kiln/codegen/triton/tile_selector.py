"""The analytical tile selector: ranks block configurations from a model of the GPU.

On by default, with no measurement (ROCm's "Origami" idea): every candidate config
(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) is first checked against
the target's hard limits, then given an estimated run time, and the list is sorted.

Legality (a config that breaks one is never returned):
  - shared memory / LDS per block, as Triton allocates it (stages x the A and B tiles;
    calibrated on Triton 3.9's AOT output for every target: the wgmma/tcgen05 and
    gfx950 pipelines keep `stages` buffers, mma.sync and gfx90a/gfx942 `stages - 1`);
  - registers per thread (NVIDIA: 255; AMD: 512 VGPRs per lane shared by the waves of
    a workgroup on one SIMD), estimated from the accumulator and operand fragments;
  - instruction shapes: dot tiles of at least 16 x 16, BLOCK_K a multiple of the MMA's k
    (16; 32 for float8); on AMD (64-wide waves) every wave must own a 16 x 16 MFMA tile;
    a dtype the target has no matrix instruction for (float8 on sm_80 / gfx90a) is refused.
  Hopper's wgmma needs BLOCK_M a multiple of 64 and whole warpgroups (num_warps % 4);
  a config without them is legal but runs on mma.sync, which the model charges for.

Time (seconds) = max(compute, DRAM, L2, shared-memory) rooflines, each wave-quantized:
  - tiles are dealt to SMs/CUs; the busiest unit does ceil(tiles / units) of them, so
    a shape that leaves a one-tile tail costs a whole extra tile time (on MI300X's 304
    CUs, 305 tiles take twice as long as 304);
  - per tile: max(MMA time at the path's peak, shared-memory operand traffic) plus a K
    loop overhead per iteration and a fixed prologue/epilogue latency; pipelines with
    too few stages (or too few resident blocks) hide memory latency less well;
  - DRAM: each expert's operands once if they fit in L2, else the panels a wave of
    concurrent tiles touches (GROUP_M bands share w's panels), plus the output;
  - L2 -> SM: every tile's A and B panels.
Memory-bound kinds (pointwise, reductions) are the bytes moved at the bandwidth the
blocks can reach (at most the bytes in flight over the memory latency: Little's law),
plus per-wave scheduling and per-step reduction overheads.
Peaks, bandwidths and cache sizes are the vendors' published dense numbers (see
DEVICES); the model ranks, it does not promise absolute times.

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
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError

GEMM_KINDS = ("gemm", "grouped_gemm")
REDUCTION_KINDS = ("reduction_inner", "reduction_outer", "reduction_full")
KINDS = GEMM_KINDS + ("pointwise",) + REDUCTION_KINDS
REPRESENTATIVE = {"m": 4096, "n": 4096, "k": 4096, "elements": 1 << 20}


# -- the hardware model ----------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """What the model knows of one GPU (dense peaks in TFLOP/s; None: no matrix instruction)."""

    name: str
    arch: str  # kiln target name: "sm_90", "gfx942", ...
    units: int  # SMs / CUs a kernel can use
    clock_ghz: float
    peak_tflops: dict = field(hash=False)  # by dtype class: fp16 bf16 fp8 tf32 fp32 fp64
    dram_tbs: float
    l2_bytes: int  # the last-level cache operands are reused from (MI300/MI355: Infinity Cache)
    l2_tbs: float  # L2 -> SM/CU bandwidth (MI300/MI355: the per-XCD L2s together)
    smem_per_block: int
    smem_per_unit: int
    warp_size: int
    fp8_native: bool = True  # AMD gfx942 has only the fnuz float8 MFMA; OCP float8 is converted
    vendor: str = field(init=False)  # "cuda" or "rocm"

    def __post_init__(self):
        object.__setattr__(self, "vendor", "cuda" if self.arch.startswith("sm_") else "rocm")


_NV = dict(warp_size=32)
_AMD = dict(warp_size=64)
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("A100", "sm_80", 108, 1.41, {"fp16": 312, "bf16": 312, "fp8": None, "tf32": 156,
                                        "fp32": 19.5, "fp64": 19.5},
           2.04, 40 << 20, 4.5, 166912, 167936, **_NV),
    Device("H100", "sm_90", 132, 1.83, {"fp16": 989, "bf16": 989, "fp8": 1979, "tf32": 495,
                                        "fp32": 67, "fp64": 67},
           3.35, 50 << 20, 9.0, 232448, 233472, **_NV),
    Device("H200", "sm_90", 132, 1.83, {"fp16": 989, "bf16": 989, "fp8": 1979, "tf32": 495,
                                        "fp32": 67, "fp64": 67},
           4.8, 50 << 20, 9.0, 232448, 233472, **_NV),
    Device("B200", "sm_100", 148, 1.96, {"fp16": 2250, "bf16": 2250, "fp8": 4500, "tf32": 1100,
                                         "fp32": 75, "fp64": 37},
           8.0, 126 << 20, 20.0, 232448, 233472, **_NV),
    # one MI250X GCD: each of its two dies is a device of its own (110 of the 220 CUs)
    Device("MI250X", "gfx90a", 110, 1.7, {"fp16": 191.5, "bf16": 191.5, "fp8": None, "tf32": None,
                                          "fp32": 47.9, "fp64": 47.9},
           1.64, 8 << 20, 5.0, 65536, 65536, **_AMD),
    Device("MI300X", "gfx942", 304, 2.1, {"fp16": 1307, "bf16": 1307, "fp8": 2615, "tf32": 654,
                                          "fp32": 163.4, "fp64": 81.7},
           5.3, 256 << 20, 24.0, 65536, 65536, fp8_native=False, **_AMD),
    Device("MI355X", "gfx950", 256, 2.4, {"fp16": 2517, "bf16": 2517, "fp8": 5033, "tf32": None,
                                          "fp32": 157.3, "fp64": 78.6},
           8.0, 256 << 20, 27.0, 163840, 163840, **_AMD),
)}
# the device a bare architecture name is modelled as
DEFAULT_DEVICE = {"sm_80": "A100", "sm_90": "H100", "sm_100": "B200", "gfx90a": "MI250X",
                  "gfx942": "MI300X", "gfx950": "MI355X"}


def device_model(target: str | Device) -> Device:
    """The Device for a product ("H200", "MI300X"), an architecture ("sm_90", "gfx942") or a
    backend spec ("cuda", "rocm:gfx950")."""
    if isinstance(target, Device):
        return target
    if target in DEVICES:
        return DEVICES[target]
    if target in DEFAULT_DEVICE:
        return DEVICES[DEFAULT_DEVICE[target]]
    from kiln.codegen.triton.targets import resolve_arch

    try:
        return DEVICES[DEFAULT_DEVICE[resolve_arch(target)]]
    except KilnArgumentError:
        raise KilnArgumentError(
            f"tile selector: unknown target {target!r}; name an architecture "
            f"({', '.join(DEFAULT_DEVICE)}), a device ({', '.join(DEVICES)}) or 'cuda'/'rocm'") from None


def device_for_name(gpu_name: str, arch: str) -> Device:
    """The model of a GPU from its driver name ("NVIDIA H200", "AMD Instinct MI300X")."""
    upper = gpu_name.upper()
    for name in sorted(DEVICES, key=len, reverse=True):
        if name in upper and DEVICES[name].arch == arch:
            return DEVICES[name]
    return device_model(arch)


# dtype classes and their sizes
_DTYPE_CLASS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
                "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8",
                "float8_e5m2fnuz": "fp8"}
_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp64": 8, "fp8": 1}


def _dtype_name(dtype) -> str:
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.replace("torch.", "")
    return {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
            "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32",
            "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}.get(name, name)


def dtype_class(dtype, input_precision: str = "ieee") -> str:
    """"fp16", "bf16", "fp8", "tf32", "fp32" or "fp64": which peak a dot of `dtype` runs at."""
    name = _dtype_name(dtype)
    if name not in _DTYPE_CLASS:
        raise KilnDTypeError(f"tile selector: no model for dtype {name}; it knows "
                             f"{', '.join(sorted(_DTYPE_CLASS))}")
    cls = _DTYPE_CLASS[name]
    return "tf32" if cls == "fp32" and input_precision == "tf32" else cls


# -- configs and their legality ----------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Config:
    """One launch configuration. For pointwise kernels block_m is XBLOCK; for reductions
    block_m is XBLOCK (rows per program) and block_n RBLOCK (reduced elements per step)."""

    block_m: int
    block_n: int = 1
    block_k: int = 1
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def blocks(self, kind: str) -> dict[str, int]:
        """The constexpr block sizes by the names kiln's Triton kernels use."""
        if kind in GEMM_KINDS:
            return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                    "GROUP_M": self.group_m}
        if kind == "pointwise":
            return {"XBLOCK": self.block_m}
        return {"XBLOCK": self.block_m, "RBLOCK": self.block_n}

    def __str__(self) -> str:
        return (f"BM={self.block_m} BN={self.block_n} BK={self.block_k} GM={self.group_m} "
                f"warps={self.num_warps} stages={self.num_stages}")


def mma_path(dev: Device, cls: str, c: Config) -> str:
    """The instruction family Triton lowers this config's tl.dot to on `dev`."""
    if dev.vendor == "rocm":
        return "mfma"
    tensor_core = cls in ("fp16", "bf16", "fp8", "tf32") or (cls == "fp64" and dev.arch != "sm_100")
    if not tensor_core:
        return "fma"
    whole_warpgroups = c.num_warps % 4 == 0 and c.block_m % 64 == 0 and cls != "fp64"
    if dev.arch == "sm_90" and whole_warpgroups:
        return "wgmma"
    if dev.arch == "sm_100" and whole_warpgroups:
        return "tcgen05"
    return "mma.sync"


def shared_memory(dev: Device, cls: str, c: Config) -> int:
    """Bytes of shared memory / LDS Triton allocates for a GEMM config (calibrated, see doc)."""
    b = _BYTES[cls]
    stage = (c.block_m * c.block_k + c.block_k * c.block_n) * b
    path = mma_path(dev, cls, c)
    if dev.vendor == "rocm":
        if c.num_stages == 1:  # A and B go through LDS one after the other
            return max(c.block_m, c.block_n) * c.block_k * b
        if dev.arch == "gfx950":
            return c.num_stages * stage + 8192
        return (c.num_stages - 1) * stage
    if path in ("wgmma", "tcgen05"):
        return c.num_stages * stage + (16 * c.num_stages if path == "tcgen05" else 0)
    return max(1, c.num_stages - 1) * stage


def registers(dev: Device, cls: str, c: Config) -> float:
    """Estimated 32-bit registers per thread (VGPRs per lane on AMD)."""
    threads = c.num_warps * dev.warp_size
    acc = c.block_m * c.block_n / threads  # float32 accumulators
    operands = (c.block_m * c.block_k + c.block_k * c.block_n) * _BYTES[cls] / 4 / threads
    if dev.vendor == "rocm":
        return acc + 4 * operands + 60  # fitted to Triton 3.9's gfx942 register counts
    path = mma_path(dev, cls, c)
    if path == "wgmma":
        return acc + 40  # operands stay in shared memory
    if path == "tcgen05":
        return min(acc, 128) + 40  # the accumulator lives in tensor memory
    return acc + 2 * operands + 40


def register_limit(dev: Device, c: Config) -> float:
    if dev.vendor == "rocm":  # a workgroup's waves share 4 SIMDs of 512 VGPRs per lane
        return 512 / math.ceil(c.num_warps / 4)
    return 255


def illegal_reason(kind: str, c: Config, target: str | Device, dtype="float16",
                   input_precision: str = "ieee") -> str | None:
    """Why `c` cannot run on `target`, or None when it is legal."""
    dev = device_model(target)
    threads = c.num_warps * dev.warp_size
    if threads > 1024:
        return f"{threads} threads per block (max 1024)"
    if kind not in GEMM_KINDS:
        per_thread = c.block_m * max(c.block_n, 1) / threads
        if per_thread < 1:
            return f"{c.block_m * c.block_n} elements for {threads} threads (idle threads)"
        if per_thread > 64:
            return f"{per_thread:.0f} elements per thread (register spills)"
        return None
    cls = dtype_class(dtype, input_precision)
    if dev.peak_tflops.get(cls) is None and not (cls == "tf32" and dev.peak_tflops["fp32"]):
        return f"{dev.arch} has no matrix instruction for {cls}"
    if c.block_m < 16 or c.block_n < 16:
        return f"dot tile {c.block_m}x{c.block_n} (min 16x16)"
    kmin = 32 if cls == "fp8" else 16
    if c.block_k < kmin or c.block_k % kmin:
        return f"BLOCK_K={c.block_k} (a multiple of {kmin} for {cls})"
    if dev.vendor == "rocm":
        if c.block_m % 16 or c.block_n % 16:
            return "MFMA tiles need BLOCK_M and BLOCK_N multiples of 16"
        if c.block_m * c.block_n < c.num_warps * 256:
            return f"{c.num_warps} waves for a {c.block_m}x{c.block_n} tile (each needs a 16x16 MFMA)"
    elif c.block_m * c.block_n < c.num_warps * 16 * 8:
        return f"{c.num_warps} warps for a {c.block_m}x{c.block_n} tile (each needs a 16x8 MMA)"
    smem = shared_memory(dev, cls, c)
    if smem > dev.smem_per_block:
        what = "LDS" if dev.vendor == "rocm" else "shared memory"
        return f"{smem} bytes of {what} (max {dev.smem_per_block})"
    regs, limit = registers(dev, cls, c), register_limit(dev, c)
    if regs > limit:
        return f"~{regs:.0f} registers per thread (max {limit:.0f})"
    return None


def _occupancy(dev: Device, c: Config, smem: int, regs: float) -> int:
    """Blocks resident per SM/CU."""
    threads = c.num_warps * dev.warp_size
    by_threads = 2048 // threads
    by_smem = dev.smem_per_unit // smem if smem else 32
    if dev.vendor == "rocm":
        waves_per_simd = min(8, int(512 // max(regs, 1)))
        by_regs = (4 * waves_per_simd) // c.num_warps
    else:
        by_regs = int(65536 // (max(regs, 32) * threads))
    return max(0, min(32, by_threads, by_smem, by_regs))


# -- estimates -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """The model's verdict on one config (times in seconds)."""

    config: Config
    time: float
    compute: float  # the MMA (or shared-memory) bound of the busiest unit
    dram: float
    l2: float
    latency: float  # K-loop overhead and per-tile prologue/epilogue, included in compute
    tiles: int
    waves: int
    wave_efficiency: float  # tiles / (waves x slots)
    occupancy: int
    shared_memory: int
    registers: float
    path: str
    useful_flops: float = 0.0
    padded_flops: float = 0.0

    @property
    def bound(self) -> str:
        return max((("compute", self.compute), ("dram", self.dram), ("l2", self.l2)),
                   key=lambda kv: kv[1])[0]

    @property
    def tflops(self) -> float:
        return self.useful_flops / self.time / 1e12 if self.time else 0.0


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _pipeline_efficiency(dev: Device, stages: int, occupancy: int) -> float:
    if dev.vendor == "rocm":
        eff = {1: 0.7}.get(stages, 1.0)
    else:
        eff = {1: 0.5, 2: 0.8}.get(stages, 1.0)
    return min(1.0, eff + 0.25 * (occupancy - 1))


_PATH_EFFICIENCY = {"wgmma": 0.8, "tcgen05": 0.75, "mfma": 0.7, "fma": 0.7}


def _path_efficiency(dev: Device, path: str) -> float:
    if path == "mma.sync":  # full rate on Ampere; Hopper/Blackwell keep it for compatibility
        return {"sm_80": 0.8, "sm_90": 0.5}.get(dev.arch, 0.3)
    return _PATH_EFFICIENCY[path]


def _peak(dev: Device, cls: str) -> float:
    if cls == "fp8" and not dev.fp8_native:
        return dev.peak_tflops["fp16"] * 1e12  # converted to fp16 before the MFMA
    if cls == "tf32" and dev.peak_tflops["tf32"] is None:
        return dev.peak_tflops["fp32"] * 1e12
    return dev.peak_tflops[cls] * 1e12


class _Groups:
    """The row groups of a (grouped) GEMM, with the per-tile-shape sums every config of
    that shape shares memoized (the ranking visits ~2000 configs of ~100 shapes)."""

    def __init__(self, rows: np.ndarray, counts: np.ndarray, n: int, k: int):
        self.groups = [(int(r), int(c)) for r, c in zip(rows, counts)]
        self.n, self.k = n, k
        self.tokens = float(sum(r * c for r, c in self.groups))
        self.max_rows = max(r for r, _ in self.groups)
        self._row_tiles: dict = {}
        self._reads: dict = {}

    def row_tiles(self, bm: int) -> int:
        """Sum over the groups of ceil(rows / BLOCK_M)."""
        if bm not in self._row_tiles:
            self._row_tiles[bm] = sum(-(-r // bm) * c for r, c in self.groups)
        return self._row_tiles[bm]

    def dram_reads(self, dev: Device, b: int, bm: int, bn: int, gm: int, concurrent: int) -> float:
        """Operand bytes from DRAM: a group's operands once if they stay in L2, else the
        panels each wave of `concurrent` tiles touches (a GROUP_M band shares w's panels)."""
        key = (b, bm, bn, gm, concurrent)
        if key not in self._reads:
            n, k = self.n, self.k
            tn = -(-n // bn)
            total = 0.0
            for rows, count in self.groups:
                tm = max(1, -(-rows // bm))
                ws = (rows * k + k * n) * b
                if ws > dev.l2_bytes // 2:
                    band = min(tm, max(min(gm, tm), -(-concurrent // tn)))
                    cols = min(tn, -(-concurrent // band))
                    waves = -(-(tm * tn) // concurrent)
                    ws = max(ws, waves * (band * bm + cols * bn) * k * b)
                total += ws * count
            self._reads[key] = total
        return self._reads[key]


def _gemm_estimate(dev: Device, cls: str, out_bytes: int, c: Config, groups: _Groups,
                   persistent: bool) -> Estimate:
    b = _BYTES[cls]
    n, k = groups.n, groups.k
    smem, regs = shared_memory(dev, cls, c), registers(dev, cls, c)
    occupancy = 1 if persistent else max(1, _occupancy(dev, c, smem, regs))
    path = mma_path(dev, cls, c)
    tn = -(-n // c.block_n)
    row_tiles = groups.row_tiles(c.block_m)
    tiles = row_tiles * tn
    k_pad = -(-k // c.block_k) * c.block_k
    useful = 2.0 * groups.tokens * n * k
    padded = 2.0 * row_tiles * c.block_m * tn * c.block_n * k_pad

    # one tile on a whole SM/CU
    peak_unit = _peak(dev, cls) / dev.units
    # an SM has 4 sub-partitions (a CU 4 SIMDs), each with its own matrix unit: fewer
    # than 4 resident warps leave some idle
    lanes = min(1.0, occupancy * c.num_warps / 4)
    mma = 2.0 * c.block_m * c.block_n * k_pad / (
        peak_unit * lanes * _path_efficiency(dev, path)
        * _pipeline_efficiency(dev, c.num_stages, occupancy))
    reads = 1 if path in ("wgmma", "tcgen05") else 2  # warps re-read operand panels
    clock = dev.clock_ghz * 1e9
    operand = reads * (c.block_m + c.block_n) * k_pad * b / (128 * clock)  # 128 B/clk/unit
    loop = (k_pad // c.block_k) * (30 if dev.vendor == "cuda" else 50) / clock
    fixed = (0.8e-6 if dev.vendor == "cuda" else 1.2e-6) + (
        c.block_m * c.block_n * out_bytes / (dev.dram_tbs * 1e12 / dev.units))
    per_tile = max(mma, operand) + loop + fixed
    busiest = -(-tiles // dev.units)  # tiles the busiest unit runs: the wave quantization
    compute = busiest * per_tile
    slots = dev.units * occupancy
    waves = -(-tiles // slots) if tiles else 0

    concurrent = max(1, min(tiles, slots))
    dram_bytes = (groups.dram_reads(dev, b, c.block_m, c.block_n, c.group_m, concurrent)
                  + groups.tokens * n * out_bytes)
    dram = dram_bytes / (dev.dram_tbs * 1e12 * (0.9 if dev.vendor == "cuda" else 0.8))
    l2 = tiles * (c.block_m + c.block_n) * k_pad * b / (dev.l2_tbs * 1e12)
    return Estimate(c, max(compute, dram, l2), compute, dram, l2, busiest * (loop + fixed), tiles,
                    waves, tiles / (waves * slots) if waves else 1.0, occupancy, smem, regs, path,
                    useful, padded)


def _stream_estimate(dev: Device, c: Config, programs: int, bytes_per_program: float,
                     round_bytes: float, overhead_s: float, vector_bytes: float) -> Estimate:
    """A memory-bound kernel of `programs` blocks, each moving `bytes_per_program`, with
    `round_bytes` of loads in flight per block at a time (Little's law: the bandwidth
    reached is at most the bytes in flight over the memory latency)."""
    threads = c.num_warps * dev.warp_size
    occupancy = max(1, min(2048 // threads, 32))
    slots = dev.units * occupancy
    waves = -(-programs // slots)
    bw = dev.dram_tbs * 1e12 * (0.9 if dev.vendor == "cuda" else 0.8)
    latency = 0.8e-6 if dev.vendor == "cuda" else 1.2e-6
    # a unit pulls at most ~2x its share; narrow (sub-16-byte) accesses issue more loads
    unit_bw = 2 * bw / dev.units * min(1.0, vector_bytes / 16)
    in_flight = min(programs, slots) * round_bytes
    reached = min(bw, in_flight / latency, min(dev.units, programs) * unit_bw)
    total = programs * bytes_per_program
    # each wave of blocks also pays for being scheduled (~40 cycles)
    time = latency + total / reached + waves * (overhead_s + 0.02e-6)
    dram = total / bw
    return Estimate(c, time, time - dram, dram, 0.0, time - total / reached, programs, waves,
                    programs / (waves * slots) if waves else 1.0, occupancy, 0, 0.0, "vector")


# -- candidates and ranking ------------------------------------------------------------------------

def _pow2_range(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _gemm_candidates(dev: Device, rows_max: int, n: int, k: int) -> Iterable[Config]:
    bms = [v for v in (16, 32, 64, 128, 256) if v <= max(16, 2 * _next_pow2(rows_max))]
    bns = [v for v in (16, 32, 64, 128, 256) if v <= max(16, 2 * _next_pow2(n))]
    bks = [v for v in (16, 32, 64, 128, 256) if v <= max(16, _next_pow2(k))]
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
                             f"for {_dtype_name(dtype)}; float8 needs sm_90+ or gfx942+")
    out_bytes = _BYTES[dtype_class(out_dtype)] if out_dtype is not None else (
        2 if cls == "fp8" else _BYTES[cls])
    if kind == "gemm":
        rows, counts = np.array([max(m, 1)]), np.array([1])
    else:
        rows, counts = _group_rows(m, num_experts, group_sizes)
    groups = _Groups(rows, counts, max(n, 1), max(k, 1))
    persistent = kind == "grouped_gemm"
    out = []
    for c in _gemm_candidates(dev, groups.max_rows, groups.n, groups.k):
        if illegal_reason(kind, c, dev, dtype, input_precision) is None:
            out.append(_gemm_estimate(dev, cls, out_bytes, c, groups, persistent))
    return out


def _elem_bytes(dtype) -> int:
    name = _dtype_name(dtype)
    if name in _DTYPE_CLASS:
        return _BYTES[_DTYPE_CLASS[name]]
    return int(np.dtype(name).itemsize)


def _rank_pointwise(dev, m, n, dtype):
    elements = REPRESENTATIVE["elements"] if m is None else max(1, int(m))
    streams = 2 if n is None else max(1, int(n))
    b = _elem_bytes(dtype)
    out = []
    for block, w in itertools.product(_pow2_range(64, 8192), (1, 2, 4, 8, 16)):
        c = Config(block, 1, 1, 1, w, 1)
        if block > max(64, 2 * _next_pow2(elements)) or illegal_reason("pointwise", c, dev) is not None:
            continue
        per_thread = block / (w * dev.warp_size)
        reads = max(1, streams - 1)
        out.append(_stream_estimate(dev, c, -(-elements // block), block * b * streams,
                                    block * b * reads, 0.0, per_thread * b))
    return out


def _rank_reduction(kind, dev, m, k, dtype):
    rows = 1 if kind == "reduction_full" else (REPRESENTATIVE["m"] if m is None else max(1, int(m)))
    length = REPRESENTATIVE["k"] if k is None else max(1, int(k))
    b = _elem_bytes(dtype)
    clock = dev.clock_ghz * 1e9
    out = []
    for x, r, w in itertools.product(_pow2_range(1, 128), _pow2_range(16, 16384), (1, 2, 4, 8, 16)):
        if x > _next_pow2(rows) or r > max(16, _next_pow2(length)):
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
        out.append(_stream_estimate(dev, c, -(-rows // x), x * length * b, x * min(r, length) * b,
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
            benchmark = _default_benchmark(kind, m, n, k, dtype, dev, num_experts, group_sizes,
                                           out_dtype, input_precision)
        best = autotune(configs[:candidates], benchmark, key=key)
        configs = [best] + [c for c in configs if c != best]
    elif key is not None:
        tuned = load_choice(key)
        if tuned is not None and tuned in configs:
            configs = [tuned] + [c for c in configs if c != tuned]
    return configs[:top] if top else configs


def size_bucket(*sizes: int | None) -> tuple:
    """Sizes rounded up to powers of two: one tuning result serves a bucket of shapes."""
    return tuple(None if s is None else _next_pow2(int(s)) for s in sizes)


def tuning_key(kernel_key: str, kind: str, m, n, k, dtype, target: str | Device, *,
               num_experts=None, input_precision: str = "ieee") -> str:
    """The artifact-cache key of a tuned choice: kernel hash, size bucket, target."""
    from kiln.codegen import artifact_cache

    dev = device_model(target)
    return artifact_cache.content_key(
        "kiln-tiles/1", kernel_key, kind, repr(size_bucket(m, n, k, num_experts)),
        _dtype_name(dtype), input_precision, dev.arch, dev.name)


def load_choice(key: str) -> Config | None:
    from kiln.codegen import artifact_cache

    blob = artifact_cache.load(key, "tiles")
    if blob is None:
        return None
    try:
        return Config(**json.loads(blob)["config"])
    except (ValueError, TypeError, KeyError):
        return None


def store_choice(key: str, config: Config, seconds: float) -> None:
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


def _default_benchmark(kind, m, n, k, dtype, dev, num_experts, group_sizes, out_dtype,
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
            f"max-autotune measures candidate tile configs on a GPU, and this machine has none "
            f"(torch.cuda.is_available() is False)",
            hint="use mode='default' (the analytical selector needs no GPU), or run on a machine "
                 "with an NVIDIA or AMD GPU and a CUDA/ROCm build of torch")
    if kind not in GEMM_KINDS:
        raise KilnArgumentError(f"max-autotune of {kind} kernels needs benchmark=: a callable "
                                "that launches the kernel with a config and returns seconds")
    from kiln.codegen.triton.grouped_gemm import make_benchmark

    experts = 1 if kind == "gemm" else (num_experts or (len(group_sizes) if group_sizes is not None else 1))
    return make_benchmark(m, n, k, dtype, experts, group_sizes=group_sizes, out_dtype=out_dtype,
                          input_precision=input_precision)


# -- explaining ---------------------------------------------------------------------------------------

def explain(kind: str, m, n=None, k=None, dtype="float16", target: str | Device = "sm_90", *,
            top: int = 8, **kwargs) -> str:
    """A table of the best `top` configs and the model's time breakdown for each."""
    dev = device_model(target)
    ests = rank(kind, m, n, k, dtype, dev, **kwargs)
    sizes = f"m={m} n={n} k={k}" + "".join(f" {a}={v}" for a, v in kwargs.items()
                                           if a in ("num_experts",) and v is not None)
    lines = [f"tile selector: {kind} {sizes} {_dtype_name(dtype)} on {dev.name} ({dev.arch}, "
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
