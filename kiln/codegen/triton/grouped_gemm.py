"""The persistent grouped GEMM of mixture-of-experts layers, in Triton, for NVIDIA and AMD.

    y[rows of e] = epilogue(x[rows of e] @ w[e])     for every expert e, in ONE launch

x [T, K] holds the tokens sorted by expert, group_sizes [E] how many rows each expert
owns (the `grouped_matmul` op of kiln/ir/ops/moe.py), w [E, K, N] (or [E, N, K]: any
strides; transpose_rhs is a stride swap). A fixed grid of programs (about one per SM or
CU) walks the work list: expert by expert, each expert's tiles numbered after the
previous expert's, program p takes tiles p, p + P, p + 2P, ... Every program reads
group_sizes and keeps the running row offset itself, so no prefix-sum kernel runs
first and the host never reads the sizes (no device-to-host sync; the sizes can come
straight from the router). Rows past an expert's end are masked, so ragged and empty
groups need no padding. Within an expert, tiles are ordered in GROUP_M-row bands
(L2 reuse of w's column panels, as Triton's matmul tutorial).

The fused epilogue runs on the float32 accumulator, in this order:

    acc * alpha  ->  + bias[e]  ->  activation  ->  * row_scale[row]  ->  cast to y's dtype

bias is per expert [E, N]; row_scale is per token [T] (the router weight, which fuses
the "combine" step of the down projection); activation is "none", "relu", "silu",
"gelu" (erf) or "gelu_tanh". Low-precision inputs accumulate in float32. float32
inputs use exact float32 products by default (input_precision="ieee", as
torch.matmul); "tf32" trades precision for tensor-core speed on NVIDIA. float8 on
Hopper wants the weights K-major, [E, N, K] with transpose_rhs=True: wgmma reads a
float8 B operand only that way, and an [E, K, N] one is transposed through registers
every K step (Triton 3.9 then pipelines only x's tiles).

`grouped_gemm_dw_kernel` is the weight gradient, z[e] = x_e^T @ y_e (kiln's
`grouped_matmul_dw`): every expert has the same number of z tiles, so its work list
needs no sizes; each tile sums its expert's rows BLOCK_M at a time.

Host side (Config from the tile selector names BLOCK_M/N/K, GROUP_M, num_warps, num_stages):

- `signature` / `constexprs` / `divisible_args`: what ahead-of-time compilation needs;
  `aot_compile_grouped_gemm(target, ...)` compiles for "sm_90", "gfx942", ... on a
  CPU-only machine through kiln/codegen/triton/aot.py.
- `grouped_gemm(x, w, group_sizes, ...)`: launches through Triton's own launcher. It
  takes torch tensors: on a GPU at run time (torch, with CUDA or ROCm, is needed there
  only to own the buffers and the stream), or CPU tensors under TRITON_INTERPRET=1 (set
  before triton is imported), which is how the tests check numerics without a GPU.
- `grouped_gemm_dw`, `aot_compile_grouped_gemm_dw`: the same for the weight gradient.
- `reference(...)`, `reference_dw(...)`: the same computations in numpy, the tests' oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.tile_selector import Config, select_tiles
from kiln.errors import KilnArgumentError, KilnDTypeError

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


# -- host side: what AOT needs -------------------------------------------------------------

@dataclass(frozen=True)
class Epilogue:
    """What the kernel applies to the accumulator before storing (see the module doc)."""

    activation: str = "none"
    bias: bool = False
    row_scale: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise KilnArgumentError(f"grouped GEMM: unknown activation {self.activation!r}; "
                                    f"the epilogue applies one of {', '.join(ACTIVATIONS)}")


# kiln / numpy / torch dtype names -> Triton's pointer element names
_TRITON_TYPES = {
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5", "int32": "i32", "int64": "i64",
}
_INPUT_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
_OUTPUT_DTYPES = ("float16", "bfloat16", "float32")

# the kernel's arguments, in order, and which are compile-time
_ARGS = ("x_ptr", "w_ptr", "y_ptr", "sizes_ptr", "bias_ptr", "row_scale_ptr",
         "N", "K", "num_experts", "alpha",
         "stride_xm", "stride_xk", "stride_we", "stride_wk", "stride_wn", "stride_ym", "stride_yn",
         "stride_be")


def dtype_name(dtype: Any) -> str:
    """"float16", "bfloat16", ... for a kiln DType, numpy dtype, torch dtype or name."""
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.replace("torch.", "")
    aliases = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16",
               "fp16": "float16", "fp32": "float32", "f16": "float16", "f32": "float32",
               "float8_e4m3": "float8_e4m3fn"}
    return aliases.get(name, name)


def _check_dtypes(dtype: str, out_dtype: str) -> None:
    if dtype not in _INPUT_DTYPES:
        raise KilnDTypeError(f"grouped GEMM: inputs of dtype {dtype} are not supported; it takes "
                             f"{', '.join(_INPUT_DTYPES)}")
    if out_dtype not in _OUTPUT_DTYPES:
        raise KilnDTypeError(f"grouped GEMM: output dtype {out_dtype} is not supported; it writes "
                             f"{', '.join(_OUTPUT_DTYPES)}")


def signature(dtype: Any, out_dtype: Any = None, *, sizes_dtype: Any = "int32",
              bias_dtype: Any = None, unit_strides: tuple[str, ...] = ()) -> dict[str, str]:
    """Triton's signature of `grouped_gemm_kernel` for inputs of `dtype` (x and w),
    writing `out_dtype` (default: `dtype`, float16 for float8 inputs). Strides named in
    `unit_strides` are compile-time 1 (contiguous dims: vector loads)."""
    dtype = dtype_name(dtype)
    out = dtype_name(out_dtype) if out_dtype is not None else _default_out(dtype)
    _check_dtypes(dtype, out)
    vector = _TRITON_TYPES[dtype_name(bias_dtype) if bias_dtype is not None else out]
    sig = {"x_ptr": f"*{_TRITON_TYPES[dtype]}", "w_ptr": f"*{_TRITON_TYPES[dtype]}",
           "y_ptr": f"*{_TRITON_TYPES[out]}", "sizes_ptr": f"*{_TRITON_TYPES[dtype_name(sizes_dtype)]}",
           "bias_ptr": f"*{vector}", "row_scale_ptr": "*fp32",
           "N": "i32", "K": "i32", "num_experts": "i32", "alpha": "fp32"}
    for name in _ARGS[10:]:
        sig[name] = "constexpr" if name in unit_strides else "i32"
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "ACTIVATION", "HAS_BIAS",
                 "HAS_ROW_SCALE", "INPUT_PRECISION"):
        sig[name] = "constexpr"
    return sig


def constexprs(config: Config, epilogue: Epilogue = Epilogue(), *, input_precision: str = "ieee",
               unit_strides: tuple[str, ...] = ()) -> dict[str, Any]:
    """The compile-time arguments: the tile shape, the epilogue, unit strides."""
    if input_precision not in INPUT_PRECISIONS:
        raise KilnArgumentError(f"grouped GEMM: input_precision must be one of "
                                f"{', '.join(INPUT_PRECISIONS)}, got {input_precision!r}")
    values = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
              "GROUP_M": config.group_m, "ACTIVATION": epilogue.activation,
              "HAS_BIAS": epilogue.bias, "HAS_ROW_SCALE": epilogue.row_scale,
              "INPUT_PRECISION": input_precision}
    values.update({name: 1 for name in unit_strides})
    return values


def unit_strides(transpose_rhs: bool = False) -> tuple[str, ...]:
    """The strides that are 1 for contiguous x, y and w ([E, K, N], or [E, N, K])."""
    return ("stride_xk", "stride_wk" if transpose_rhs else "stride_wn", "stride_yn")


def divisible_args(n: int | None = None, k: int | None = None) -> tuple[str, ...]:
    """The arguments Triton's JIT would mark divisible by 16 for these sizes: every
    pointer (allocators align to 256 bytes) and every size and row stride that is.

    Without the hint loads of 16-bit data are not vectorized and the K loop cannot be
    software-pipelined (cp.async needs 4-byte-aligned chunks)."""
    names = ["x_ptr", "w_ptr", "y_ptr", "sizes_ptr", "bias_ptr", "row_scale_ptr"]
    if n is not None and n % 16 == 0:
        names += ["N", "stride_ym", "stride_be"]
    if k is not None and k % 16 == 0:
        names += ["K", "stride_xm"]
    if n is not None and k is not None and n % 16 == 0 and k % 16 == 0:
        names += ["stride_we", "stride_wk", "stride_wn"]
    return tuple(names)


def _default_out(dtype: str) -> str:
    return "float16" if dtype.startswith("float8") else dtype


def aot_compile_grouped_gemm(target: str, dtype: Any = "float16", *, out_dtype: Any = None,
                             epilogue: Epilogue = Epilogue(), config: Config | None = None,
                             m: int = 4096, n: int = 4096, k: int = 4096, num_experts: int = 8,
                             sizes_dtype: Any = "int32", transpose_rhs: bool = False,
                             input_precision: str = "ieee"):
    """Compile the grouped GEMM for `target` ("sm_90", "gfx942", "cuda", ...) without a GPU.

    m (tokens), n, k and num_experts pick the tile config (the analytical selector's
    first choice unless `config` is given) and the divisibility hints. Returns aot's
    Artifact (`.asm["ptx"]`/`["amdgcn"]`, `.binary`, `.metadata`), cached on disk.

        >>> art = aot_compile_grouped_gemm("gfx942", "bfloat16", m=8192, n=1408, k=2048,
        ...                                 num_experts=64)          # doctest: +SKIP
        >>> "v_mfma" in art.assembly                                 # doctest: +SKIP
    """
    from kiln.codegen.triton import aot
    from kiln.codegen.triton.targets import resolve_arch

    arch = resolve_arch(target)
    dtype = dtype_name(dtype)
    out = dtype_name(out_dtype) if out_dtype is not None else _default_out(dtype)
    if config is None:
        config = select_tiles("grouped_gemm", m, n, k, dtype, arch, num_experts=num_experts,
                              out_dtype=out, input_precision=input_precision)[0]
    units = unit_strides(transpose_rhs)
    sig = signature(dtype, out, sizes_dtype=sizes_dtype, unit_strides=units)
    values = constexprs(config, epilogue, input_precision=input_precision, unit_strides=units)
    return aot.aot_compile(grouped_gemm_kernel, sig, values, arch, num_warps=config.num_warps,
                           num_stages=config.num_stages,
                           divisible_by_16=divisible_args(n, k))


_DW_ARGS = ("x_ptr", "y_ptr", "z_ptr", "sizes_ptr", "K", "N", "num_experts",
            "stride_xm", "stride_xk", "stride_ym", "stride_yn", "stride_ze", "stride_zk", "stride_zn")


def dw_config(tokens: int, k: int, n: int, num_experts: int, dtype: Any, target: Any, *,
              input_precision: str = "ieee") -> Config:
    """The tile config of `grouped_gemm_dw_kernel`, from the selector's grouped GEMM model:
    z is E groups of K rows by N columns, reduced over each expert's tokens (modelled at
    the average). Config.block_m is the kernel's BLOCK_K (z rows), block_k its BLOCK_M."""
    experts = max(1, num_experts)
    return select_tiles("grouped_gemm", experts * max(k, 1), n, max(1, tokens // experts), dtype,
                        target, group_sizes=[max(k, 1)] * experts, input_precision=input_precision)[0]


def signature_dw(dtype: Any, out_dtype: Any = None, *, sizes_dtype: Any = "int32") -> dict[str, str]:
    """Triton's signature of `grouped_gemm_dw_kernel` (x and y of `dtype`, z of
    `out_dtype`, default `dtype`); x, y and z contiguous (unit strides compile-time)."""
    dtype = dtype_name(dtype)
    out = dtype_name(out_dtype) if out_dtype is not None else _default_out(dtype)
    _check_dtypes(dtype, out)
    sig = {"x_ptr": f"*{_TRITON_TYPES[dtype]}", "y_ptr": f"*{_TRITON_TYPES[dtype]}",
           "z_ptr": f"*{_TRITON_TYPES[out]}", "sizes_ptr": f"*{_TRITON_TYPES[dtype_name(sizes_dtype)]}",
           "K": "i32", "N": "i32", "num_experts": "i32"}
    for name in _DW_ARGS[7:]:
        sig[name] = "constexpr" if name in ("stride_xk", "stride_yn", "stride_zn") else "i32"
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "MAX_EXPERTS", "INPUT_PRECISION"):
        sig[name] = "constexpr"
    return sig


