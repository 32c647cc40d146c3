"""Compile traces: what `KILN_TRACE_DIR=DIR` (or `kn.compile(..., trace_dir=DIR)`) writes.

Each compiled specialization gets a folder `DIR/<pid>-<function>-<n>/` holding
`compile.json` (function, backend, times per stage, guards, recompile reason, artifact
cache hits and misses, fusion groups, the files below) and plain-text files: the IR after
every graph stage, the Graphviz DOT of the traced and the fused graph, each kernel's
Kernel IR, generated source and assembly, and the runtime program. At exit, each traced
function's final `stats()` (its cache hits and recompiles) goes to
`DIR/<pid>-<function>-stats.json`. `kiln report DIR` turns the folder into HTML pages.
Everything written is data (JSON and text); the report never executes any of it.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import threading
import time
import warnings
import weakref
from typing import Any

TRACE_VERSION = 1
_COUNTER = itertools.count()
_LOCK = threading.Lock()
_TRACED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_EXIT_HOOK = [False]


def trace_dir(explicit: str | os.PathLike | None = None) -> str | None:
    """The folder to trace into: the explicit argument, else $KILN_TRACE_DIR, else None."""
    if explicit:
        return os.fspath(explicit)
    return os.environ.get("KILN_TRACE_DIR") or None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:60] or "fn"


def record_compile(directory: str, *, function: Any, compiled: Any, backend: str, mode: str,
                   seconds: dict, reason: str | None, guards: list, cache: dict) -> str:
    """Write one compile's trace folder; returns its path.

    `compiled` is a CompiledGraph; `seconds` holds 'trace' and 'compile' wall times;
    `cache` the artifact cache's hits/misses during this compile."""
    name = getattr(function, "__name__", "fn")
    with _LOCK:
        folder = os.path.join(directory, f"{os.getpid()}-{_slug(name)}-{next(_COUNTER)}")
    os.makedirs(folder, exist_ok=True)
    files: dict[str, str] = {}

    def put(key: str, filename: str, text: str) -> None:
        with open(os.path.join(folder, filename), "w", encoding="utf-8") as f:
            f.write(text)
        files[key] = filename

    stage_seconds = dict(getattr(compiled, "stage_seconds", None) or {})
    stages = [{"name": "exported", "file": "stage-00-exported.txt", "seconds": seconds.get("trace")}]
    put("stage:exported", "stage-00-exported.txt", str(compiled.graph))
    for i, (stage, graph) in enumerate(compiled.stages.items(), start=1):
        filename = f"stage-{i:02d}-{_slug(stage)}.txt"
        put(f"stage:{stage}", filename, str(graph))
        stages.append({"name": stage, "file": filename, "seconds": stage_seconds.get(stage)})
    from kiln.ir.render import graph_to_dot, dataflow_graph

    put("dot:exported", "graph-exported.dot", graph_to_dot(compiled.graph))
    put("dot:optimized", "graph-optimized.dot", graph_to_dot(compiled.optimized))
    put("layout:exported", "graph-exported.json", json.dumps(_drawable(dataflow_graph(compiled.graph))))
    put("layout:optimized", "graph-optimized.json",
        json.dumps(_drawable(dataflow_graph(compiled.optimized))))
    put("program", "program.txt", compiled.program.format())
    kernels = _kernels(compiled, backend, put)
    record = {
        "version": TRACE_VERSION,
        "function": name,
        "qualname": getattr(function, "__qualname__", name),
        "source": _source_of(function),
        "pid": os.getpid(),
        "time": time.time(),
        "backend": backend,
        "mode": mode,
        "seconds": {"trace": seconds.get("trace"), "compile": seconds.get("compile"),
                    "passes": sum(s for s in stage_seconds.values() if s)},
        "stages": stages,
        "guards": guards,
        "reason": reason,
        "artifact_cache": cache,
        "fusion_groups": fusion_groups(compiled.optimized),
        "kernels": kernels,
        "files": files,
    }
    with open(os.path.join(folder, "compile.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    return folder


def _kernels(compiled, backend_name: str, put) -> list[dict]:
    """Each kernel's Kernel IR, source and assembly (as `kiln dump` renders them)."""
    from kiln.codegen.backends import get_backend
    from kiln.codegen.kernel_ir import format_kernel
    from kiln.errors import KilnError

    backend = get_backend(backend_name)
    mapping = dict(backend.dump_stages)  # kiln dump's names for the backend's own stages
    out = []
    for name, kernel in compiled.program.kernels.items():
        entry = {"name": name, "kind": type(kernel).__name__}
        slug = _slug(name)
        put(f"kernel:{name}:ir", f"kernel-{slug}.kir.txt", format_kernel(kernel))
        entry["ir"] = f"kernel-{slug}.kir.txt"
        for stage in ("source", "asm"):
            if stage not in mapping:
                continue
            try:
                text = backend.stage_text(kernel, mapping[stage])
            except (KilnError, RuntimeError, ValueError, ImportError, OSError) as e:  # shown, not fatal
                text = f"(could not render {stage}: {e})"
            filename = f"kernel-{slug}.{stage}.txt"
            put(f"kernel:{name}:{stage}", filename, text)
            entry[stage] = filename
        out.append(entry)
    return out


def fusion_groups(optimized) -> list[dict]:
    """The fused groups of the optimized graph, in order: kind, the ops inside, and the
    kernel built for it (kernels are numbered by group)."""
    groups = []
    for node in optimized.body.nodes:
        if node.op != "fused":
            continue
        ops = [inner.op for region in node.regions for inner in region.nodes]
        groups.append({"index": len(groups), "kind": str(node.attrs.get("kind", "")), "ops": ops,
                       "result": ", ".join(str(r.type) for r in node.results)})
    return groups


def _drawable(g) -> dict:
    """A networkx dataflow graph as plain JSON for the report's drawing."""
    nodes = [{"id": n, "label": d.get("label", n), "kind": d.get("kind", "op")}
             for n, d in g.nodes(data=True)]
    edges = [{"source": s, "target": t, "label": d.get("label", "")} for s, t, d in g.edges(data=True)]
    return {"nodes": nodes, "edges": edges}


def _source_of(function) -> str | None:
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return f"{code.co_filename}:{code.co_firstlineno}"


# -- final stats at exit --------------------------------------------------------------------


def remember(directory: str, compiled_function) -> None:
    """Write `compiled_function.stats()` (hits, recompiles with reasons) into the trace
    folder at interpreter exit, and now (so a crash keeps what was known)."""
    with _LOCK:
        _TRACED[id(compiled_function)] = compiled_function
        compiled_function._kiln_trace_dir = directory
        if not _EXIT_HOOK[0]:
            atexit.register(write_stats)
            _EXIT_HOOK[0] = True
    write_stats([compiled_function])


def write_stats(functions=None) -> None:
    """Write each traced function's stats file (all of them by default)."""
    for fn in list(functions if functions is not None else _TRACED.values()):
        directory = getattr(fn, "_kiln_trace_dir", None)
        if not directory:
            continue
        name = getattr(fn, "__name__", "fn")
        path = os.path.join(directory, f"{os.getpid()}-{_slug(name)}-{id(fn):x}-stats.json")
        try:
            stats = fn.stats()
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump({"version": TRACE_VERSION, "function": name, "pid": os.getpid(),
                           "stats": stats}, f, indent=1, default=str)
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # a trace folder removed before exit: nothing to report into


# -- the hook kn.compile calls --------------------------------------------------------------


class CompileRecorder:
    """Times one compile of a CompiledFunction and writes its trace folder."""

    def __init__(self, directory: str, function):
        from kiln.codegen import artifact_cache

        self.directory = directory
        self.function = function
        self.start = time.perf_counter()
        self.traced_at = None
        self.cache_before = dict(artifact_cache.STATS)

    def traced(self) -> None:
        self.traced_at = time.perf_counter()

    def compiled(self, compiled, *, reason: str | None, guards: list) -> None:
        from kiln.codegen import artifact_cache

        done = time.perf_counter()
        traced_at = self.traced_at or self.start
        cache = {k: artifact_cache.STATS.get(k, 0) - self.cache_before.get(k, 0)
                 for k in ("hits", "misses", "writes", "corrupt")}
        fn = self.function
        try:
            record_compile(self.directory, function=fn.fn, compiled=compiled, backend=fn.backend,
                           mode=fn.mode, seconds={"trace": traced_at - self.start,
                                                  "compile": done - traced_at},
                           reason=reason, guards=guards, cache=cache)
            remember(self.directory, fn)
        except OSError as e:  # a full disk or a removed folder must not fail the compile
            warnings.warn(f"kiln: could not write the compile trace into {self.directory}: {e}",
                          RuntimeWarning, stacklevel=3)


def recorder_for(compiled_function) -> CompileRecorder | None:
    """A recorder when tracing is on for this function (its trace_dir= or $KILN_TRACE_DIR)."""
    directory = trace_dir(getattr(compiled_function, "trace_dir", None))
    if directory is None:
        return None
    return CompileRecorder(directory, compiled_function)
