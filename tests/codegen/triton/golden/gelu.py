# ---- kernel gelu_loop_0 (target cuda, sm_90) ----
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def kiln_gelu_loop_0(in0, out0, size_B, XBLOCK: tl.constexpr):
    """pointwise over i0 < 4096*B"""
    xnumel = 4096*size_B
    xoffset = tl.program_id(0).to(tl.int64) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)
    xmask = xindex < xnumel
    i0 = xindex
    t0 = tl.load(in0 + i0, mask=xmask, other=0)
    t1 = t0 * 0.5
    t2 = t0 * 0.7071067690849304
    t3 = libdevice.erf(t2)
    t4 = t3 + 1.0
    t5 = t1 * t4
    tl.store(out0 + i0, t5, mask=xmask)
