# ---- kernel column_sum_reduction_0 (target cuda, sm_90) ----
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def kiln_column_sum_reduction_0(in0, out0, size_N, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """reduction outer: parallel o0 < 256; inner r0 < N (looped over RBLOCK chunks)"""
    xnumel = 256
    xoffset = tl.program_id(0).to(tl.int64) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    o0 = xindex
    rnumel = size_N
    _acc0 = tl.full([XBLOCK, RBLOCK], 0.0, tl.float32)
    for roffset in range(0, rnumel, RBLOCK):
        rindex = roffset + tl.arange(0, RBLOCK)[None, :]
        rmask = rindex < rnumel
        r0 = rindex
        t0 = tl.load(in0 + (o0 + 256*r0), mask=rmask, other=0)
        _acc0 = tl.where(rmask, _acc0 + t0, _acc0)
    acc0 = tl.sum(_acc0, 1)[:, None]
    tl.store(out0 + o0, acc0)
