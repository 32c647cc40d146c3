"""The backend contract: one interface every code generator implements.

Triton's `BaseBackend` and TVM's per-target pipelines are the models. A backend is a
subclass of `Backend` in a folder of its own, plus one registration line:

    register_backend("mytarget", MyBackend)                  # or "pkg.module:MyBackend"

What a subclass declares (class attributes) and implements:

    name            short name, part of every artifact-cache key
    Options         a frozen dataclass; `options` is an instance, and its text is part
                    of every cache key (no process globals change generated code)
    supports()      which target strings ("cpu", "cuda:sm_100", ...) it serves
    keep            composites its graph pipeline keeps whole (e.g. matmul -> GEMM)
    graph_passes()  its graph pass list: by default the standard one with `keep`
    dtypes          the dtypes its registers hold (None: all of kiln's)
    scalar_table    op -> emitter for the scalar ops it lowers natively; what it lacks,
                    the shared legalize pass (kiln/codegen/legalize.py) rewrites into
                    what it has. Keys: "op", "op:float" / "op:int" / "op:bool", and
                    "convert:SRC>DST" (dtype short names); a value of None says "not
                    natively", which stops the lookup at that key
    stages          ordered stage names `kiln dump --stage` prints (`render` makes them)
    build()         legalized Kernel IR -> callables `fn(arrays, sizes)`, one per kernel
    templates()     Kernel IR template kind -> implementation (kernel_ir.TEMPLATE_KINDS)
    batches_kernels whether build() takes a `BatchKernel` (small independent kernels in
                    one launch); the batching pass runs after fusion only then
    build_object_code() / load_built_object_code()
                    optional: machine code bytes for the artifact cache
                    (`caches_object_code` says whether a backend has them)

Callers use the public face: `compile_many`, `stage_text`, `object_code`,
`load_object_code`, `legalize`, `cache_key`; each legalizes first, so a backend never
sees an op its table lacks. `get_backend(target)` returns the registered backend that
supports `target` (one instance per target and process).
"""

from __future__ import annotations

import importlib
import threading
import weakref
from dataclasses import dataclass, fields, is_dataclass
from functools import lru_cache
from typing import Any, Callable, ClassVar, Mapping, Sequence

from kiln.codegen.kernel_ir import TEMPLATE_KINDS, AnyKernel
from kiln.errors import KilnBackendContractError, KilnUnknownBackendError, KilnUnknownStageError

Emitter = Callable[..., Any]


@dataclass(frozen=True)
class Options:
    """Base of every backend's options: a frozen dataclass, so equal options hash equal.

    >>> Options().cache_text()
    'Options()'
    """

    def cache_text(self) -> str:
        """Deterministic text of every field (the artifact-cache key part)."""
        return f"{type(self).__qualname__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields(self))})"


