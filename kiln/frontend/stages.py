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

from kiln.errors import KilnUnknownStageError
from kiln.ir.graph import Graph

StageFn = Callable[[Graph, str], str]

_EXTRA: dict[str, tuple[StageFn, str]] = {}

BUILTIN_HELP = {
    "exported": "the graph as traced or exported",
    "optimized": "after the graph passes, fusion groups marked as `fused` nodes",
    "kernels": "Kernel IR: one kernel per fusion group",
    "legalized": "Kernel IR after the target's legalize pass (only ops its scalar table has)",
    "program": "the runtime program: steps over buffers and the memory plan",
    "source": "generated code (LLVM IR for cpu, Triton for cuda/rocm)",
    "llvm-optimized": "LLVM IR after LLVM's optimization pipeline (cpu; Triton's LLVM IR for cuda/rocm)",
    "asm": "machine code as assembly (cpu; PTX for cuda, AMDGCN for rocm)",
}


def register_stage(name: str, fn: StageFn, help: str) -> None:
    """Make `kiln dump --stage name` print `fn(graph, target)`."""
    _EXTRA[name] = (fn, help)


def _pass_names(target: str = "cpu") -> list[str]:
    from kiln.codegen.backends import get_backend

    backend = get_backend(target)
    return [name for name, _ in backend.graph_passes(backend.options)] + ["fuse"] + (
        ["batch", "batch_updates"] if backend.batches_kernels else [])


def stage_names(target: str = "cpu") -> list[str]:
    return ["exported"] + _pass_names(target) + ["optimized", "kernels", "legalized", "program",
                                                 "source", "llvm-optimized", "asm"] + sorted(_EXTRA)


def stage_help(target: str = "cpu") -> dict[str, str]:
    out = {"exported": BUILTIN_HELP["exported"]}
    out.update({n: f"after the '{n}' pass" for n in _pass_names(target)})
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
    own = tuple(backend.stages)
    if stage not in stage_names(target) and stage not in own:
        extra = f" (and {', '.join(own)} for target {target!r})" if own else ""
        raise KilnUnknownStageError(f"unknown stage {stage!r}; stages are "
                                    f"{', '.join(stage_names(target))}{extra}")
    from kiln.frontend.compile import compile_graph

    # the target's own graph passes, lowered without building machine code (a GPU
    # target compiles here without a GPU; its stages build ahead of time)
    compiled = compile_graph(graph, target, build=False)
    if stage in compiled.stages:
        return str(compiled.stages[stage])
    if stage == "optimized":
        return str(compiled.optimized)
    if stage == "program":
        return compiled.program.format() + "\n"
    kernels = compiled.program.kernels
    if stage in ("kernels", "legalized"):
        from kiln.codegen.kernel_ir import format_kernel

        prepare = backend.legalize if stage == "legalized" else (lambda k: k)
        # a backend may say how it implements a kernel (cuda: CuTeDSL or Triton GEMM, and why)
        texts = [format_kernel(prepare(k)) + (f"\n  # {n}" if (n := backend.kernel_note(k)) else "")
                 for k in kernels.values()]
        return "\n\n".join(texts) + "\n"
    mapping = backend.dump_stages
    backend_stage = stage if stage in own and stage not in mapping else mapping.get(stage)
    if backend_stage is None:
        raise KilnUnknownStageError(f"the {backend.name} backend has no {stage!r} stage; its stages are "
                                    f"{', '.join(own) or '(none)'} ({', '.join(mapping) or 'no'} generic ones)")
    comment = backend.comment(backend_stage)
    parts = []
    for name, kernel in kernels.items():
        parts.append(f"{comment} ---- kernel {name} ----\n{backend.stage_text(kernel, backend_stage)}")
    return "\n".join(parts) + "\n"
