"""The tile selector's time model: an Estimate (seconds, with its breakdown) of one
config from the GPU model (gpu_model.py); the model ranks, it does not promise absolute
times.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.codegen.triton.gpu_model import (
    DTYPE_BYTES, Config, Device, mma_path, registers, resident_blocks, shared_memory,
)


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


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
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


class RowGroups:
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


def gemm_estimate(dev: Device, cls: str, out_bytes: int, c: Config, groups: RowGroups,
                  persistent: bool) -> Estimate:
    """The time of a (grouped) GEMM of `groups` with config c; a persistent kernel keeps
    one block per unit."""
    b = DTYPE_BYTES[cls]
    n, k = groups.n, groups.k
    smem, regs = shared_memory(dev, cls, c), registers(dev, cls, c)
    occupancy = 1 if persistent else max(1, resident_blocks(dev, c, smem, regs))
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


def stream_estimate(dev: Device, c: Config, programs: int, bytes_per_program: float,
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
