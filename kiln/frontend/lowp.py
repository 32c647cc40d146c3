"""Low-precision functions: `kn.quantize_fp8`, `kn.quantize_mxfp8`, `kn.quantize_nvfp4`
and `kn.scaled_matmul` (the op definitions and formats: kiln/ir/ops/lowp.py).

    >>> x, w = kn.randn(64, 128, seed=0), kn.randn(128, 32, seed=1)
    >>> qx, sx = kn.quantize_fp8(x, per_row=True)          # e4m3 values, one scale per row
    >>> qw, sw = kn.quantize_fp8(w)                        # one scale for the tensor
    >>> kn.scaled_matmul(qx, qw, sx, sw, out_dtype=kn.bfloat16).shape
    (64, 32)
"""

from __future__ import annotations

from kiln.frontend.dispatch import apply
from kiln.frontend.functional import _tensor, to
from kiln.ir import dtypes as dt


def _floats(x):
    x = _tensor(x)
    return x if x.dtype.is_floating else to(x, dt.float32)


def quantize_fp8(x, dtype=dt.float8_e4m3fn, *, per_row: bool = False):
    """(q, scale) with x ~ q * scale: q float8 (e4m3fn or e5m2) [M, K], scale float32 per
    tensor ([]) or per row ([M]) = amax / the format's largest value; round to nearest even,
    saturating."""
    return apply("quantize_fp8", _floats(x), dtype=dt.dtype(dtype).name, per_row=bool(per_row))


def quantize_mxfp8(x):
    """(q, scale) in OCP MXFP8: q float8_e4m3fn [M, K], scale uint8 E8M0 exponents
    [M, K/32] (x ~ q * 2**(scale - 127)); K must be a multiple of 32."""
    return apply("quantize_mxfp8", _floats(x))


def quantize_nvfp4(x):
    """(q, block_scale, tensor_scale) in NVFP4: q uint8 [M, K/2] (two e2m1 codes per byte,
    element 2i in the low nibble), block_scale float8_e4m3fn [M, K/16], tensor_scale float32
    []; x ~ e2m1(q) * block_scale * tensor_scale. K must be a multiple of 16."""
    return apply("quantize_nvfp4", _floats(x))


def scaled_matmul(a, b, scale_a, scale_b, out_dtype=dt.bfloat16):
    """The matrix product of quantized operands and their scales, rounded once to out_dtype.

    fp8: a [M, K] and b [K, N] float8 with float32 scales per tensor ([]) or per row of a
    ([M]) / column of b ([N]). The block-scaled formats take b in nn.Linear's [N, K] layout,
    both operands quantized along K: MXFP8 from `quantize_mxfp8` (float8_e4m3fn values,
    uint8 E8M0 scales [M, K/32] and [N, K/32]), NVFP4 from `quantize_nvfp4` (a [M, K/2],
    b [N, K/2], their block scales; multiply the result by both tensor scales). The
    result is a_deq @ b_deq.T there. Bad combinations raise K421."""
    return apply("scaled_matmul", _tensor(a), _tensor(b), _tensor(scale_a), _tensor(scale_b),
                 out_dtype=dt.dtype(out_dtype).name)