def constexprs_dw(config: Config, num_experts: int, *, input_precision: str = "ieee") -> dict[str, Any]:
    if input_precision not in INPUT_PRECISIONS:
        raise KilnArgumentError(f"grouped GEMM: input_precision must be one of "
                                f"{', '.join(INPUT_PRECISIONS)}, got {input_precision!r}")
    return {"BLOCK_M": config.block_k, "BLOCK_N": config.block_n, "BLOCK_K": config.block_m,
            "MAX_EXPERTS": triton.next_power_of_2(max(num_experts, 1)),
            "INPUT_PRECISION": input_precision, "stride_xk": 1, "stride_yn": 1, "stride_zn": 1}


def aot_compile_grouped_gemm_dw(target: str, dtype: Any = "float16", *, out_dtype: Any = None,
                                config: Config | None = None, m: int = 4096, n: int = 4096,
                                k: int = 4096, num_experts: int = 8, sizes_dtype: Any = "int32",
                                input_precision: str = "ieee"):
    """`aot_compile_grouped_gemm` for the weight-gradient kernel: z [E, k, n] from
    x [m, k] and y [m, n]."""
    from kiln.codegen.triton import aot
    from kiln.codegen.triton.targets import resolve_arch

    arch = resolve_arch(target)
    if config is None:
        config = dw_config(m, k, n, num_experts, dtype, arch, input_precision=input_precision)
    divisible = ["x_ptr", "y_ptr", "z_ptr", "sizes_ptr"]  # contiguous: strides K, N, K * N, N
    if k % 16 == 0:
        divisible += ["K", "stride_xm"]
    if n % 16 == 0:
        divisible += ["N", "stride_ym", "stride_zk"]
    if k % 16 == 0 or n % 16 == 0:
        divisible.append("stride_ze")
    return aot.aot_compile(grouped_gemm_dw_kernel, signature_dw(dtype, out_dtype, sizes_dtype=sizes_dtype),
                           constexprs_dw(config, num_experts, input_precision=input_precision), arch,
                           num_warps=config.num_warps, num_stages=config.num_stages,
                           divisible_by_16=tuple(divisible))


