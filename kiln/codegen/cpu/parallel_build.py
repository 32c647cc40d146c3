"""Object code of many kernels built as several LLVM modules on threads at once.

LLVM's pass pipeline and code generation are most of a cold compile (the small GPT
training step: 70 distinct kernels, ~1.6 CPU s of O3 and code generation on a loaded
machine, 2026-12-02; 3.2 s before the emission changes of llvm_build in
benchmarks/results/cpu.md). They run in native code with the GIL released, and modules
in LLVM contexts of their own do not share state, so the kernels are dealt into one
module per thread (largest first, each to the lightest module: LPT scheduling on
`build_cost`, an estimate from the emitted IR) and compiled concurrently
(`jit.object_codes`). Each kernel's code is what a one-module build makes of it: its
functions and helpers are all internal to its module, so splitting changes where code
lies, not what it is.

The parts are one payload (`cache_elf.pack_objects`), loaded into one MCJIT engine each
(`Engines`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kiln.codegen import cache_elf

# below this much IR a second module does not pay for its thread and its helpers
MIN_PART_CHARS = 40_000

# LLVM's time on a kernel, in characters of IR text: the text's length (weighted: a
# micro-kernel GEMM's unrolled register tile is cheaper per character), plus this much
# per loop the vectorizer is asked to widen (its analysis, the vector body, remainder and
# epilogue, their instruction selection), plus a fixed part per kernel (its functions).
# Least squares over the GPT training step's 57 distinct kernels, each built alone (O3 +
# codegen, thread CPU time, 2026-12-02, entries optnone): cost ~ 5.8 ms + 1.17 ms per 1000
# chars (0.75 ms in a micro-kernel GEMM) + 3.5 ms per vectorized loop, within 32 ms of
# every kernel. (Text length alone put the 14-reduction AdamW kernel at half the cost of a
# batch: one module got 1.6 s and the other 0.7 s of work. The earlier fit, 5 ms + 1.75 ms
# per 1000 chars + 3.9 ms per loop for every kind, left the step's two modules 0.57 and
# 0.51 s: micro GEMMs counted for more than they cost.)
CHARS_PER_VECTOR_LOOP = 3_000
CHARS_PER_KERNEL = 5_000
MICRO_TEXT_WEIGHT = 0.64  # a micro-kernel GEMM's characters (Module.text_weight)
VECTOR_HINT = '!"llvm.loop.vectorize.enable", i1 true'


def build_cost(text: str, text_weight: float = 1.0) -> int:
    """Estimated LLVM build time of one kernel's module text, in characters."""
    return int(len(text) * text_weight) + CHARS_PER_VECTOR_LOOP * text.count(VECTOR_HINT) + CHARS_PER_KERNEL


def module_cost(module, module_text: Callable[[Sequence], str]) -> int:
    """`build_cost` of one kernel's emitted module (its `text_weight`, 1 for plain text)."""
    return build_cost(module_text([module]), getattr(module, "text_weight", 1.0))


def partition(plans: Sequence, size: Callable[[object], int], parts: int) -> list[list]:
    """`plans` dealt into at most `parts` groups of near-equal total `size`, each group in
    the plans' original order (so symbols and helpers are emitted as a one-module build
    would). LPT: largest first, each to the lightest group."""
    sizes = [size(p) for p in plans]
    parts = max(1, min(parts, len(plans), sum(sizes) // MIN_PART_CHARS or 1))
    load = [0] * parts
    owner = [0] * len(plans)
    for i in sorted(range(len(plans)), key=lambda i: -sizes[i]):
        g = min(range(parts), key=load.__getitem__)
        owner[i] = g
        load[g] += sizes[i]
    groups = [[p for p, o in zip(plans, owner) if o == g] for g in range(parts)]
    return [g for g in groups if g]


def build_objects(plans: Sequence, module_text: Callable[[Sequence], str], opt_level: int,
                  threads: int) -> bytes:
    """One payload of object code for `plans` (`module_text(plans)` is the text of a module
    holding them; the backend passes kernels already emitted, so that this is a join)."""
    from kiln.codegen.cpu import jit
    from kiln.codegen.cpu.shared_bodies import merge_twins

    plans = merge_twins(list(plans))  # kernels that differ only in constants: one body
    groups = partition(plans, lambda p: module_cost(p, module_text), threads) \
        if threads > 1 and len(plans) > 1 else [list(plans)]
    if len(groups) == 1:  # one module: the plain build, in the process's LLVM context
        mod = jit.parse(module_text(plans))
        jit.optimize(mod, opt_level)
        return jit.object_code(mod, opt_level)
    return cache_elf.pack_objects(jit.object_codes([module_text(g) for g in groups], opt_level))


class Engines:
    """The loaded parts of a payload, one MCJIT engine each (several objects in ONE
    engine crashed at run time here, llvmlite 0.50 / LLVM 22); `address(name)` finds a
    function in whichever part defines it. Keeps every engine alive as long as itself."""

    def __init__(self, blob: bytes, opt_level: int):
        from kiln.codegen.cpu import jit

        self.parts = [jit.Jitted(objects=(part,), opt_level=opt_level)
                      for part in cache_elf.unpack_objects(blob)]

    def address(self, name: str) -> int:
        for part in self.parts:
            addr = part.engine.get_function_address(name)
            if addr:
                return addr
        raise KeyError(f"cpu backend: no compiled function named {name}")
