"""Ahead-of-time compilation of kiln's CuTeDSL GEMMs, with no GPU present.

`compile_gemm(kernel, arch, tile)` describes every argument of the kernel to CuTeDSL
as a fake tensor (static extents where the Kernel IR has numbers, `sym_int32` where it
has symbols), names the architecture explicitly (`--gpu-arch sm_90a`), and keeps the
PTX and cubin that `cute.compile` produces. The result is stored in kiln's artifact
cache (kind "cute", authenticated like every entry; the cubin must be well-formed CUDA
ELF) under a key of the Kernel IR fingerprint, the arch, the tile, the CuTeDSL version
and the kernel template's own source, so a second process loads it instead of compiling.

CuTeDSL reads the source file of the kernel it traces (sm90_gemm.py): the kernel is a
module of this package, never generated text. What is generated is the epilogue, a
Python closure over the Kernel IR expression that the trace calls per element.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

from kiln._version import __version__ as _KILN_VERSION
from kiln.codegen import artifact_cache, cache_elf
from kiln.codegen.kernel_ir import GemmKernel, kernel_fingerprint

_CACHE_KIND = "cute"
_FORMAT = "kiln-cute-artifact/1"
# CuTeDSL's compiler keeps process-wide MLIR state: one compile at a time
_LOCK = threading.Lock()
# persistent grid: one CTA per SM of the largest part of the arch (H100/H200: 132; B200: 148)
MAX_CTAS = {"sm_90a": 132, "sm_100a": 148}


@dataclass(frozen=True)
class CuteArtifact:
    """One GEMM compiled for one architecture: PTX text, cubin bytes and how it was made."""

    name: str
    arch: str
    tile: tuple
    ptx: str = field(repr=False)
    cubin: bytes = field(repr=False)
    compile_seconds: float = 0.0
    operands: tuple = ()
    sizes: tuple = ()
    key: str = ""


def _template_source(arch: str) -> str:
    from kiln.codegen.cute import epilogue

    parts = []
    for m in (_kernel_module(arch), epilogue):
        with open(m.__file__, "rb") as f:
            parts.append(hashlib.sha256(f.read()).hexdigest())
    return ",".join(parts)


def _kernel_module(arch: str):
    """The module of the kernel class for `arch`."""
    if arch == "sm_100a":
        from kiln.codegen.cute import sm100_gemm

        return sm100_gemm
    from kiln.codegen.cute import sm90_gemm

    return sm90_gemm


def cache_key(kernel: GemmKernel, arch: str, tile: tuple) -> str:
    """The artifact-cache key of `kernel` compiled for `arch` with `tile`."""
    arch_env()
    import cutlass

    return artifact_cache.content_key(_FORMAT, _KILN_VERSION, getattr(cutlass, "__version__", "?"), arch,
                                      repr(tuple(tile)), _template_source(arch), kernel_fingerprint(kernel),
                                      ",".join(f"{b.name}:{b.dtype.short}" for b in kernel.buffers))


def compile_gemm(kernel: GemmKernel, arch: str, tile: tuple) -> CuteArtifact:
    """`kernel` compiled for `arch` ("sm_90a") with CTA tile `tile` = (M, N): PTX + cubin,
    from the artifact cache when kiln compiled it before."""
    key = cache_key(kernel, arch, tile)
    blob = artifact_cache.load(key, _CACHE_KIND, validate=_check_entry)
    if blob is not None:
        return _decode(blob, key)
    artifact = _compile(kernel, arch, tile, key)
    artifact_cache.store(key, _encode(artifact), _CACHE_KIND)
    return artifact


def _compile(kernel: GemmKernel, arch: str, tile: tuple, key: str) -> CuteArtifact:
    arch_env()
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    from kiln.codegen.cute import layouts
    from kiln.codegen.cute.epilogue import cutlass_type, make_epilogue
    fn, operand_names, size_names = make_epilogue(kernel)
    dims = layouts.FakeDims()
    plan = layouts.gemm_layouts(kernel)
    buffers = {b.name: b for b in kernel.buffers}
    a = make_fake_compact_tensor(cutlass_type(buffers[kernel.a].dtype), dims.shape(plan.a_shape),
                                 stride_order=plan.a_order, assumed_align=16)
    b = make_fake_compact_tensor(cutlass_type(buffers[kernel.b].dtype), dims.shape(plan.b_shape),
                                 stride_order=plan.b_order, assumed_align=16)
    c = make_fake_compact_tensor(cutlass_type(buffers[kernel.out].dtype), dims.shape(plan.c_shape),
                                 stride_order=(1, 0, 2), assumed_align=16)
    operands = tuple(make_fake_compact_tensor(cutlass_type(buffers[n].dtype), dims.shape((layouts.numel(buffers[n]),)),
                                              assumed_align=buffers[n].dtype.itemsize)
                     for n in operand_names)
    # at least one (unused) size: an empty tuple is no JIT argument
    sizes = tuple(cutlass.Int32(1) for _ in size_names) or (cutlass.Int32(0),)
    module = _kernel_module(arch)
    gemm = (module.Sm100Gemm if arch == "sm_100a" else module.Sm90Gemm)(tuple(tile), fn)
    compiled, seconds = run_compile(gemm, (a, b, c, operands, sizes, MAX_CTAS[arch]), arch)
    ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
    if not ptx or not cubin:
        raise RuntimeError(f"cute.compile of {kernel.name} for {arch} kept no PTX/cubin")
    return CuteArtifact(kernel.name, arch, tuple(tile), ptx, bytes(cubin), seconds, operand_names,
                        size_names, key)


def compile_grouped_gemm(arch: str, dtype, out_dtype, k: int, n: int, experts: int, *, activation: str = "none",
                         alpha: float = 1.0, bias: bool = False, row_scale: bool = False,
                         transpose_rhs: bool = False, tile: tuple = (128, 128)) -> CuteArtifact:
    """The MoE grouped GEMM for x [T, K] (T symbolic), w [E, K, N] ([E, N, K] with
    transpose_rhs), bias [E, N], row_scale [T]: PTX + cubin for `arch` (sm_90a: sm90_grouped.py,
    sm_100a: grouped_gemm.py), cached."""
    if arch not in MAX_CTAS:
        raise ValueError(f"the CuTeDSL grouped GEMM is for {', '.join(MAX_CTAS)}, not {arch}")
    import cutlass

    spec = (dtype.name, out_dtype.name, int(k), int(n), int(experts), activation, float(alpha), bool(bias),
            bool(row_scale), bool(transpose_rhs))
    from kiln.codegen.cute import grouped_gemm, sm90_gemm, sm90_grouped, sm100_gemm

    parts = []
    for m in (grouped_gemm, sm90_grouped, sm90_gemm, sm100_gemm):
        with open(m.__file__, "rb") as f:
            parts.append(hashlib.sha256(f.read()).hexdigest())
    key = artifact_cache.content_key(_FORMAT, _KILN_VERSION, getattr(cutlass, "__version__", "?"), arch,
                                     repr(tuple(tile)), ",".join(parts), "grouped", repr(spec))
    blob = artifact_cache.load(key, _CACHE_KIND, validate=_check_entry)
    if blob is not None:
        return _decode(blob, key)
    arch_env()
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from kiln.codegen.cute.epilogue import cutlass_type

    t = cute.sym_int32()
    a_t, o_t = cutlass_type(dtype), cutlass_type(out_dtype)
    x = make_fake_compact_tensor(a_t, (t, k, 1), stride_order=(1, 0, 2), assumed_align=16)
    # w as (N, K, E): [E, K, N] has N contiguous, [E, N, K] (transpose_rhs) K
    w = make_fake_compact_tensor(a_t, (n, k, experts), stride_order=(1, 0, 2) if transpose_rhs else (0, 1, 2),
                                 assumed_align=16)
    y = make_fake_compact_tensor(o_t, (t, n, 1), stride_order=(1, 0, 2), assumed_align=16)
    sizes = make_fake_compact_tensor(cutlass.Int32, (experts,), assumed_align=4)
    b = make_fake_compact_tensor(o_t if bias else cutlass.Float32, (experts, n) if bias else (1, 1),
                                 stride_order=(1, 0), assumed_align=16 if bias else 4)
    rs = make_fake_compact_tensor(cutlass.Float32, (t,) if row_scale else (1,), assumed_align=4)
    kind = grouped_gemm.Sm100GroupedGemm if arch == "sm_100a" else sm90_grouped.Sm90GroupedGemm
    gemm = kind(tuple(tile), activation, alpha, bias, row_scale)
    args = (x, w, y, sizes, b, rs) + ((MAX_CTAS[arch],) if arch == "sm_90a" else ())
    compiled, seconds = run_compile(gemm, args, arch)
    names = ("bias",) * bias + ("row_scale",) * row_scale
    art = CuteArtifact("grouped_gemm", arch, tuple(tile), compiled.artifacts.PTX, bytes(compiled.artifacts.CUBIN),
                       seconds, names, ("T",), key)
    artifact_cache.store(key, _encode(art), _CACHE_KIND)
    return art


def compile_blockscaled_gemm(fmt: str, m, n, k, out_dtype, *, tensor_scale: bool = False,
                             tile: tuple = (128, 128)) -> CuteArtifact:
    """The sm_100a block-scaled GEMM (sm100_blockscaled.py) for `fmt` "nvfp4" (e2m1 values,
    e4m3 scales per 16) or "mxfp8" (e4m3 values, E8M0 scales per 32): a [M, K] and b [N, K]
    K-major, scale factors in the tensor cores' blocked layout, out [M, N] of `out_dtype`.
    tensor_scale: the epilogue multiplies by alpha[0] (NVFP4's two per-tensor scales,
    multiplied), an operand "alpha". Sizes may be ints or symbols; cached like compile_gemm."""
    from kiln.codegen.cute import sm100_blockscaled
    from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, GemmKernel, Load, Op
    from kiln.ir import dtypes as dt

    if fmt not in sm100_blockscaled.FORMATS:
        raise ValueError(f"block-scaled GEMM: format {fmt!r} is not one of {', '.join(sm100_blockscaled.FORMATS)}")
    value = Op("mul", (Acc(dt.float32), Load("alpha", 0, dt.float32)), dt.float32) if tensor_scale else Acc(dt.float32)
    if out_dtype != dt.float32:
        value = Op("convert", (value,), out_dtype)
    # the logical GEMM, for the epilogue and the cache key (values are stored as bytes)
    bufs = (BufferParam("a", dt.uint8, (m, k), IN), BufferParam("b", dt.uint8, (n, k), IN)) + (
        (BufferParam("alpha", dt.float32, (1,), IN),) if tensor_scale else ()) + (BufferParam("y", out_dtype, (m, n), OUT),)
    kernel = GemmKernel(f"blockscaled_{fmt}", bufs, (), "a", "b", "y", 1, m, n, k, (m * k, k, 1), (n * k, 1, k),
                        value, dt.float32)
    with open(sm100_blockscaled.__file__, "rb") as f:
        source = hashlib.sha256(f.read()).hexdigest()
    key = artifact_cache.content_key(_FORMAT, "blockscaled", fmt, cache_key(kernel, "sm_100a", tile), source)
    blob = artifact_cache.load(key, _CACHE_KIND, validate=_check_entry)
    if blob is not None:
        return _decode(blob, key)
    arch_env()
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from kiln.codegen.cute import layouts
    from kiln.codegen.cute.epilogue import cutlass_type, make_epilogue

    fn, operand_names, _ = make_epilogue(kernel)
    values_t = cutlass.Float4E2M1FN if fmt == "nvfp4" else cutlass.Float8E4M3FN
    sf_t = cutlass.Float8E4M3FN if fmt == "nvfp4" else cutlass.Float8E8M0FNU
    dims = layouts.FakeDims()
    fake = lambda t, shape, order, align: make_fake_compact_tensor(t, dims.shape(shape), stride_order=order,  # noqa: E731
                                                                   assumed_align=align)
    a = fake(values_t, (m, k, 1), (1, 0, 2), 32)
    b = fake(values_t, (n, k, 1), (1, 0, 2), 32)
    c = fake(cutlass_type(out_dtype), (m, n, 1), (1, 0, 2), 16)
    sfa = make_fake_compact_tensor(sf_t, (cute.sym_int32(),), assumed_align=16)
    sfb = make_fake_compact_tensor(sf_t, (cute.sym_int32(),), assumed_align=16)
    operands = tuple(make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4) for _ in operand_names)
    gemm = sm100_blockscaled.Sm100BlockScaledGemm(fmt, fn, tuple(tile))
    compiled, seconds = run_compile(gemm, (a, b, c, sfa, sfb, operands, (cutlass.Int32(0),), MAX_CTAS["sm_100a"]),
                                     "sm_100a")
    art = CuteArtifact(kernel.name, "sm_100a", tuple(tile), compiled.artifacts.PTX, bytes(compiled.artifacts.CUBIN),
                       seconds, operand_names, (), key)
    artifact_cache.store(key, _encode(art), _CACHE_KIND)
    return art


def run_compile(gemm, args: tuple, arch: str) -> tuple:
    """(compiled, seconds): `cute.compile(gemm, *args, stream)` for `arch`, keeping PTX and
    cubin, one compile at a time."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    with _LOCK, tempfile.TemporaryDirectory(prefix="kiln-cute-") as dump, warnings.catch_warnings():
        # an epilogue without loads passes an empty operand tuple, which CuTeDSL warns it
        # takes as a compile-time constant: exactly what it is
        warnings.filterwarnings("ignore", message=r"Argument operands .* cannot be converted", category=UserWarning)
        start = time.perf_counter()
        compiled = cute.compile(gemm, *args, make_fake_stream(),
                                options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir={dump}")
        return compiled, time.perf_counter() - start


def _encode(art: CuteArtifact) -> bytes:
    return json.dumps({"format": _FORMAT, "name": art.name, "arch": art.arch, "tile": list(art.tile),
                       "ptx": art.ptx, "cubin": base64.b64encode(art.cubin).decode(),
                       "seconds": art.compile_seconds, "operands": list(art.operands),
                       "sizes": list(art.sizes)}).encode()


def _decode(blob: bytes, key: str) -> CuteArtifact:
    d = json.loads(blob)
    if d.get("format") != _FORMAT:
        raise ValueError("cute artifact format")
    return CuteArtifact(d["name"], d["arch"], tuple(d["tile"]), d["ptx"], base64.b64decode(d["cubin"]),
                        float(d["seconds"]), tuple(d["operands"]), tuple(d["sizes"]), key)


def _check_entry(blob: bytes) -> None:
    """ValueError unless the entry decodes and its cubin is well-formed CUDA ELF."""
    try:
        art = _decode(blob, "")
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"cute artifact: {e!r}") from None
    cache_elf.check_object(art.cubin, machine=cache_elf.EM_CUDA)


def arch_env() -> None:
    """CuTeDSL reads its default arch from CUTE_DSL_ARCH at import; kiln always passes
    --gpu-arch, and sets the variable only where unset so the import never probes a GPU."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
