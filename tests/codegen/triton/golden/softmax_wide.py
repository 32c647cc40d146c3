# ---- kernel softmax_wide_reduction_0 (target cuda, sm_90) ----
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _kiln_maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def kiln_softmax_wide_reduction_0(in0, out0, size_B, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """reduction inner: parallel o0 < B; inner r0 < 32000 (looped over RBLOCK chunks)"""
    xnumel = size_B
    xoffset = tl.program_id(0).to(tl.int64) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    o0 = xindex
    rnumel = 32000
    _acc0 = tl.full([XBLOCK, RBLOCK], -float("inf"), tl.float32)
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        rmask = rindex < rnumel
        r0 = rindex
        t0 = tl.load(in0 + (32000*o0 + r0), mask=xmask & rmask, other=0).to(tl.float32)
        _acc0 = tl.where(rmask, tl.maximum(_acc0, t0, propagate_nan=tl.PropagateNan.ALL), _acc0)
    acc0 = tl.reduce(_acc0, 1, _kiln_maximum)[:, None]
    _acc1 = tl.full([XBLOCK, RBLOCK], 0.0, tl.float32)
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        rmask = rindex < rnumel
        r0 = rindex
        t1 = tl.load(in0 + (32000*o0 + r0), mask=xmask & rmask, other=0).to(tl.float32)
        t2 = t1 - acc0
        t3 = libdevice.exp(t2)
        _acc1 = tl.where(rmask, _acc1 + t3, _acc1)
    acc1 = tl.sum(_acc1, 1)[:, None]
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        rmask = rindex < rnumel
        r0 = rindex
        t4 = tl.load(in0 + (32000*o0 + r0), mask=xmask & rmask, other=0).to(tl.float32)
        t5 = t4 - acc0
        t6 = libdevice.exp(t5)
        t7 = tl.div_rn(t6, acc1)
        t8 = t7.to(tl.bfloat16).to(tl.float32)
        tl.store(out0 + (32000*o0 + r0), t8, mask=xmask & rmask)