class Backend:
    """Base class of every backend; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = Options
    stages: ClassVar[tuple[str, ...]] = ()
    # what kiln dump's generic stages ("source", "llvm-optimized", "asm") show here
    dump_stages: ClassVar[Mapping[str, str]] = {}
    keep: ClassVar[frozenset] = frozenset({"matmul"})
    scalar_table: ClassVar[Mapping[str, Emitter | None]] = {}
    # dtype short names its registers hold; None: every dtype kiln has. An op on any
    # other dtype is not native (and has no rule: K372, a clear error)
    dtypes: ClassVar[frozenset | None] = None
    caches_object_code: ClassVar[bool] = False
    # whether build() compiles a BatchKernel (several small kernels in one launch): only
    # then does the batching pass (kiln/passes/batching.py) run after fusion
    batches_kernels: ClassVar[bool] = False

    def __init__(self, target: str | None = None, options: Any = None):
        options = self.Options() if options is None else options
        if not (is_dataclass(options) and type(options).__dataclass_params__.frozen):
            raise KilnBackendContractError(f"backend {self.name!r}: options must be a frozen dataclass, "
                                           f"got {type(options).__name__}")
        self.options = options
        self.target = target or self.name
        # kernel -> its legalized form (None: already legal); weak, so a long-lived
        # backend does not keep every kernel it ever compiled alive
        self._legalized: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._legalize_lock = threading.Lock()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        opts = cls.__dict__.get("Options")
        if opts is not None and not (is_dataclass(opts) and opts.__dataclass_params__.frozen):
            raise KilnBackendContractError(f"backend class {cls.__name__}: Options must be a frozen dataclass")

    # -- what a backend declares ------------------------------------------------------
    @classmethod
    def create(cls, target: str) -> "Backend":
        """The instance `get_backend(target)` returns (default options)."""
        return cls(target=target)

    @classmethod
    def supports(cls, target: str) -> bool:
        """Whether this backend compiles for `target` (default: the target is its name)."""
        return target == cls.name

    def graph_passes(self, options: Any = None) -> list:
        """(name, Graph -> Graph) stages before fusion: the standard list with `keep`."""
        from kiln.passes.pipeline import standard_passes

        return standard_passes(keep=self.keep)

    def templates(self) -> dict[str, Callable]:
        """Template kind (kernel_ir.TEMPLATE_KINDS) -> implementation `fn(arrays, attrs)`
        for the templates this backend runs itself; the rest run their numpy reference."""
        return {}

    def build(self, kernels: Sequence[AnyKernel]) -> list:
        """Callables `fn(arrays, sizes)` for legalized `kernels` (one per kernel)."""
        raise KilnBackendContractError(f"backend {self.name!r} does not implement build()")

    def render(self, kernel: AnyKernel, stage: str) -> str:
        """The text of stage `stage` (one of `stages`) for one legalized kernel."""
        raise KilnBackendContractError(f"backend {self.name!r} has no printable stages")

    def comment(self, stage: str) -> str:
        """The line-comment marker of a stage's language (for `kiln dump` banners)."""
        return ";"

    def build_object_code(self, kernels: Sequence[AnyKernel]) -> bytes:
        raise KilnBackendContractError(f"backend {self.name!r} has no object code (caches_object_code is False)")

    def load_built_object_code(self, kernels: Sequence[AnyKernel], blob: bytes, hints: tuple | None = None) -> list:
        """Callables from `blob`; `hints`: what this backend's `load_hints` recorded at the
        build (only backends that define `load_hints` get any)."""
        raise KilnBackendContractError(f"backend {self.name!r} has no object code (caches_object_code is False)")

    def compile(self, kernel: AnyKernel, measure: bool | None = None):
        """One kernel; `measure` lets a backend time its template variants (max-autotune)."""
        return self.compile_many([kernel])[0]

    # -- the public face: every path legalizes first ----------------------------------
    def native(self, op: str, arg_dtypes: Sequence, out) -> bool:
        """Whether `scalar_table` lowers `op` on these dtypes natively."""
        if self.dtypes is not None and any(d.short not in self.dtypes for d in (*arg_dtypes, out)):
            return False
        return lookup(self.scalar_table, op, arg_dtypes, out) is not None

    def emitter(self, op: str, arg_dtypes: Sequence, out) -> Emitter:
        """The table's emitter for `op` on these dtypes (K372 when the table lacks it)."""
        from kiln.codegen.legalize import not_native

        found = lookup(self.scalar_table, op, arg_dtypes, out)
        if found is None:
            raise not_native(self.name, op, arg_dtypes, out)
        return found

    def legalize(self, kernel: AnyKernel) -> AnyKernel:
        """`kernel` with every scalar op this backend's table lacks rewritten (memoized)."""
        from kiln.codegen.legalize import legalize_kernel

        with self._legalize_lock:
            if kernel in self._legalized:
                return self._legalized[kernel] or kernel
        done = legalize_kernel(kernel, self.native, self.name)
        with self._legalize_lock:
            self._legalized[kernel] = None if done is kernel else done
        return done

    def compile_many(self, kernels: Sequence[AnyKernel]) -> list:
        """Callables `fn(arrays, sizes)` running `kernels`, in order."""
        return self.build([self.legalize(k) for k in kernels])

    def stage_text(self, kernel: AnyKernel, stage: str) -> str:
        """The text of one named stage for `kernel`; K373 for a stage it does not have."""
        if stage not in self.stages:
            raise KilnUnknownStageError(f"{self.name} backend: unknown stage {stage!r}; "
                                        f"stages are {', '.join(self.stages) or '(none)'}")
        return self.render(self.legalize(kernel), stage)

    def object_code(self, kernels: Sequence[AnyKernel]) -> bytes:
        return self.build_object_code([self.legalize(k) for k in kernels])

    def load_object_code(self, kernels: Sequence[AnyKernel], blob: bytes) -> list:
        return self.load_built_object_code([self.legalize(k) for k in kernels], blob)

    def kernel_note(self, kernel: AnyKernel) -> str | None:
        """One line on how this backend implements `kernel`, shown by `kiln dump --stage
        kernels` (cuda: CuTeDSL or Triton GEMM, and why); None when there is nothing to say."""
        return None

    def runtime_allocator(self):
        """The allocator a compiled program's buffers come from: None for host memory; a
        backend whose kernels run on a device of their own (opencl: SVM) returns that
        device's, so intermediates stay there between kernels."""
        return None

    def cache_key(self) -> tuple[str, str]:
        """What of this backend goes into an artifact-cache key: its name and options."""
        return self.name, self.options.cache_text()

    def template_for(self, kind: str) -> Callable | None:
        """This backend's implementation of template `kind`, or None (K374: unknown kind)."""
        if kind not in TEMPLATE_KINDS:
            from kiln.errors import KilnTemplateError

            raise KilnTemplateError(f"{self.name} backend: unknown template kind {kind!r}; "
                                    f"kinds are {', '.join(TEMPLATE_KINDS)}")
        return self.templates().get(kind)


