# ---- kernel layer_norm_reduction_0 (target cuda, sm_90) ----
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def kiln_layer_norm_reduction_0(in0, in1, in2, out0, size_B, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """reduction inner: parallel o0 < B; inner r0 < 768 (persistent: one block per row)"""
    xnumel = size_B
    xoffset = tl.program_id(0).to(tl.int64) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    o0 = xindex
    rnumel = 768
    rindex = tl.arange(0, RBLOCK)[None, :]
    rmask = rindex < rnumel
    r0 = rindex
    t0 = tl.load(in0 + (768*o0 + r0), mask=xmask & rmask, other=0)
    acc0 = tl.sum(tl.where(rmask, t0, 0.0), 1)[:, None]
    t1 = tl.div_rn(acc0, 768.0)
    t2 = t0 - t1
    t3 = t2 * t2
    acc1 = tl.sum(tl.where(rmask, t3, 0.0), 1)[:, None]
    t4 = tl.div_rn(acc1, 768.0)
    t5 = t4 + 9.999999747378752e-06
    t6 = (1.0 / tl.sqrt(t5.to(tl.float64))).to(tl.float32)
    t7 = t2 * t6
    t8 = tl.load(in1 + r0, mask=rmask, other=0)
    t9 = t7 * t8
    t10 = tl.load(in2 + r0, mask=rmask, other=0)
    t11 = t9 + t10
    tl.store(out0 + (768*o0 + r0), t11, mask=xmask & rmask)
