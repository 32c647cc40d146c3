"""Ahead-of-time compilation of Triton kernels for an explicit GPU, with no GPU present.

Triton's `compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))` runs
the whole pipeline (ttir -> ttgir -> llir -> ptx -> cubin, or -> amdgcn -> hsaco) on
the CPU for any architecture its wheel ships a backend for. `aot_compile` wraps it:

    art = aot_compile(kernel, {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                      {"BLOCK": 1024}, "sm_90")
    art.asm["ptx"], art.binary, art.metadata["shared"]

and stores the result in kiln's artifact cache (kind "triton"), keyed by the kernel's
source hash (triton's own, which covers the jit functions it calls), the signature,
the constexprs, the target, the options and the triton version, so a second process
loads it instead of compiling again (an entry is used only when the cache
authenticates it as kiln's own and its GPU object is well-formed ELF). `fn` may be a
`@triton.jit` function or Triton source text; text is executed from memory
(`load_source`), never imported from a file.

A kernel compiles whatever `TRITON_INTERPRET` says: a function decorated while the
interpreter was on is re-wrapped as a real `JITFunction` here.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import linecache
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kiln._version import __version__ as _KILN_VERSION
from kiln.codegen import artifact_cache, cache_elf
from kiln.codegen.triton.targets import ARCHS, DEFAULT_ARCH, resolve_arch
from kiln.errors import KilnArgumentError

TARGETS: dict[str, GPUTarget] = {name: GPUTarget(*spec) for name, spec in ARCHS.items()}
# the public `backend="cuda"` / `"rocm"` and `kiln dump --target cuda|rocm` compile for these
DEFAULT_TARGET = dict(DEFAULT_ARCH)

_CACHE_KIND = "triton"
_FORMAT = "kiln-triton-artifact/1"
# triton's compile mutates process-wide state (MLIR contexts, its file cache); one at a time
_COMPILE_LOCK = threading.Lock()
_JIT_FUNCTIONS: dict = {}


@dataclass(frozen=True)
class Artifact:
    """One kernel compiled for one target.

    asm: every stage triton produced, by its name: "ttir", "ttgir", "llir" (text) and
    "ptx" (text) + "cubin" (bytes) on NVIDIA, "amdgcn" (text) + "hsaco" (bytes) on AMD.
    metadata: triton's metadata as JSON values ("shared" bytes of shared memory,
    "num_warps", "num_stages", "warp_size", "name", "target", ...).
    """

    name: str
    target: str
    asm: Mapping[str, str | bytes] = field(repr=False)
    metadata: Mapping[str, Any] = field(repr=False)
    key: str = ""

    @property
    def vendor(self) -> str:
        return "cuda" if self.target.startswith("sm_") else "rocm"

    @property
    def assembly(self) -> str:
        """PTX on NVIDIA, AMDGCN on AMD."""
        return self.asm["ptx" if self.vendor == "cuda" else "amdgcn"]

    @property
    def binary(self) -> bytes:
        """The loadable object: cubin on NVIDIA, hsaco on AMD."""
        return self.asm["cubin" if self.vendor == "cuda" else "hsaco"]

    @property
    def shared_memory(self) -> int:
        return int(self.metadata.get("shared", 0))


def as_jit_function(fn: Any) -> JITFunction:
    """A compilable `JITFunction` for `fn` (a JITFunction, an InterpretedFunction or a
    plain Python function written in Triton)."""
    if isinstance(fn, JITFunction):
        return fn
    raw = getattr(fn, "fn", fn)  # InterpretedFunction keeps the Python function in .fn
    if not callable(raw):
        raise KilnArgumentError(f"aot_compile: expected a @triton.jit function, got {type(fn).__name__}")
    with _COMPILE_LOCK:
        if raw not in _JIT_FUNCTIONS:  # JITFunction parses the source: once per function
            _JIT_FUNCTIONS[raw] = JITFunction(raw)
        return _JIT_FUNCTIONS[raw]


def load_source(source: str, name: str | None = None) -> Callable:
    """The Python function named `name` (or the only @triton.jit function) defined by
    Triton source text.

    The text is executed from memory, never imported from a file: a file found on disk
    could have been planted by someone else. triton reads a kernel's source through
    `inspect`, so the text is registered with `linecache` under a name that no file can
    supply (`<kiln-triton ...>`, which linecache never reads from disk).

    The returned object is the undecorated function: wrap it with `as_jit_function` to
    compile or with triton's `InterpretedFunction` to interpret."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    module_name = f"kiln_triton_{digest[:24]}"
    filename = f"<kiln-triton {digest[:24]}>"
    # (re-)registered on every call: something may have cleared linecache since
    linecache.cache[filename] = (len(source), None, io.StringIO(source).readlines(), filename)
    module = sys.modules.get(module_name)
    if module is None:
        code = compile(source, filename, "exec")
        module = types.ModuleType(module_name)
        # registered before exec so `inspect` and triton's dependency walk find it
        sys.modules[module_name] = module
        try:
            exec(code, module.__dict__)
        except BaseException:
            del sys.modules[module_name]
            raise
    kernels = {k: v for k, v in vars(module).items()
               if type(v).__name__ in ("JITFunction", "InterpretedFunction")
               and getattr(v.fn, "__module__", None) == module_name}
    if name is None:
        if len(kernels) != 1:
            raise KilnArgumentError(f"load_source: the source defines {len(kernels)} @triton.jit functions "
                                    f"({', '.join(sorted(kernels)) or 'none'}); pass name=")
        name = next(iter(kernels))
    if name not in kernels:
        raise KilnArgumentError(f"load_source: no @triton.jit function {name!r} in the source")
    return kernels[name].fn


