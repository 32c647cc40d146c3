# ---- kernel mlp_gemm_0 (target cuda, sm_90) ----
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def kiln_mlp_gemm_0(in0, in1, in2, out0, size_B, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """gemm [1] x [B, 512] @ [512, 1024] with the epilogue fused"""
    M = size_B
    N = 1024
    K = 512
    pid = tl.program_id(0).to(tl.int64)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row-blocks in a row reuse the same B column-blocks from L2
    width = GROUP_M * grid_n
    group = pid // width
    group_size = tl.minimum(grid_m - group * GROUP_M, GROUP_M)
    pid_m = group * GROUP_M + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ram = rm % M
    rbn = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
    a_ptrs = in0 + (ram[:, None] * 512 + rk[None, :])
    b_ptrs = in1 + (rk[:, None] * 1024 + rbn[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * 1024
    gi = rm[:, None]
    gj = rn[None, :]
    t0 = acc.to(tl.float16).to(tl.float32)
    t1 = tl.load(in2 + gj).to(tl.float32)
    t2 = (t0 + t1).to(tl.float16).to(tl.float32)
    t3 = t2 * 0.5
    t4 = t2 * t2
    t5 = t4 * t2
    t6 = t5 * 0.044714998453855515
    t7 = t2 + t6
    t8 = t7 * 0.7978845834732056
    t9 = libdevice.tanh(t8)
    t10 = t9 + 1.0
    t11 = t3 * t10
    t12 = t11.to(tl.float16).to(tl.float32)
    tl.store(out0 + (1024*gi + gj), t12, mask=gi < M)
