"""The grouped GEMM's Triton kernels and their numpy oracle (the host side that compiles
and launches them is grouped_gemm_aot.py and grouped_gemm.py, whose docstring describes
the algorithm).

`grouped_gemm_kernel`: y[rows of e] = epilogue(x[rows of e] @ w[e]) for every expert e
in one persistent launch; `grouped_gemm_dw_kernel`: the weight gradient z[e] = x_e^T @ y_e.
`reference` and `reference_dw` compute the same in float64 numpy (the tests' oracle).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

ACTIVATIONS = ("none", "relu", "silu", "gelu", "gelu_tanh")
INPUT_PRECISIONS = ("ieee", "tf32")


@triton.jit
def _activation(acc, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "silu":
        acc = acc * tl.sigmoid(acc)
    elif ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # 0.5 x (1 + tanh(u)) == x * sigmoid(2u): one exp, and no tanh (absent on some targets)
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * u)
    return acc


@triton.jit
def grouped_gemm_kernel(
        x_ptr, w_ptr, y_ptr, sizes_ptr, bias_ptr, row_scale_ptr,
        N, K, num_experts, alpha,
        stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn, stride_be,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_ROW_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    num_programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)  # this program's next work item, a global tile number
    first = 0  # global number of the current expert's first tile
    row0 = 0  # the current expert's first row of x and y
    for e in range(num_experts):
        rows_e = tl.load(sizes_ptr + e).to(tl.int32)
        tiles_m = tl.cdiv(rows_e, BLOCK_M)
        tiles_e = tiles_m * tiles_n
        # tiles are dealt round-robin, so `tile` never lags behind `first`
        while tile < first + tiles_e:
            local = tile - first
            band = GROUP_M * tiles_n
            band_m = (local // band) * GROUP_M
            band_rows = tl.minimum(tiles_m - band_m, GROUP_M)
            tile_m = band_m + (local % band) % band_rows
            tile_n = (local % band) // band_rows

            offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows within the expert
            offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            rows = (row0 + offs_m).to(tl.int64)  # T * K can pass 2^31
            mask_m = offs_m < rows_e
            mask_n = offs_n < N
            a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
            b_ptrs = (w_ptr + tl.cast(e, tl.int64) * stride_we + offs_k[:, None] * stride_wk
                      + offs_n[None, :] * stride_wn)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_left = K - k0
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk

            acc = acc * alpha
            if HAS_BIAS:
                bias = tl.load(bias_ptr + tl.cast(e, tl.int64) * stride_be + offs_n, mask=mask_n, other=0.0)
                acc = acc + bias.to(tl.float32)[None, :]
            acc = _activation(acc, ACTIVATION)
            if HAS_ROW_SCALE:
                scale = tl.load(row_scale_ptr + rows, mask=mask_m, other=0.0)
                acc = acc * scale.to(tl.float32)[:, None]
            y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
            tile += num_programs
        first += tiles_e
        row0 += rows_e


@triton.jit
def grouped_gemm_dw_kernel(
        x_ptr, y_ptr, z_ptr, sizes_ptr, K, N, num_experts,
        stride_xm, stride_xk, stride_ym, stride_yn, stride_ze, stride_zk, stride_zn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        MAX_EXPERTS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """z[e] = x_e^T @ y_e (grouped_matmul_dw, the weight gradient): z tiles of BLOCK_K x
    BLOCK_N, each summing its expert's rows BLOCK_M at a time. Every expert has the same
    number of z tiles, so the work list needs no sizes; an empty expert's tiles store zeros."""
    num_programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tl.cdiv(K, BLOCK_K) * tiles_n
    item = tl.program_id(0)
    experts = tl.arange(0, MAX_EXPERTS)
    while item < num_experts * per_expert:
        e = item // per_expert
        local = item % per_expert
        offs_k = (local // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = (local % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_k = offs_k < K
        mask_n = offs_n < N
        # the expert's first row: the sizes of the experts before it, summed in one vector op
        before = tl.load(sizes_ptr + experts, mask=experts < e, other=0).to(tl.int64)
        row0 = tl.sum(before, axis=0)
        rows_e = tl.load(sizes_ptr + e).to(tl.int32)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for m0 in range(0, rows_e, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < rows_e
            rows = row0 + offs_m.to(tl.int64)
            a = tl.load(x_ptr + rows[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                        mask=mask_k[:, None] & mask_m[None, :], other=0.0)  # x_e^T tile
            b = tl.load(y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                        mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        z_ptrs = (z_ptr + e.to(tl.int64) * stride_ze + offs_k[:, None] * stride_zk
                  + offs_n[None, :] * stride_zn)
        tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])
        item += num_programs


# -- the numpy oracle -----------------------------------------------------------------------------

def _np_activation(v: np.ndarray, activation: str) -> np.ndarray:
    if activation == "relu":
        return np.maximum(v, 0)
    if activation == "silu":
        return v / (1 + np.exp(-v))
    if activation == "gelu":
        from math import erf

        return 0.5 * v * (1 + np.vectorize(erf, otypes=[np.float64])(v / np.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
    return v


def reference(x, w, group_sizes, *, bias=None, row_scale=None, alpha: float = 1.0,
              activation: str = "none", transpose_rhs: bool = False) -> np.ndarray:
    """The kernel's result in float64 numpy (before the output cast)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    sizes = np.asarray(group_sizes, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = w.shape[1] if transpose_rhs else w.shape[2]
    y = np.zeros((x.shape[0], n))
    for e in range(len(sizes)):
        lo, hi = offsets[e], offsets[e + 1]
        v = x[lo:hi] @ (w[e].T if transpose_rhs else w[e]) * alpha
        if bias is not None:
            v = v + np.asarray(bias, np.float64)[e]
        y[lo:hi] = _np_activation(v, activation)
    if row_scale is not None:
        y = y * np.asarray(row_scale, np.float64)[:, None]
    return y


def reference_dw(x, y, group_sizes) -> np.ndarray:
    """`grouped_gemm_dw` in float64 numpy."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(group_sizes, np.int64))])
    return np.stack([x[a:b].T @ y[a:b] for a, b in zip(offsets[:-1], offsets[1:])]) \
        if len(offsets) > 1 else np.zeros((0, x.shape[1], y.shape[1]))
