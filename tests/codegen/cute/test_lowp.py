"""Low precision: kn.quantize_fp8 / quantize_mxfp8 / quantize_nvfp4 and kn.scaled_matmul
against independent oracles (torch's float8 casts, an enumerated e2m1 table, float64
products), the quantize -> matmul -> epilogue path, clear errors (K420, K421), and the
scaled fp8 GEMM compiled for sm_90a and sm_100a with its scale operands in the PTX."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kiln as kn
from kiln.codegen.cute.compile import compile_gemm
from kiln.codegen.kernel_ir import IN, Acc, BufferParam, Load, Op
from kiln.errors import KilnQuantizeError, KilnScaledMatmulError
from kiln.ir import dtypes as dt
from tests.codegen.cute.gemms import f32, gemm, gi, gj

T8 = {dt.float8_e4m3fn: torch.float8_e4m3fn, dt.float8_e5m2: torch.float8_e5m2}


def data(m, k, seed, spread=3.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)) * np.exp(rng.uniform(-spread, spread, (m, 1)))).astype(np.float32)


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype", [dt.float8_e4m3fn, dt.float8_e5m2])
@pytest.mark.parametrize("per_row", [False, True])
def test_quantize_fp8_matches_torch(dtype, per_row):
    x = data(24, 40, 0)
    x[3] = 0.0  # a zero row gets scale 1
    q, s = kn.quantize_fp8(x, dtype, per_row=per_row)
    t = torch.from_numpy(x)
    amax = t.abs().amax(dim=1) if per_row else t.abs().amax()
    fmax = torch.finfo(T8[dtype]).max
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    ref = (t / (scale[:, None] if per_row else scale)).clamp(-fmax, fmax).to(T8[dtype])
    np.testing.assert_array_equal(bits(q.numpy()), ref.view(torch.uint8).numpy())
    np.testing.assert_array_equal(s.numpy(), scale.numpy())
    back = q.numpy().astype(np.float32) * (s.numpy()[:, None] if per_row else s.numpy())
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -(4 if dtype == dt.float8_e4m3fn else 3) + 1e-30)


def test_quantize_mxfp8_matches_the_ocp_rule():
    x = data(8, 96, 1)
    x[2, 32:64] = 0.0
    q, s = kn.quantize_mxfp8(x)
    assert q.dtype == kn.float8_e4m3fn and s.dtype == kn.uint8 and s.shape == (8, 3)
    for i in range(8):
        for blk in range(3):
            block = x[i, 32 * blk:32 * (blk + 1)]
            amax = float(np.abs(block).max())
            exp = math.frexp(amax)[1] - 1 - 8 if amax else 0  # floor(log2 amax) - emax(e4m3)
            assert int(s.numpy()[i, blk]) == exp + 127
            ref = (torch.from_numpy(block) / 2.0 ** exp).clamp(-448, 448).to(torch.float8_e4m3fn)
            np.testing.assert_array_equal(bits(q.numpy()[i, 32 * blk:32 * (blk + 1)]), ref.view(torch.uint8).numpy())


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_code(v: float) -> int:
    """Nearest e2m1 value by enumeration, ties to the even code, saturating at 6; the sign
    kept as a cast keeps it (a small negative value becomes -0)."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - mag), c & 1))
    return best | (8 if v < 0 else 0)


