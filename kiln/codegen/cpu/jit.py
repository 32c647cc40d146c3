"""LLVM plumbing: the host target machine, the O3 pipeline, MCJIT, and object code.

Follows the recipe verified in design/NOTES.md: initialize only the native target and
asm printer, optimize with the new pass manager (loop + SLP vectorization on), JIT with
MCJIT. Object code can be emitted and loaded back (`load_object`), which is the hook the
runtime uses to cache compiled kernels on disk by content hash.

External code the JIT'd functions call is loaded by blas.py (MKL or numpy's OpenBLAS,
CBLAS with 64-bit integers) into LLVM's symbol space, so generated GEMMs call it
directly (no Python in the GEMM path); the helpers here keep their old names.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import Sequence

import llvmlite.binding as llvm


_lock = threading.Lock()

# LLVM's loop strength reduction (LSR) runs in code generation. On the small GPT training
# step it was ~14% of all LLVM time (0.2 of ~1.45 CPU s, most of it on kernels with many
# address streams: a 14-column reduction's code generation took 81 ms with it, 24 without),
# while kiln's kernels ran within a few percent of their speed with it: the register-tiled
# GEMMs (which step their panel pointers themselves) 0-2% slower, row reductions -4 to +5%
# (benchmarks/bench_lsr.py; results/cpu.md, section session10_lead). So kiln generates
# code with LSR off: `-disable-lsr`, an LLVM option of the whole process, set only while
# kiln generates code (`_no_codegen_lsr`).
CODEGEN_LSR = False  # True: LLVM's default (benchmarks/bench_lsr.py compares the two)
_lsr_lock = threading.Lock()
_lsr_users = 0


@contextmanager
def _no_codegen_lsr():
    """LLVM's code generation without LSR while any kiln build is inside (counted across
    threads: the option is LLVM's, one per process; it is set back when the last leaves,
    so other llvmlite users in the process, numba, keep LLVM's default)."""
    global _lsr_users
    if CODEGEN_LSR:
        yield
        return
    with _lsr_lock:
        if _lsr_users == 0:
            llvm.set_option("kiln", "-disable-lsr=true")
        _lsr_users += 1
    try:
        yield
    finally:
        with _lsr_lock:
            _lsr_users -= 1
            if _lsr_users == 0:
                llvm.set_option("kiln", "-disable-lsr=false")


@lru_cache(maxsize=None)
def _init() -> None:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    llvm.initialize_native_asmparser()


@lru_cache(maxsize=None)
def target_machine(opt_level: int = 3, features: str = ""):
    """The host's target machine (CPU name and features detected by LLVM), shared for
    optimizing and emitting; never hand it to an engine (see `_new_target_machine`)."""
    return _new_target_machine(opt_level, features)


def _new_target_machine(opt_level: int = 3, features: str = ""):
    """A fresh target machine: an MCJIT engine takes ownership of (and frees) its own."""
    _init()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    name, host_features = host_cpu()
    return target.create_target_machine(cpu=name, features=features or host_features,
                                        opt=opt_level, reloc="pic", codemodel="jitdefault", jit=True)


@lru_cache(maxsize=1)
def host_cpu() -> tuple[str, str]:
    """(CPU name, features) of the host as LLVM detects them, asked once per process
    (~0.4 ms: every engine's target machine needs them)."""
    _init()
    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def parse(text: str):
    """LLVM IR text -> verified module."""
    _init()
    mod = llvm.parse_assembly(text)
    mod.verify()
    return mod


def optimize(mod, opt_level: int = 3) -> None:
    """Run the new-pass-manager O-level pipeline with loop and SLP vectorization."""
    tm = target_machine(opt_level)
    pb, pm = _pipeline(mod, tm, opt_level)
    pm.run(mod, pb)


def _pipeline(mod, tm, opt_level: int):
    """(pass builder, module pass manager) of the O-level pipeline for `mod` on `tm`."""
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    pto = llvm.create_pipeline_tuning_options(speed_level=min(opt_level, 3))
    pto.loop_vectorization = opt_level >= 2
    pto.slp_vectorization = opt_level >= 2
    pto.loop_unrolling = opt_level >= 2
    pb = llvm.create_pass_builder(tm, pto)
    return pb, pb.getModulePassManager()


def assembly(mod, opt_level: int = 3) -> str:
    with _no_codegen_lsr():
        return target_machine(opt_level).emit_assembly(mod)


def object_code(mod, opt_level: int = 3) -> bytes:
    with _no_codegen_lsr():
        return target_machine(opt_level).emit_object(mod)


def _unlocked(name: str):
    """llvmlite's raw ctypes function `name`, without the process-wide lock llvmlite wraps
    around every call (None when this llvmlite has no such layer). ctypes releases the
    GIL in the call, so threads compiling modules of their own contexts run in parallel."""
    fn = getattr(llvm.ffi.lib, name, None)
    return getattr(fn, "_cfn", None)


def _parse_alone(text: str, context):
    """`llvm.parse_assembly(text, context)` outside llvmlite's process-wide lock (a module
    of the GPT step takes ~9 ms to parse: the second build thread waited that long)."""
    parse = _unlocked("LLVMPY_ParseAssembly")
    if parse is None:
        return llvm.parse_assembly(text, context=context)
    from llvmlite.binding.module import ModuleRef

    with llvm.ffi.OutputString() as err:
        mod = ModuleRef(parse(context, ctypes.c_char_p(text.encode("utf8")), err), context)
        if err:
            mod.close()
            raise RuntimeError(f"LLVM IR parsing error\n{err}")
    return mod


