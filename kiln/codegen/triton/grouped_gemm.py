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

The kernels and the numpy oracle are in grouped_gemm_kernels.py, what AOT needs in
grouped_gemm_aot.py; this module launches (and re-exports both). Host side (Config from
the tile selector names BLOCK_M/N/K, GROUP_M, num_warps, num_stages):

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
from typing import Any

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.grouped_gemm_aot import (  # noqa: F401  (re-exported: the kernel's face)
    KERNEL_ARGS, Epilogue, aot_compile_grouped_gemm, aot_compile_grouped_gemm_dw, check_dtypes,
    constexprs, constexprs_dw, default_out_dtype, divisible_args, dtype_name, dw_config, signature,
    signature_dw, unit_strides,
)
from kiln.codegen.triton.grouped_gemm_kernels import (  # noqa: F401  (re-exported)
    ACTIVATIONS, INPUT_PRECISIONS, grouped_gemm_dw_kernel, grouped_gemm_kernel, reference,
    reference_dw,
)
from kiln.codegen.triton.tile_selector import Config, select_tiles
from kiln.errors import KilnArgumentError, KilnDTypeError

_ARGS = KERNEL_ARGS  # the name the tests use, from before the split


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
    out_name = dtype_name(out_dtype) if out_dtype is not None else default_out_dtype(dtype)
    check_dtypes(dtype, out_name)
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
    out_name = dtype_name(out_dtype) if out_dtype is not None else default_out_dtype(dtype)
    check_dtypes(dtype, out_name)
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