def dtype_kind(d) -> str:
    """"float", "int" (signed or unsigned) or "bool": the table's dtype classes."""
    if d.is_bool:
        return "bool"
    return "float" if d.is_floating else ("complex" if d.is_complex else "int")


def lookup(table: Mapping[str, Emitter | None], op: str, arg_dtypes: Sequence, out) -> Emitter | None:
    """The entry of `table` for `op` on these dtypes: the most specific key present wins
    ("convert:f64>bf16", then "op:kind" by the operand that decides, then "op")."""
    keys = []
    if op in ("convert", "bitcast_convert") and arg_dtypes:
        keys.append(f"{op}:{arg_dtypes[0].short}>{out.short}")
    decider = arg_dtypes[1] if op == "select" and len(arg_dtypes) > 1 else (arg_dtypes[-1] if arg_dtypes else out)
    keys += [f"{op}:{dtype_kind(decider)}", op]
    for key in keys:
        if key in table:
            return table[key]
    return None


# -- the registry -----------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    name: str
    loader: Any  # a Backend subclass, or "package.module:Class" imported on first use
    supports: Callable[[str], bool] | None
    example: str

    def cls(self) -> type:
        if isinstance(self.loader, str):
            module, _, attr = self.loader.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.loader

    def serves(self, target: str) -> bool:
        return (self.supports or self.cls().supports)(target)


_REGISTRY: dict[str, _Entry] = {}


def register_backend(name: str, loader: Any, *, supports: Callable[[str], bool] | None = None,
                     example: str | None = None) -> None:
    """Register a backend: `loader` is the class or "module:Class" (imported when first
    asked for, so `import kiln` stays fast); `supports` answers without importing it.

    >>> register_backend("c", CBackend)
    """
    if not isinstance(loader, str) and not (isinstance(loader, type) and issubclass(loader, Backend)):
        raise KilnBackendContractError(f"register_backend({name!r}): {loader!r} is not a Backend subclass")
    _REGISTRY[name] = _Entry(name, loader, supports, example or name)
    get_backend.cache_clear()


def unregister_backend(name: str) -> None:
    """Remove a registered backend (tests that register a toy one clean up with this)."""
    _REGISTRY.pop(name, None)
    get_backend.cache_clear()


def registered_backends() -> dict[str, str]:
    """Registered backend name -> an example target it supports."""
    return {n: e.example for n, e in _REGISTRY.items()}


@lru_cache(maxsize=None)
def get_backend(target: str) -> Backend:
    """The backend object for `target` (created once per process); K370 when none serves it."""
    import kiln.codegen.backends  # noqa: F401  (registers the built-in backends)

    for entry in _REGISTRY.values():
        if entry.serves(target):
            cls = entry.cls()
            backend = cls.create(target) if isinstance(cls, type) and issubclass(cls, Backend) else None
            if not isinstance(backend, Backend) or not backend.name:
                raise KilnBackendContractError(f"backend {entry.name!r}: {cls.__name__} must subclass "
                                               "kiln.codegen.backend.Backend and set `name`")
            return backend
    raise KilnUnknownBackendError(
        f"compile: unknown backend {target!r}; kiln compiles for "
        f"{', '.join(e.example for e in _REGISTRY.values())} (and 'cuda:ARCH' / 'rocm:ARCH', "
        "e.g. 'cuda:sm_100')")
