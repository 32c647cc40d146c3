"""Sharding rules of the low-precision ops (kiln/ir/ops/lowp.py): quantizers and the
scaled matrix product.

A quantizer's scale is computed over what it covers, so a dim may be cut only where
the scale does not reach across it: rows for per-row fp8 and for the block formats
(MXFP8 scales 32 elements of a row, NVFP4 16, but NVFP4's per-tensor scale and fp8's
per-tensor scale cover everything: replicated only); MXFP8's columns too, when every
rank's chunk is whole blocks of 32. The scaled matmul splits rows of `a` (with their
scales) and the columns of the result through `b` (with its scales); a contraction
split would round each partial product to `out_dtype` before summing, so there is none.
"""

from __future__ import annotations

from kiln.distributed.placements import Shard
from kiln.distributed.sharding.strategy import R, OpSpec, Strategy, rule

S0, S1 = Shard(0), Shard(1)


@rule("quantize_fp8")
def quantize_fp8(spec: OpSpec) -> list[Strategy]:
    if not spec.attrs.get("per_row"):
        return []  # one scale for the whole tensor
    return [Strategy((S0,), (S0, S0))]


@rule("quantize_mxfp8")
def quantize_mxfp8(spec: OpSpec) -> list[Strategy]:
    found = [Strategy((S0,), (S0, S0))]
    k = spec.in_shapes[0][1]
    if spec.even(k) and (k // spec.n) % 32 == 0:
        found.append(Strategy((S1,), (S1, S1)))
    return found


@rule("quantize_nvfp4")
def quantize_nvfp4(spec: OpSpec) -> list[Strategy]:
    return []  # the per-tensor scale covers every element


@rule("scaled_matmul")
def scaled_matmul(spec: OpSpec) -> list[Strategy]:
    _, _, sa, sb = spec.in_shapes
    if len(sa) == 2:  # block scaled: a [M, .], b [N, .] (K-major), scales along K
        return [Strategy((S0, R, S0, R), (S0,)), Strategy((R, S0, R, S0), (S1,))]
    row = S0 if len(sa) == 1 else R  # fp8: per-row or per-tensor scales
    col = S0 if len(sb) == 1 else R
    return [Strategy((S0, R, row, R), (S0,)), Strategy((R, S1, R, col), (S1,))]


__all__ = ["quantize_fp8", "quantize_mxfp8", "scaled_matmul"]