# -- host side: launching ---------------------------------------------------------------------

def num_programs_for(device_units: int, tokens: int, num_experts: int, n: int,
                     config: Config) -> int:
    """The persistent grid: one program per SM/CU, fewer when there is less work. The
    tile count is bounded without reading the sizes: sum_e ceil(m_e / BM) is at most
    ceil(T / BM) + E."""
    bound = (triton.cdiv(tokens, config.block_m) + num_experts) * triton.cdiv(n, config.block_n)
    return max(1, min(device_units, bound))


def grouped_gemm(x, w, group_sizes, *, bias=None, row_scale=None, alpha: float = 1.0,
                 activation: str = "none", out_dtype=None, transpose_rhs: bool = False,
                 config: Config | None = None, num_programs: int | None = None,
                 input_precision: str = "ieee", target: str | None = None, out=None):
    """y = epilogue(x_e @ w[e]) per expert, one launch (torch tensors; see the module doc).

    x [T, K], w [E, K, N] ([E, N, K] with transpose_rhs), group_sizes [E] int32/int64
    summing to T (on the device: the host never reads them), bias [E, N], row_scale [T].
    config defaults to the tile selector's first choice for `target` (the GPU present,
    else "sm_90"); num_programs to one per SM/CU.

        >>> y = grouped_gemm(x, w, sizes, activation="silu")         # doctest: +SKIP
    """
    import torch

    if x.dim() != 2 or w.dim() != 3:
        raise KilnArgumentError(f"grouped GEMM: x must be [T, K] and w [E, K, N], got "
                                f"{tuple(x.shape)} and {tuple(w.shape)}")
    tokens, k = x.shape
    experts = w.shape[0]
    n = w.shape[1] if transpose_rhs else w.shape[2]
    wk, wn = (w.stride(2), w.stride(1)) if transpose_rhs else (w.stride(1), w.stride(2))
    if (w.shape[2] if transpose_rhs else w.shape[1]) != k or tuple(group_sizes.shape) != (experts,):
        raise KilnArgumentError(f"grouped GEMM: x {tuple(x.shape)}, w {tuple(w.shape)} "
                                f"(transpose_rhs={transpose_rhs}) and group_sizes "
                                f"{tuple(group_sizes.shape)} do not fit together")
    if w.dtype != x.dtype:
        raise KilnDTypeError(f"grouped GEMM: x ({x.dtype}) and w ({w.dtype}) must have one dtype")
    dtype = dtype_name(x.dtype)
    out_name = dtype_name(out_dtype) if out_dtype is not None else _default_out(dtype)
    _check_dtypes(dtype, out_name)
    Epilogue(activation)  # validates the name
    # the kernel indexes these with unit strides
    group_sizes = group_sizes.contiguous()
    if bias is not None:
        if tuple(bias.shape) != (experts, n):
            raise KilnArgumentError(f"grouped GEMM: bias must be [E, N] = {(experts, n)}, got "
                                    f"{tuple(bias.shape)}")
        bias = bias.contiguous()
    if row_scale is not None:
        if tuple(row_scale.shape) != (tokens,):
            raise KilnArgumentError(f"grouped GEMM: row_scale must be [T] = {(tokens,)}, got "
                                    f"{tuple(row_scale.shape)}")
        row_scale = row_scale.contiguous()
    if config is None:
        config = select_tiles("grouped_gemm", max(tokens, 1), n, k, dtype, target or _device_model(x),
                              num_experts=experts, out_dtype=out_name,
                              input_precision=input_precision)[0]
    if out is None:
        out = torch.empty((tokens, n), dtype=getattr(torch, out_name), device=x.device)
    elif tuple(out.shape) != (tokens, n):
        raise KilnArgumentError(f"grouped GEMM: out must be [T, N] = {(tokens, n)}, got "
                                f"{tuple(out.shape)}")
    if tokens == 0 or n == 0:
        return out
    if num_programs is None:
        num_programs = num_programs_for(_device_units(x), tokens, experts, n, config)
    if x.device.type == "cpu":
        _patch_interpreter_dot()
    grouped_gemm_kernel[(num_programs,)](
        x, w, out, group_sizes,
        bias if bias is not None else out, row_scale if row_scale is not None else out,
        n, k, experts, float(alpha),
        x.stride(0), x.stride(1), w.stride(0), wk, wn, out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, ACTIVATION=activation, HAS_BIAS=bias is not None,
        HAS_ROW_SCALE=row_scale is not None, INPUT_PRECISION=input_precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def grouped_gemm_dw(x, y, group_sizes, *, out_dtype=None, config: Config | None = None,
                    num_programs: int | None = None, input_precision: str = "ieee",
                    target: str | None = None, out=None):
    """z[e] = x_e^T @ y_e for every expert in one launch: the weight gradient of a grouped
    GEMM (kiln's `grouped_matmul_dw`). x [T, K], y [T, N], group_sizes [E] summing to T
    (read on the device); z [E, K, N] (an expert without tokens gets zeros).

        >>> dw = grouped_gemm_dw(x, grad_y, sizes)                     # doctest: +SKIP
    """
    import torch

    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or group_sizes.dim() != 1:
        raise KilnArgumentError(f"grouped GEMM dw: x must be [T, K], y [T, N] and group_sizes [E], "
                                f"got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(group_sizes.shape)}")
    if x.dtype != y.dtype:
        raise KilnDTypeError(f"grouped GEMM dw: x ({x.dtype}) and y ({y.dtype}) must have one dtype")
    tokens, k = x.shape
    n, experts = y.shape[1], group_sizes.shape[0]
    dtype = dtype_name(x.dtype)
    out_name = dtype_name(out_dtype) if out_dtype is not None else _default_out(dtype)
    _check_dtypes(dtype, out_name)
    x, y, group_sizes = x.contiguous(), y.contiguous(), group_sizes.contiguous()
    if out is None:
        out = torch.empty((experts, k, n), dtype=getattr(torch, out_name), device=x.device)
    elif tuple(out.shape) != (experts, k, n) or not out.is_contiguous():
        raise KilnArgumentError(f"grouped GEMM dw: out must be a contiguous [E, K, N] = "
                                f"{(experts, k, n)}, got {tuple(out.shape)}")
    if experts == 0 or k == 0 or n == 0:
        return out
    if config is None:
        config = dw_config(tokens, k, n, experts, dtype, target or _device_model(x),
                           input_precision=input_precision)
    items = experts * triton.cdiv(k, config.block_m) * triton.cdiv(n, config.block_n)
    if num_programs is None:
        num_programs = max(1, min(_device_units(x), items))
    if x.device.type == "cpu":
        _patch_interpreter_dot()
    values = constexprs_dw(config, experts, input_precision=input_precision)
    for unit in ("stride_xk", "stride_yn", "stride_zn"):
        del values[unit]  # the launcher passes the real (unit) strides
    grouped_gemm_dw_kernel[(num_programs,)](
        x, y, out, group_sizes, k, n, experts,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), out.stride(0), out.stride(1), out.stride(2),
        num_warps=config.num_warps, num_stages=config.num_stages, **values)
    return out