def _compile_alone(text: str, opt_level: int) -> bytes:
    """Object code of one module in an LLVM context and target machine of its own: what
    `object_code(optimize(parse(text)))` makes, safe to run on several threads at once
    (the long calls, the pass pipeline and code generation, run outside llvmlite's lock)."""
    _init()
    context = llvm.create_context()
    mod = _parse_alone(text, context)
    mod.verify()
    tm = _new_target_machine(opt_level)
    pb, pm = _pipeline(mod, tm, opt_level)
    run, emit = _unlocked("LLVMPY_RunNewModulePassManager"), _unlocked("LLVMPY_TargetMachineEmitToMemory")
    if run is None or emit is None:  # an llvmlite without the lock layer: its own calls
        pm.run(mod, pb)
        with _no_codegen_lsr():
            return tm.emit_object(mod)
    run(pm, mod, pb)
    with llvm.ffi.OutputString() as err, _no_codegen_lsr():
        buffer = emit(tm, mod, 1, err)
        if not buffer:
            raise RuntimeError(str(err))
    try:
        return ctypes.string_at(llvm.ffi.lib.LLVMPY_GetBufferStart(buffer),
                                llvm.ffi.lib.LLVMPY_GetBufferSize(buffer))
    finally:
        llvm.ffi.lib.LLVMPY_DisposeMemoryBuffer(buffer)
        mod.close()  # before its context goes


class Build:
    """One module compiling on a thread of its own (`_compile_alone`, GIL released in
    LLVM): `result(timeout)` is its object code, or raises its error; every wait is
    bounded. A plain thread, not concurrent.futures (~3 ms of imports in a cold compile)."""

    def __init__(self, text: str, opt_level: int, name: str = "kiln-llvm"):
        self._value: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(text, opt_level), name=name)
        self._thread.start()

    def _run(self, text: str, opt_level: int) -> None:
        try:
            self._value = _compile_alone(text, opt_level)
        except BaseException as error:  # handed to the waiting thread by result()
            self._error = error

    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout: float = 3600.0) -> bytes:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"cpu backend: an LLVM build thread ran past {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self._value


def object_codes(texts: list[str], opt_level: int = 3, timeout: float = 3600.0,
                 started: Sequence[Build] = ()) -> list[bytes]:
    """Object code of each module text, the modules compiled on threads at once (one per
    module), after the object code of `started` builds (already running). Every wait is
    bounded by `timeout` seconds. While they compile, this thread runs the Python work
    its caller left pending (build_overlap.py)."""
    if len(texts) == 1 and not started:
        return [_compile_alone(texts[0], opt_level)]
    from kiln.codegen.build_overlap import run_pending

    builds = list(started) + [Build(text, opt_level) for text in texts]
    run_pending()  # keeps a task's error for its owner: the waits below still run
    return [b.result(timeout) for b in builds]  # on an error, the others run out alone


class Jitted:
    """An MCJIT engine holding compiled code; `address(name)` of an exported function.
    Engines stay alive as long as this object (the compiled functions point into it)."""

    def __init__(self, mod=None, objects: tuple[bytes, ...] = (), opt_level: int = 3):
        _init()
        ensure_blas_loaded()
        with _lock:  # MCJIT creation/finalization is not re-entrant across threads
            base = mod if mod is not None else llvm.parse_assembly("")
            if mod is None:
                base.triple = target_machine(opt_level).triple
            with _no_codegen_lsr():  # a module given as IR is compiled here
                self.engine = llvm.create_mcjit_compiler(base, _new_target_machine(opt_level))
                for blob in objects:
                    self.engine.add_object_file(llvm.ObjectFileRef.from_data(blob))
                self.engine.finalize_object()

    def address(self, name: str) -> int:
        addr = self.engine.get_function_address(name)
        if not addr:
            raise KeyError(f"cpu backend: no compiled function named {name}")
        return addr


def glue_module(text: str) -> Jitted:
    """A small hand-written module (launch lists, trampolines: calls and branches) built
    at O1, which costs tens of milliseconds where O3 buys nothing. Keep the result alive
    as long as its functions are called. Its object code comes from kiln's artifact
    cache when an earlier process built the same text here (glue_cache.py)."""
    from kiln.codegen.cpu import glue_cache

    return glue_cache.glue_module(text, 1)


# -- BLAS (blas.py: Intel MKL where installed, else numpy's bundled OpenBLAS) ------

CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112


def find_openblas() -> str | None:
    """Path of numpy's bundled OpenBLAS, or None (e.g. a numpy built against MKL)."""
    from kiln.codegen.cpu import blas

    return blas.find_openblas()


def ensure_blas_loaded() -> bool:
    """Load the process's BLAS (blas.default_name) into the process and LLVM's symbol
    table; False if it is absent."""
    from kiln.codegen.cpu import blas

    return blas.available()


def require_blas(name: str | None = None) -> None:
    """BLAS `name` (default: the process's) loaded, or a numbered device error."""
    from kiln.codegen.cpu import blas

    blas.load(name)
