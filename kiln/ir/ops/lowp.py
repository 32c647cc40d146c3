"""Low precision: quantizing to fp8 / MXFP8 / NVFP4, and the scaled matrix product.

Formats (x ~ dequantized value; every scale is a *dequantization* factor):

    fp8     quantize_fp8(x [M, K], dtype, per_row) -> q f8 [M, K], scale f32 [] or [M]
            x ~ q * scale; scale = amax / max(dtype) (1 where amax is 0)
    MXFP8   quantize_mxfp8(x [M, K]) -> q f8e4m3fn [M, K], scale u8 [M, K/32]
            x ~ q * 2^(scale - 127): one power-of-two (E8M0) scale per 32 elements of a row,
            the OCP MX rule: exponent = floor(log2(block amax)) - 8 (e4m3's largest exponent)
    NVFP4   quantize_nvfp4(x [M, K]) -> q u8 [M, K/2], block f8e4m3fn [M, K/16], tensor f32 []
            x ~ e2m1(q) * block * tensor: two e2m1 codes per byte (element 2i in the low
            nibble), one e4m3 scale per 16 elements, one float32 scale per tensor
            (tensor = amax / (6 * 448), block = e4m3(block amax / 6 / tensor))

Every quantizer divides in float32 and rounds to nearest, ties to even, saturating at
the format's largest finite value, as NVIDIA's recipes (and torch.float8 casts after a
clamp) do.

    scaled_matmul(a, b, scale_a, scale_b, out_dtype) -> [M, N]
      fp8:    a f8 [M, K], b f8 [K, N], scale_a f32 [] or [M], scale_b f32 [] or [N]:
              out = (a @ b) * scale_a[:, None] * scale_b[None, :]
    The block-scaled formats take b in nn.Linear's weight layout [N, K] (K-major, as the
    tensor cores read it), both operands quantized along K by the same function:
      MXFP8:  a f8e4m3fn [M, K], b f8e4m3fn [N, K], scale_a u8 [M, K/32], scale_b u8 [N, K/32]
      NVFP4:  a u8 [M, K/2], b u8 [N, K/2], scale_a f8e4m3fn [M, K/16], scale_b [N, K/16]
      out = deq(a) @ deq(b).T (the per-tensor NVFP4 scales are the caller's: one multiply
      of the result, which a GEMM epilogue takes)

The reference models the GPU kernels' arithmetic: every dequantized value and every
product of two is exact (in float32 already, for these formats); the sum is formed in
float64 and rounded once to the float32 accumulator (a GPU sums in float32 in its own
order: compare with a tolerance of the float32 sum's error, not bitwise); fp8's
per-tensor/per-row scales are applied to the accumulator in float32, one rounding per
multiply, as the epilogue does; the result rounds once to out_dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.errors import KilnQuantizeError, KilnScaledMatmulError
from kiln.ir import dtypes as dt
from kiln.ir.registry import EXTERN, defop
from kiln.ir.shapes import dims_equal
from kiln.ir.sharding import R, Shard, Strategy, sharding_rule
from kiln.ir.types import TensorType

FP8 = (dt.float8_e4m3fn, dt.float8_e5m2)
OUT_DTYPES = (dt.float32, dt.bfloat16, dt.float16)
MX_BLOCK, NV_BLOCK = 32, 16
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def _fmax(d) -> float:
    return float(ml_dtypes.finfo(d.np_dtype).max)


def _static(op: str, x: TensorType, axis: int, block: int, exc) -> None:
    n = x.shape[axis]
    if isinstance(n, int) and n % block:
        raise exc(f"{op}: {x} has {n} elements along dim {axis}, not a multiple of the block size {block}")


def _float_matrix(op: str, x: TensorType) -> None:
    if not x.dtype.is_floating or x.rank != 2:
        raise KilnQuantizeError(f"{op}: expected a float matrix [M, K], got {x}")


# -- quantizers -----------------------------------------------------------------------------

@defop("quantize_fp8", family="lowp", kind=EXTERN, num_operands=1,
       attrs={"dtype": "float8_e4m3fn", "per_row": False}, differentiable=False)
class quantize_fp8:
    """x [M, K] float -> (q float8 [M, K], scale float32 [] or [M] with per_row), x ~ q * scale."""

    def type(op, x, *, dtype, per_row):
        _float_matrix(op, x)
        d = dt.dtype(dtype)
        if d not in FP8:
            raise KilnQuantizeError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype!r}")
        scale = TensorType(dt.float32, (x.shape[0],) if per_row else ())
        return TensorType(d, x.shape), scale

    def reference(x, *, dtype, per_row):
        d = dt.dtype(dtype)
        x32 = np.asarray(x, dtype=np.float32)
        amax = np.max(np.abs(x32), axis=1) if per_row else np.max(np.abs(x32)) if x32.size else np.float32(0)
        scale = np.where(amax > 0, np.float32(amax) / np.float32(_fmax(d)), np.float32(1)).astype(np.float32)
        div = x32 / (scale[:, None] if per_row else scale)
        q = np.clip(div, -_fmax(d), _fmax(d)).astype(d.np_dtype)
        return q, scale.reshape((x32.shape[0],) if per_row else ())


@sharding_rule("quantize_fp8")
def _quantize_fp8_sharding(spec):
    """Per-row scales: rows shard (with their scales); one per-tensor scale: whole."""
    return [Strategy((Shard(0),), (Shard(0), Shard(0)))] if spec.attrs.get("per_row") else []


@defop("quantize_mxfp8", family="lowp", kind=EXTERN, num_operands=1, differentiable=False)
class quantize_mxfp8:
    """x [M, K] float (K % 32 == 0) -> (q float8_e4m3fn [M, K], scale uint8 E8M0 codes [M, K/32])."""

    def type(op, x):
        _float_matrix(op, x)
        _static(op, x, 1, MX_BLOCK, KilnQuantizeError)
        return TensorType(dt.float8_e4m3fn, x.shape), TensorType(dt.uint8, (x.shape[0], x.shape[1] // MX_BLOCK))

    def reference(x):
        x32 = np.asarray(x, dtype=np.float32)
        m, k = x32.shape
        blocks = x32.reshape(m, k // MX_BLOCK, MX_BLOCK)
        amax = np.max(np.abs(blocks), axis=2)
        exp = np.floor(np.log2(np.where(amax > 0, amax, 1))).astype(np.int64) - 8  # e4m3's emax
        exp = np.where(amax > 0, np.clip(exp, -127, 127), 0)
        scale = np.ldexp(np.float32(1), exp).astype(np.float32)
        q = np.clip(blocks / scale[:, :, None], -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
        return q.reshape(m, k), (exp + 127).astype(np.uint8)


@sharding_rule("quantize_mxfp8")
def _quantize_mxfp8_sharding(spec):
    """Rows shard; columns too when every rank's chunk is whole blocks of 32."""
    found = [Strategy((Shard(0),), (Shard(0), Shard(0)))]
    k = spec.in_shapes[0][1]
    if spec.even(k) and (k // spec.n) % 32 == 0:
        found.append(Strategy((Shard(1),), (Shard(1), Shard(1))))
    return found


@defop("quantize_nvfp4", family="lowp", kind=EXTERN, num_operands=1, differentiable=False)
class quantize_nvfp4:
    """x [M, K] float (K % 16 == 0) -> (q uint8 [M, K/2] two e2m1 codes per byte,
    block scales float8_e4m3fn [M, K/16], tensor scale float32 [])."""

    def type(op, x):
        _float_matrix(op, x)
        _static(op, x, 1, NV_BLOCK, KilnQuantizeError)
        m, k = x.shape
        return (TensorType(dt.uint8, (m, k // 2)), TensorType(dt.float8_e4m3fn, (m, k // NV_BLOCK)),
                TensorType(dt.float32, ()))

    def reference(x):
        x32 = np.asarray(x, dtype=np.float32)
        m, k = x32.shape
        amax = np.float32(np.max(np.abs(x32))) if x32.size else np.float32(0)
        tensor = np.float32(amax / np.float32(E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1)
        blocks = x32.reshape(m, k // NV_BLOCK, NV_BLOCK)
        block_amax = np.max(np.abs(blocks), axis=2)
        block = np.clip(block_amax / np.float32(E2M1_MAX) / tensor, 0, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
        eff = block.astype(np.float32) * tensor
        safe = np.where(eff > 0, eff, np.float32(1))[:, :, None]
        vals = np.where(eff[:, :, None] > 0, blocks / safe, 0)
        codes = np.clip(vals, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
        codes = codes.reshape(m, k)
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), block, np.float32(tensor).reshape(())


sharding_rule("quantize_nvfp4")(lambda spec: [])  # the per-tensor scale covers every element


# -- dequantizing (what the kernels compute with) --------------------------------------------

_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def unpack_nvfp4(q: np.ndarray) -> np.ndarray:
    """The float32 values of packed e2m1 codes: [M, K/2] uint8 -> [M, K]."""
    q = np.asarray(q, dtype=np.uint8)
    out = np.empty((q.shape[0], q.shape[1] * 2), dtype=np.float32)
    out[:, 0::2] = _E2M1[q & 0xF]
    out[:, 1::2] = _E2M1[q >> 4]
    return out


def dequantize(kind: str, q: np.ndarray, scale: np.ndarray, axis: int) -> np.ndarray:
    """Exact float64 values of a block-scaled operand; `axis` is its K axis."""
    if kind == "nvfp4":
        values = unpack_nvfp4(q).astype(np.float64)
        block = NV_BLOCK
        factors = np.asarray(scale).astype(np.float64)
    else:
        values = np.asarray(q).astype(np.float64)
        block = MX_BLOCK
        factors = np.ldexp(1.0, np.asarray(scale).astype(np.int64) - 127)
    return values * np.repeat(factors, block, axis=axis)


def _mode(op: str, a, b, sa, sb) -> str:
    if a.dtype == dt.uint8:
        return "nvfp4"
    if a.dtype not in FP8 or b.dtype not in FP8:
        raise KilnScaledMatmulError(f"{op}: a {a} and b {b} must be float8 (fp8 / MXFP8) or uint8 "
                                    "packed e2m1 (NVFP4, from kn.quantize_nvfp4)")
    return "mxfp8" if sa.dtype == dt.uint8 else "fp8"


def _want(op: str, what: str, t: TensorType, dtype, shape) -> None:
    ok = t.dtype == dtype and t.rank == len(shape) and all(dims_equal(x, y) for x, y in zip(t.shape, shape))
    if not ok:
        raise KilnScaledMatmulError(f"{op}: {what} is {t}, expected {dtype.short}{list(shape)}")


@defop("scaled_matmul", family="lowp", kind=EXTERN, num_operands=4, attrs={"out_dtype": "bfloat16"},
       differentiable=False)
class scaled_matmul:
    """Matrix product of quantized operands with their scales (fp8, MXFP8 or NVFP4; the
    module docstring gives the layouts) -> out_dtype [M, N]."""

    def type(op, a, b, scale_a, scale_b, *, out_dtype):
        out = dt.dtype(out_dtype)
        if out not in OUT_DTYPES:
            raise KilnScaledMatmulError(f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype!r}")
        if a.rank != 2 or b.rank != 2:
            raise KilnScaledMatmulError(f"{op}: a {a} and b {b} must be matrices")
        mode = _mode(op, a, b, scale_a, scale_b)
        m = a.shape[0]
        if mode == "nvfp4":
            _want(op, "b (NVFP4, [N, K/2])", b, dt.uint8, (b.shape[0], a.shape[1]))
            n, k = b.shape[0], a.shape[1] * 2
            _want(op, "scale_a", scale_a, dt.float8_e4m3fn, (m, k // NV_BLOCK))
            _want(op, "scale_b", scale_b, dt.float8_e4m3fn, (n, k // NV_BLOCK))
            _static(op, a, 1, NV_BLOCK // 2, KilnScaledMatmulError)
        elif mode == "mxfp8":
            n, k = b.shape[0], a.shape[1]
            _static(op, a, 1, MX_BLOCK, KilnScaledMatmulError)
            _want(op, "a (MXFP8)", a, dt.float8_e4m3fn, a.shape)
            _want(op, "b (MXFP8, [N, K])", b, dt.float8_e4m3fn, (n, k))
            _want(op, "scale_a", scale_a, dt.uint8, (m, k // MX_BLOCK))
            _want(op, "scale_b", scale_b, dt.uint8, (n, k // MX_BLOCK))
        else:
            k, n = a.shape[1], b.shape[1]
            if not dims_equal(b.shape[0], k):
                raise KilnScaledMatmulError(f"{op}: contracting dims differ: a {a}, b {b}")
            _want(op, "scale_a", scale_a, dt.float32, (m,) if scale_a.rank else ())
            _want(op, "scale_b", scale_b, dt.float32, (n,) if scale_b.rank else ())
        return TensorType(out, (m, n))

    def reference(a, b, scale_a, scale_b, *, out_dtype):
        out = dt.dtype(out_dtype).np_dtype
        if a.dtype == np.uint8:
            x, w = dequantize("nvfp4", a, scale_a, 1), dequantize("nvfp4", b, scale_b, 1)
            return (x @ w.T).astype(np.float32).astype(out)
        if np.asarray(scale_a).dtype == np.uint8:
            x, w = dequantize("mxfp8", a, scale_a, 1), dequantize("mxfp8", b, scale_b, 1)
            return (x @ w.T).astype(np.float32).astype(out)
        acc = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
        sa = np.asarray(scale_a, dtype=np.float32)
        sb = np.asarray(scale_b, dtype=np.float32)
        acc = acc * (sa[:, None] if sa.ndim else sa)
        acc = acc * (sb[None, :] if sb.ndim else sb)
        return acc.astype(np.float32).astype(out)


@sharding_rule("scaled_matmul")
def _scaled_matmul_sharding(spec):
    """Rows of a (with their scales), or the result's columns through b (with its);
    no contraction split: each partial product would round to out_dtype before the sum."""
    _, _, sa, sb = spec.in_shapes
    s0, s1 = Shard(0), Shard(1)
    if len(sa) == 2:  # block scaled: a [M, .], b [N, .] (K-major), scales along K
        return [Strategy((s0, R, s0, R), (s0,)), Strategy((R, s0, R, s0), (s1,))]
    row = s0 if len(sa) == 1 else R  # fp8: per-row or per-tensor scales
    col = s0 if len(sb) == 1 else R
    return [Strategy((s0, R, row, R), (s0,)), Strategy((R, s1, R, col), (s1,))]
