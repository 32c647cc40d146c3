"""What ahead-of-time compilation of the grouped GEMM needs: the epilogue, Triton's
signature and compile-time arguments of each kernel, the divisibility hints, and
`aot_compile_grouped_gemm(_dw)`, which compile for "sm_90", "gfx942", ... on a CPU-only
machine through kiln/codegen/triton/aot.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton

from kiln.codegen.triton.grouped_gemm_kernels import (
    ACTIVATIONS, INPUT_PRECISIONS, grouped_gemm_dw_kernel, grouped_gemm_kernel,
)
from kiln.codegen.triton.tile_selector import Config, select_tiles
from kiln.errors import KilnArgumentError, KilnDTypeError


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
KERNEL_ARGS = ("x_ptr", "w_ptr", "y_ptr", "sizes_ptr", "bias_ptr", "row_scale_ptr",
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


def check_dtypes(dtype: str, out_dtype: str) -> None:
    """A KilnDTypeError unless the kernel reads `dtype` and writes `out_dtype`."""
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
    out = dtype_name(out_dtype) if out_dtype is not None else default_out_dtype(dtype)
    check_dtypes(dtype, out)
    vector = _TRITON_TYPES[dtype_name(bias_dtype) if bias_dtype is not None else out]
    sig = {"x_ptr": f"*{_TRITON_TYPES[dtype]}", "w_ptr": f"*{_TRITON_TYPES[dtype]}",
           "y_ptr": f"*{_TRITON_TYPES[out]}", "sizes_ptr": f"*{_TRITON_TYPES[dtype_name(sizes_dtype)]}",
           "bias_ptr": f"*{vector}", "row_scale_ptr": "*fp32",
           "N": "i32", "K": "i32", "num_experts": "i32", "alpha": "fp32"}
    for name in KERNEL_ARGS[10:]:
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


def default_out_dtype(dtype: str) -> str:
    """The output dtype when none is given: the input's, float16 for float8 inputs."""
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
    out = dtype_name(out_dtype) if out_dtype is not None else default_out_dtype(dtype)
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
    out = dtype_name(out_dtype) if out_dtype is not None else default_out_dtype(dtype)
    check_dtypes(dtype, out)
    sig = {"x_ptr": f"*{_TRITON_TYPES[dtype]}", "y_ptr": f"*{_TRITON_TYPES[dtype]}",
           "z_ptr": f"*{_TRITON_TYPES[out]}", "sizes_ptr": f"*{_TRITON_TYPES[dtype_name(sizes_dtype)]}",
           "K": "i32", "N": "i32", "num_experts": "i32"}
    for name in _DW_ARGS[7:]:
        sig[name] = "constexpr" if name in ("stride_xk", "stride_yn", "stride_zn") else "i32"
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "MAX_EXPERTS", "INPUT_PRECISION"):
        sig[name] = "constexpr"
    return sig


def constexprs_dw(config: Config, num_experts: int, *, input_precision: str = "ieee") -> dict[str, Any]:
    """The weight-gradient kernel's compile-time arguments (its BLOCK_M is config.block_k)."""
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