def test_quantize_nvfp4_matches_an_enumerated_e2m1_table():
    x = data(6, 64, 2)
    x[0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 7.0, 0, 0.1, -0.1, 6.0, 1.0, 3.0]
    q, block, tensor = (v.numpy() for v in kn.quantize_nvfp4(x))
    assert q.shape == (6, 32) and block.shape == (6, 4) and block.dtype == kn.float8_e4m3fn.np_dtype
    t = np.float32(np.abs(x).max() / np.float32(6 * 448))
    assert tensor == t
    for i in range(6):
        for blk in range(4):
            vals = x[i, 16 * blk:16 * (blk + 1)]
            bs = torch.tensor(float(np.abs(vals).max() / np.float32(6) / t), dtype=torch.float32)
            bs = bs.clamp(0, 448).to(torch.float8_e4m3fn)
            assert bits(block[i, blk:blk + 1])[0] == bs.view(torch.uint8).item()
            eff = np.float32(bs.float().item()) * t
            for j, v in enumerate(vals):
                col = 16 * blk + j
                code = (q[i, col // 2] >> (4 * (col % 2))) & 0xF
                assert code == e2m1_code(float(np.float32(v) / eff)), (i, col, v)


def dequant_fp8(q, s, axis):
    s = np.asarray(s, np.float64)
    return np.asarray(q).astype(np.float64) * (np.expand_dims(s, axis) if s.ndim else s)


@pytest.mark.parametrize("out", [kn.float32, kn.bfloat16, kn.float16])
def test_scaled_matmul_fp8_rounds_like_the_kernel(out):
    a, b = data(16, 64, 3), data(64, 24, 4, spread=1.0)
    qa, sa = kn.quantize_fp8(a, per_row=True)
    qb, sb = kn.quantize_fp8(b, kn.float8_e5m2)
    y = kn.scaled_matmul(qa, qb, sa, sb, out_dtype=out).numpy()
    # torch: float64 products of the float8 values, one float32 rounding, then the scales
    acc = (torch.from_numpy(qa.numpy().astype(np.float32)).double()
           @ torch.from_numpy(qb.numpy().astype(np.float32)).double()).float()
    ref = acc * torch.from_numpy(sa.numpy())[:, None] * torch.from_numpy(sb.numpy())
    ref = ref.to({kn.float32: torch.float32, kn.bfloat16: torch.bfloat16, kn.float16: torch.float16}[out])
    np.testing.assert_array_equal(y.astype(np.float32), ref.float().numpy())
    # and it is the product of the dequantized operands, to the precision of the format
    exact = dequant_fp8(qa.numpy(), sa.numpy(), 1) @ dequant_fp8(qb.numpy(), sb.numpy(), 0)
    np.testing.assert_allclose(y.astype(np.float64), exact, rtol=2e-2, atol=1e-6 * np.abs(exact).max())


def test_scaled_matmul_block_scaled_formats():
    a, w = data(8, 64, 5), data(12, 64, 6)
    qa, sa = kn.quantize_mxfp8(a)
    qb, sb = kn.quantize_mxfp8(w)  # the [N, K] weight layout
    y = kn.scaled_matmul(qa, qb, sa, sb, out_dtype=kn.float32).numpy()
    deq = lambda q, s: q.astype(np.float64) * np.repeat(np.ldexp(1.0, s.astype(np.int64) - 127), 32, axis=1)  # noqa: E731
    ref = (deq(qa.numpy(), sa.numpy()) @ deq(qb.numpy(), sb.numpy()).T).astype(np.float32)
    np.testing.assert_array_equal(y, ref)
    np.testing.assert_allclose(y, a @ w.T, rtol=0.1, atol=0.05 * np.abs(a @ w.T).max())

    qa, ba, ta = kn.quantize_nvfp4(a)
    qw, bw, tw = kn.quantize_nvfp4(w)
    y = kn.scaled_matmul(qa, qw, ba, bw, out_dtype=kn.float32).numpy() * ta.numpy() * tw.numpy()

    def deq4(q, blk):
        codes = np.stack([q & 0xF, q >> 4], axis=2).reshape(q.shape[0], -1)
        vals = np.array([e2m1_code_value(c) for c in codes.ravel()]).reshape(codes.shape)
        return vals * np.repeat(blk.astype(np.float64), 16, axis=1)

    ref = (deq4(qa.numpy(), ba.numpy()) @ deq4(qw.numpy(), bw.numpy()).T).astype(np.float32)
    np.testing.assert_array_equal(y, ref * ta.numpy() * tw.numpy())
    # e2m1 keeps about one significant digit: each operand within ~9% normwise (random
    # data), so the product within the two errors combined
    for x, q, blk, t in ((a, qa, ba, ta), (w, qw, bw, tw)):
        back = deq4(q.numpy(), blk.numpy()) * float(t.numpy())
        assert np.linalg.norm(back - x) < 0.12 * np.linalg.norm(x)
    exact = a.astype(np.float64) @ w.T.astype(np.float64)
    assert np.linalg.norm(y - exact) < 0.35 * np.linalg.norm(exact)


def e2m1_code_value(c: int) -> float:
    return (-1.0 if c & 8 else 1.0) * E2M1[c & 7]


def test_quantize_matmul_epilogue_path_compiles_like_eager():
    a, b, bias = data(8, 32, 7), data(32, 16, 8, 1.0), np.linspace(-1, 1, 16, dtype=np.float32)

    def f(a, b, bias):
        qa, sa = kn.quantize_fp8(a, per_row=True)
        qb, sb = kn.quantize_fp8(b)
        y = kn.scaled_matmul(qa, qb, sa, sb, out_dtype=kn.bfloat16)
        return kn.gelu(y.to(kn.float32) + bias)

    eager = f(kn.tensor(a), kn.tensor(b), kn.tensor(bias)).numpy()
    compiled = kn.compile(f)(kn.tensor(a), kn.tensor(b), kn.tensor(bias)).numpy()
    np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-6)
    qa, sa = kn.quantize_fp8(a, per_row=True)
    qb, sb = kn.quantize_fp8(b)
    y = torch.from_numpy(kn.scaled_matmul(qa, qb, sa, sb, out_dtype=kn.bfloat16).numpy().astype(np.float32))
    ref = torch.nn.functional.gelu(y + torch.from_numpy(bias)).numpy()
    np.testing.assert_allclose(eager, ref, rtol=1e-5, atol=1e-6)


def test_errors_name_the_rule():
    with pytest.raises(KilnQuantizeError, match=r"K420.*not a multiple of the block size 16"):
        kn.quantize_nvfp4(np.ones((4, 24), np.float32))
    with pytest.raises(KilnQuantizeError, match="float8_e4m3fn or float8_e5m2"):
        kn.quantize_fp8(np.ones((4, 8), np.float32), kn.bfloat16)
    with pytest.raises(KilnQuantizeError, match=r"expected a float matrix \[M, K\]"):
        kn.quantize_mxfp8(np.ones((32,), np.float32))
    qa, sa = kn.quantize_fp8(np.ones((4, 32), np.float32), per_row=True)
    qb, sb = kn.quantize_fp8(np.ones((32, 8), np.float32))
    with pytest.raises(KilnScaledMatmulError, match=r"K421.*scale_a is f32\[3\], expected f32\[4\]"):
        kn.scaled_matmul(qa, qb, np.ones(3, np.float32), sb)
    with pytest.raises(KilnScaledMatmulError, match="must be float8"):
        kn.scaled_matmul(np.ones((4, 32), np.float32), qb, sa, sb)
    with pytest.raises(KilnScaledMatmulError, match="out_dtype must be float32, bfloat16 or float16"):
        kn.scaled_matmul(qa, qb, sa, sb, out_dtype=kn.float8_e4m3fn)
    mq, ms = kn.quantize_mxfp8(np.ones((4, 32), np.float32))
    with pytest.raises(KilnScaledMatmulError, match=r"b \(MXFP8, \[N, K\]\) is f8e4m3fn\[32, 8\]"):
        kn.scaled_matmul(mq, qb, ms, sb)  # an MXFP8 a with an fp8 b in the [K, N] layout
    nq, nb, _ = kn.quantize_nvfp4(np.ones((4, 32), np.float32))
    with pytest.raises(KilnScaledMatmulError, match=r"scale_b is f32\[\], expected f8e4m3fn\[4, 2\]"):
        kn.scaled_matmul(nq, nq, nb, sb)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_scaled_fp8_gemm_kernel_has_its_scales_in_the_ptx(arch):
    """What the cuda backend builds for scaled_matmul's fp8 form: the fp8 GEMM whose
    epilogue multiplies by scale_a[row] and scale_b[col] before rounding to bfloat16."""
    epi = Op("convert", (Op("mul", (Op("mul", (Acc(f32), Load("scale_a", gi, f32)), f32),
                                    Load("scale_b", gj, f32)), f32),), dt.bfloat16)
    k = gemm(256, 256, 256, epi, (BufferParam("scale_a", f32, (256,), IN), BufferParam("scale_b", f32, (256,), IN)),
             in_dtype=dt.float8_e4m3fn, b_rows=False, name="scaled_fp8")
    art = compile_gemm(k, arch, (128, 128))
    assert ("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" if arch == "sm_90a"
            else "tcgen05.mma.cta_group::1.kind::f8f6f4") in art.ptx
    assert art.ptx.count("ld.global.b32") >= 2 and "mul.f32" in art.ptx  # the two scale vectors
    assert art.operands == ("scale_a", "scale_b")


@pytest.mark.parametrize("fmt, kind, block", [("nvfp4", "kind::mxf4nvf4.block_scale.block16", 16),
                                              ("mxfp8", "kind::mxf8f6f4.block_scale.block32", 32)])
def test_blockscaled_kernel_has_its_scale_factors_in_the_ptx(fmt, kind, block):
    """sm_100a's block-scaled tensor-core GEMM: the scale factors arrive by TMA with the
    operands, move to tensor memory with tcgen05.cp, and the MMA reads them there."""
    from kiln.codegen.cute.compile import compile_blockscaled_gemm

    art = compile_blockscaled_gemm(fmt, 512, 256, 1024, dt.bfloat16, tensor_scale=fmt == "nvfp4")
    assert f"tcgen05.mma.cta_group::1.{kind}" in art.ptx
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in art.ptx  # SFA / SFB: shared -> tensor memory
    loads = [ln for ln in art.ptx.splitlines() if "cp.async.bulk.tensor" in ln and "shared::cta.global" in ln]
    assert len(loads) >= 4  # A, B, SFA, SFB each stage
    if fmt == "nvfp4":
        assert art.operands == ("alpha",) and "ld.global.b32" in art.ptx  # the per-tensor scales