# -- kiln's `grouped_matmul` ops run by the cuda/rocm backend (the executor's externs) ----


def _device() -> str:
    from kiln.codegen.triton.runtime import interpreter_active

    return "cpu" if interpreter_active() else "cuda"  # ROCm torch names its GPUs "cuda" too


def _to_torch(array: np.ndarray, device: str):
    from kiln.codegen.triton.runtime import _torch_view
    from kiln.ir import dtypes as dt

    array = np.ascontiguousarray(array)
    tensor = _torch_view(array, dt.from_numpy(array.dtype)).reshape(array.shape)
    return tensor if device == "cpu" else tensor.to(device)


def _to_numpy(tensor, like: np.dtype) -> np.ndarray:
    import torch

    from kiln.codegen.triton.runtime import _TORCH_VIEWS
    from kiln.ir import dtypes as dt

    tensor = tensor.detach().to("cpu").contiguous()
    short = dt.from_numpy(like).short
    if short in _TORCH_VIEWS:
        return tensor.view(getattr(torch, _TORCH_VIEWS[short][0])).numpy().view(like)
    return tensor.numpy()


def run_grouped_matmul(arrays: list, attrs: dict) -> list:
    """`grouped_matmul` on numpy arrays through the persistent kernel (a GPU, or Triton's
    interpreter under TRITON_INTERPRET=1); the output has the inputs' dtype."""
    x, w, sizes = arrays
    device = _device()
    y = grouped_gemm(_to_torch(x, device), _to_torch(w, device), _to_torch(sizes, device),
                     transpose_rhs=attrs.get("transpose_rhs", False), out_dtype=dtype_name(x.dtype))
    return [_to_numpy(y, x.dtype)]


