# ---- kernel softmax_reduction_0 (target cuda, sm_90) ----
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _kiln_maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def kiln_softmax_reduction_0(in0, out0, size_B, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """reduction inner: parallel o0 < B; inner r0 < 1000 (persistent: one block per row)"""
    xnumel = size_B
    xoffset = tl.program_id(0).to(tl.int64) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    o0 = xindex
    rnumel = 1000
    rindex = tl.arange(0, RBLOCK)[None, :]
    rmask = rindex < rnumel
    r0 = rindex
    t0 = tl.load(in0 + (1000*o0 + r0), mask=xmask & rmask, other=0)
    acc0 = tl.reduce(tl.where(rmask, t0, -float("inf")), 1, _kiln_maximum)[:, None]
    t1 = t0 - acc0
    t2 = libdevice.exp(t1)
    acc1 = tl.sum(tl.where(rmask, t2, 0.0), 1)[:, None]
    t3 = tl.div_rn(t2, acc1)
    tl.store(out0 + (1000*o0 + r0), t3, mask=xmask & rmask)