def aot_compile(fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any] | None,
                target: str | GPUTarget, num_warps: int = 4, num_stages: int = 3, *,
                name: str | None = None, options: Mapping[str, Any] | None = None,
                divisible_by_16: Sequence[str] = ()) -> Artifact:
    """Compile a Triton kernel for `target` ("sm_90", "gfx942", or a spec like "cuda").

    signature: every argument by name, pointers as "*fp32"/"*bf16"/..., scalars as
    "i32"/"i64"/"fp32", compile-time arguments as "constexpr" (their values in
    `constexprs`). options: more triton compile options (e.g. {"enable_fp_fusion":
    False}, {"matrix_instr_nonkdim": 16} on AMD); FP contraction is on unless said
    otherwise, explicitly, so the result never depends on TRITON_DEFAULT_FP_FUSION.
    divisible_by_16: arguments known to be multiples of 16 (pointers: 16-byte aligned),
    which lets triton vectorize loads and stores; the kernel is wrong for other values.
    A `GPUTarget` (the GPU of this machine, e.g. sm_86) is accepted besides the names.

        >>> art = aot_compile(add_kernel, {"x": "*fp32", "n": "i32", "B": "constexpr"},
        ...                   {"B": 256}, "gfx942")                     # doctest: +SKIP
        >>> "v_add_f32" in art.assembly                                  # doctest: +SKIP
    """
    arch = target_name(target) if isinstance(target, GPUTarget) else resolve_arch(target)
    if isinstance(fn, str):
        fn = load_source(fn, name)
    jit_fn = as_jit_function(fn)
    constexprs = dict(constexprs or {})
    opts = {"num_warps": int(num_warps), "num_stages": int(num_stages), "enable_fp_fusion": True}
    opts.update(options or {})
    key = artifact_cache.content_key(
        _FORMAT, _KILN_VERSION, triton.__version__, jit_fn.cache_key, arch,
        json.dumps(dict(signature), sort_keys=True),
        json.dumps({k: repr(v) for k, v in constexprs.items()}, sort_keys=True),
        json.dumps(opts, sort_keys=True, default=repr), ",".join(sorted(divisible_by_16)))
    blob = artifact_cache.load(key, _CACHE_KIND, validate=_check_entry)
    if blob is not None:
        return _decode(blob, key)
    gpu_target = target if isinstance(target, GPUTarget) else TARGETS[arch]
    compiled = compile_kernel(jit_fn, signature, constexprs, gpu_target, opts, divisible_by_16)
    artifact = Artifact(
        name=compiled.name, target=arch, asm=dict(compiled.asm),
        metadata=json.loads(json.dumps(compiled.metadata._asdict(), default=vars)), key=key)
    artifact_cache.store(key, _encode(artifact), _CACHE_KIND)
    return artifact


