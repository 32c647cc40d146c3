"""Block sizes, warps and pipeline stages for a generated kernel: `_tiles`.

Float GEMMs take the analytical tile selector's first choice
(kiln/codegen/triton/tile_selector.py: rooflines, wave quantization, shared-memory and
register limits of the target). Pointwise kernels, reductions and integer GEMMs use
fixed, sensible defaults of the kind TorchInductor and Triton's tutorials use, shrunk to
the problem where a size is static: their block shapes also decide the emitted form
(persistent or looped reduction), which the emitter owns. The emitter reads only the
returned `Tiles`.

Kinds and what m, n, k mean:

    pointwise          m = elements (outer points)
    reduction_inner    m = rows, k = reduced elements, contiguous along the reduction
    reduction_outer    m = rows, k = reduced elements, contiguous along the rows
    reduction_full     k = reduced elements (one row)
    gemm               m, n, k of the product

A size is None where it is symbolic. Reductions of at most `PERSISTENT_MAX` static
elements are persistent (one block holds the whole row, read once); larger or
symbolic ones loop over the row in RBLOCK chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PERSISTENT_MAX = 4096  # reduced elements one block holds in registers
_MAX_WARPS = 8


@dataclass(frozen=True)
class Tiles:
    """blocks: the constexpr block sizes by name (XBLOCK/RBLOCK or BLOCK_M/N/K, GROUP_M)."""

    blocks: dict = field(hash=False)
    num_warps: int = 4
    num_stages: int = 3


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cap(block: int, size: int | None, floor: int = 1) -> int:
    """`block`, shrunk to the power of two covering a static `size` (not below `floor`)."""
    return block if size is None else max(floor, min(block, next_pow2(size)))


def _warps(elements: int) -> int:
    # ~256 elements per warp keeps 8 values per thread in flight: enough loads to hide
    # latency without spilling
    return max(1, min(_MAX_WARPS, next_pow2(elements // 256)))


def _tiles(kind: str, m: int | None, n: int | None, k: int | None, dtype, target: str) -> Tiles:
    """The block configuration of one kernel (see the module docstring)."""
    amd = target.startswith("gfx")
    stages = 2 if amd else 3  # AMD's stream-pipeliner wants 2; NVIDIA's cp.async 3
    if kind == "pointwise":
        xblock = _cap(1024, m, 16)
        return Tiles({"XBLOCK": xblock}, _warps(xblock), 1)
    if kind in ("reduction_inner", "reduction_full"):
        persistent = k is not None and k <= PERSISTENT_MAX
        rblock = next_pow2(k) if persistent else 2048
        rblock = max(rblock, 16)
        # small rows: several per program so a block still has ~1024 elements
        xblock = 1 if kind == "reduction_full" else _cap(max(1, 1024 // rblock), m)
        return Tiles({"XBLOCK": xblock, "RBLOCK": rblock}, _warps(xblock * rblock), 1)
    if kind == "reduction_outer":
        # rows are contiguous: a wide XBLOCK makes each load a coalesced row segment
        xblock = _cap(64, m, 16)
        persistent = k is not None and k * xblock <= PERSISTENT_MAX
        rblock = max(2, next_pow2(k)) if persistent else 16
        return Tiles({"XBLOCK": xblock, "RBLOCK": rblock}, _warps(xblock * rblock), 1)
    if kind == "gemm":
        if getattr(dtype, "is_floating", False):
            from kiln.codegen.triton.tile_selector import select_tiles

            best = select_tiles("gemm", m, n, k, dtype, target)[0]
            return Tiles(best.blocks("gemm"), best.num_warps, best.num_stages)
        return _gemm_tiles(m, n, k, dtype, stages)  # integer GEMMs: outside the model
    raise ValueError(f"unknown kernel kind {kind!r}")


def _gemm_tiles(m, n, k, dtype, stages: int) -> Tiles:
    short = getattr(dtype, "short", dtype)
    if short in ("f16", "bf16", "f8e4m3fn", "f8e5m2", "i8"):
        bm, bn, bk, warps = 128, 128, 64, 8  # tensor cores: wgmma / MFMA-sized tiles
    elif short == "f32":
        bm, bn, bk, warps = 64, 64, 32, 4  # IEEE float32 runs on FMA units
    elif short == "f64":
        bm, bn, bk, warps = 64, 64, 16, 4
    else:  # other integers: the broadcast-multiply path holds a BM x BK x BN product
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    bm, bn, bk = _cap(bm, m, 16), _cap(bn, n, 16), _cap(bk, k, 16)
    if bm * bn <= 64 * 64:
        warps = min(warps, 4)
    return Tiles({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, warps, stages)