def run_grouped_matmul_dw(arrays: list, attrs: dict) -> list:
    """`grouped_matmul_dw` (per-expert x_e^T @ y_e) through the persistent kernel."""
    x, y, sizes = arrays
    device = _device()
    z = grouped_gemm_dw(_to_torch(x, device), _to_torch(y, device), _to_torch(sizes, device),
                        out_dtype=dtype_name(x.dtype))
    return [_to_numpy(z, x.dtype)]


def balanced_sizes(tokens: int, experts: int) -> np.ndarray:
    """Group sizes of `tokens` spread as evenly as possible over `experts`."""
    base, extra = divmod(int(tokens), int(experts))
    return np.array([base + (e < extra) for e in range(experts)], dtype=np.int32)


def make_benchmark(m: int, n: int, k: int, dtype: Any, num_experts: int, *, group_sizes=None,
                   out_dtype: Any = None, input_precision: str = "ieee", device: str = "cuda"):
    """A `benchmark(config) -> seconds` for max-autotune: random operands of this shape
    on the GPU, each config timed with triton.testing.do_bench (median, warm)."""
    import torch
    from triton.testing import do_bench

    name = dtype_name(dtype)
    sizes = (np.asarray(group_sizes, np.int32) if group_sizes is not None
             else balanced_sizes(m, num_experts))
    tokens = int(sizes.sum())
    gen = torch.Generator(device=device).manual_seed(0)
    load_dtype = torch.float16 if name.startswith("float8") else getattr(torch, name)
    x = torch.randn((tokens, k), device=device, dtype=load_dtype, generator=gen).to(getattr(torch, name))
    w = (torch.randn((len(sizes), k, n), device=device, dtype=load_dtype, generator=gen)
         / math.sqrt(k)).to(getattr(torch, name))
    sizes_t = torch.tensor(sizes, device=device)

    def benchmark(config: Config) -> float:
        def run():
            grouped_gemm(x, w, sizes_t, config=config, out_dtype=out_dtype,
                         input_precision=input_precision)

        return do_bench(run, warmup=5, rep=20, return_mode="median") * 1e-3

    return benchmark