def target_name(target: GPUTarget) -> str:
    """kiln's name of a triton GPUTarget: "sm_90", "gfx942", ..."""
    return f"sm_{target.arch}" if target.backend == "cuda" else str(target.arch)


def compile_kernel(jit_fn: JITFunction, signature: Mapping[str, str], constexprs: Mapping[str, Any],
                   gpu_target: GPUTarget, opts: Mapping[str, Any], divisible_by_16: Sequence[str] = ()):
    """triton.compile for one target: the CompiledKernel (what the runtime launches)."""
    _check_signature(jit_fn, signature, constexprs)
    if not is_compilable():
        raise KilnArgumentError(
            "ahead-of-time compilation is not available in a process that imported triton with "
            "TRITON_INTERPRET=1 (triton's own library functions are interpreted there); compile in a "
            "process without it")
    names = list(jit_fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible_by_16}
    src = ASTSource(jit_fn, dict(signature), dict(constexprs), attrs)
    with _COMPILE_LOCK:
        return triton.compile(src, target=gpu_target, options=dict(opts))


def is_compilable() -> bool:
    """False in a process whose triton was imported under TRITON_INTERPRET=1."""
    from triton.language import standard

    return isinstance(standard.sum, JITFunction)


def _check_signature(jit_fn: JITFunction, signature: Mapping[str, str], constexprs: Mapping[str, Any]) -> None:
    # triton reports these as an assertion deep inside its code generator; say it here
    missing = [a for a in jit_fn.arg_names if a not in signature]
    extra = [a for a in signature if a not in jit_fn.arg_names]
    unset = [a for a, t in signature.items() if t == "constexpr" and a not in constexprs]
    if missing or extra or unset:
        raise KilnArgumentError(
            f"aot_compile: signature of {jit_fn.__name__}({', '.join(jit_fn.arg_names)}) does not match: "
            f"missing {missing}, unknown {extra}, constexpr without a value {unset}")


def _encode(artifact: Artifact) -> bytes:
    asm = {k: ({"bytes": base64.b64encode(v).decode()} if isinstance(v, bytes) else {"text": v})
           for k, v in artifact.asm.items()}
    return json.dumps({"format": _FORMAT, "name": artifact.name, "target": artifact.target,
                       "asm": asm, "metadata": artifact.metadata}).encode()


def _check_entry(blob: bytes) -> None:
    """Raise ValueError unless a cache entry decodes and its GPU object is well-formed
    ELF for its vendor (the cache refuses, removes and rebuilds it otherwise)."""
    try:
        artifact = _decode(blob, "")
        binary = artifact.binary
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"triton artifact: {e!r}") from None
    if not isinstance(binary, bytes):
        raise ValueError("triton artifact: the binary is not bytes")
    machine = cache_elf.EM_CUDA if artifact.vendor == "cuda" else cache_elf.EM_AMDGPU
    cache_elf.check_object(binary, machine=machine)


def _decode(blob: bytes, key: str) -> Artifact:
    data = json.loads(blob)
    if data.get("format") != _FORMAT:
        raise ValueError("artifact format")
    asm = {k: (base64.b64decode(v["bytes"]) if "bytes" in v else v["text"]) for k, v in data["asm"].items()}
    return Artifact(name=data["name"], target=data["target"], asm=asm, metadata=data["metadata"], key=key)
