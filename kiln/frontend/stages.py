"""Every named stage of the compiler, printable: what `kiln dump --stage NAME` shows.

Graph stages are the pass pipeline's own names (decompose, canonicalize, ...,
fuse); `optimized` is the fused graph, `kernels` the Kernel IR, `program` the
runtime steps with the memory plan, and `source` / `llvm-optimized` / `asm` the
backend's code (for `--target cuda|rocm`: the Triton source, LLVM IR and PTX/AMDGCN).
A backend's own stage names work too (`ttir`, `ttgir`, `llir` for cuda/rocm). Other
layers add stages with `register_stage` (the distributed scheduler adds `scheduled`),
so the pipeline itself is the documentation.
"""

from __future__ import annotations

from typing import Callable

from kiln.errors import KilnArgumentError
from kiln.ir.graph import Graph

StageFn = Callable[[Graph, str], str]

_EXTRA: dict[str, tuple[StageFn, str]] = {}

BUILTIN_HELP = {
    "exported": "the graph as traced or exported",
    "optimized": "after the graph passes, fusion groups marked as `fused` nodes",
    "kernels": "Kernel IR: one kernel per fusion group",
    "program": "the runtime program: steps over buffers and the memory plan",
    "source": "generated code (LLVM IR for cpu, Triton for cuda/rocm)",
    "llvm-optimized": "LLVM IR after LLVM's optimization pipeline (cpu; Triton's LLVM IR for cuda/rocm)",
    "asm": "machine code as assembly (cpu; PTX for cuda, AMDGCN for rocm)",
}


def register_stage(name: str, fn: StageFn, help: str) -> None:
    """Make `kiln dump --stage name` print `fn(graph, target)`."""
    _EXTRA[name] = (fn, help)


def _pass_names() -> list[str]:
    from kiln.passes.pipeline import DEFAULT_PASSES

    return [name for name, _ in DEFAULT_PASSES] + ["fuse"]


def stage_names() -> list[str]:
    return ["exported"] + _pass_names() + ["optimized", "kernels", "program", "source",
                                           "llvm-optimized", "asm"] + sorted(_EXTRA)


def stage_help() -> dict[str, str]:
    out = {"exported": BUILTIN_HELP["exported"]}
    out.update({n: f"after the '{n}' pass" for n in _pass_names()})
    out.update({k: v for k, v in BUILTIN_HELP.items() if k != "exported"})
    out.update({k: h for k, (_, h) in _EXTRA.items()})
    return out


def render_stage(graph: Graph, stage: str, target: str = "cpu") -> str:
    """The text of `stage` for `graph` compiled for `target`.

    >>> print(render_stage(kn.trace(f, x), "kernels"))
    """
    if stage == "exported":
        return str(graph)
    if stage in _EXTRA:
        return _EXTRA[stage][0](graph, target)
    from kiln.codegen.backends import get_backend

    backend = get_backend(target)
    own = tuple(getattr(backend, "stages", ()))
    if stage not in stage_names() and stage not in own:
        extra = f" (and {', '.join(own)} for target {target!r})" if own else ""
        raise KilnArgumentError(f"unknown stage {stage!r}; stages are {', '.join(stage_names())}{extra}")
    from kiln.frontend.compile import compile_graph

    # Kernel IR does not depend on the target: lower once without building machine code
    # (a GPU target compiles here without a GPU; its stages build ahead of time)
    compiled = compile_graph(graph, "reference")
    if stage in compiled.stages:
        return str(compiled.stages[stage])
    if stage == "optimized":
        return str(compiled.optimized)
    if stage == "program":
        return compiled.program.format() + "\n"
    kernels = compiled.program.kernels
    if stage == "kernels":
        from kiln.codegen.kernel_ir import format_kernel

        return "\n\n".join(format_kernel(k) for k in kernels.values()) + "\n"
    mapping = getattr(backend, "dump_stages", {"source": "llvm", "llvm-optimized": "optimized", "asm": "asm"})
    backend_stage = stage if stage in own and stage not in mapping else mapping[stage]
    comment = backend.comment(backend_stage) if hasattr(backend, "comment") else ";"
    parts = []
    for name, kernel in kernels.items():
        parts.append(f"{comment} ---- kernel {name} ----\n{backend.stage_text(kernel, backend_stage)}")
    return "\n".join(parts) + "\n"