def _patch_interpreter_dot() -> None:
    """Make Triton's CPU interpreter multiply bfloat16 operands by value.

    Triton 3.9's interpreter keeps bfloat16 as uint16 bit patterns and its tl.dot
    multiplies those integers. Widening both operands to float32 first (exact) gives the
    product the GPU's MMA computes. Idempotent; only the interpreter is touched."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_kiln_bf16", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a, b = (interpreter.TensorHandle(
                interpreter._convert_float(t.data, t.dtype.scalar, tl.float32, None).view(np.float32),
                tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._kiln_bf16 = True
    builder.create_dot = create_dot


def _device_units(x) -> int:
    import torch

    if x.device.type == "cuda":
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    return 4  # the CPU interpreter: a few programs, enough to exercise the persistent loop


def _device_model(x):
    """The tile selector's model of the GPU holding x (H200, MI300X, ...; the nearest
    modelled architecture for others); H100 for CPU tensors (the interpreter)."""
    import torch

    from kiln.codegen.triton.tile_selector import device_for_name

    if x.device.type != "cuda":
        return "sm_90"
    props = torch.cuda.get_device_properties(x.device)
    arch = getattr(props, "gcnArchName", "").split(":")[0]  # ROCm: "gfx942:sramecc+:xnack-"
    if arch:
        modelled = arch if arch in ("gfx90a", "gfx942", "gfx950") else "gfx942"
    else:
        modelled = "sm_80" if props.major < 9 else "sm_90" if props.major == 9 else "sm_100"
    return device_for_name(props.name, modelled)


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
