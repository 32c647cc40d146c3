"""`kn.export` / `kn.load`: a traced program that can be saved, loaded and run.

An ExportedProgram runs compiled code (the graph is compiled for the CPU on its first
call; `backend="reference"` runs the reference interpreter instead). The argument
and result structures travel in the .kir metadata as plain JSON, validated on load
like everything else in the file.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from kiln.errors import KilnArgumentError, KilnError, KilnFormatError
from kiln.ir.graph import Graph
from kiln.ir.interpret import run_graph
from kiln.frontend import pytree
from kiln.frontend.dispatch import to_array
from kiln.frontend.tracing import _leaf, is_tensor_like


class ExportedProgram:
    """A graph plus the structure of its arguments and results.

    >>> prog = kn.export(f, (x, w))
    >>> prog.save("f.kir"); kn.load("f.kir")(x, w)
    """

    def __init__(self, graph: Graph, in_spec: Any, out_spec: Any, static_args: list | None = None,
                 backend: str = "cpu"):
        self.graph = graph
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.static_args = list(static_args or [])
        self.backend = backend
        self._compiled = None

    def __call__(self, *args):
        from kiln.frontend.tensor import Tensor

        leaves, spec = pytree.flatten(tuple(args), _leaf)
        if spec != self.in_spec:
            raise KilnArgumentError(f"@{self.graph.name}: arguments have structure {spec}, the "
                                    f"program was exported with {self.in_spec}")
        statics = dict(self.static_args)
        arrays = []
        for i, leaf in enumerate(leaves):
            if i in statics:
                if leaf != statics[i]:
                    raise KilnArgumentError(f"@{self.graph.name}: argument leaf {i} is {leaf!r} but "
                                            f"the program was exported with {statics[i]!r}")
            elif is_tensor_like(leaf):
                arrays.append(to_array(leaf))
            else:
                raise KilnArgumentError(f"@{self.graph.name}: argument leaf {i} ({leaf!r}) is not a tensor")
        if self.backend == "reference":
            results = run_graph(self.graph, *arrays)
        else:
            if self._compiled is None:
                from kiln.frontend.compile import compile_graph

                self._compiled = compile_graph(self.graph, self.backend)
            results = self._compiled.run(arrays)
        outputs = [Tensor._make(a) for a in results]
        return pytree.unflatten(self.out_spec, outputs)

    def metadata(self) -> dict:
        return {"in_spec": self.in_spec, "out_spec": self.out_spec,
                "static_args": [[i, v] for i, v in self.static_args]}

    def save(self, path: str | os.PathLike) -> None:
        from kiln.ir.archive import save_graph

        save_graph(self.graph, path, metadata=self.metadata())

    def __repr__(self) -> str:
        return f"ExportedProgram(@{self.graph.name}, {len(self.graph.inputs)} inputs)"


def export(fn: Callable, args: tuple, dynamic_shapes=None, backend: str = "cpu") -> ExportedProgram:
    """Trace `fn` on example `args` into a program that saves to a .kir file."""
    from kiln.frontend.gil_guard import require_gil

    require_gil("kn.export")  # the program it returns runs compiled
    if not isinstance(args, tuple):
        args = (args,)
    from kiln.frontend.arg_mutation import trace_for_export

    traced = trace_for_export(_named_after_forward(fn), args, dynamic_shapes)  # K450: mutation
    return ExportedProgram(traced.graph, traced.in_spec, traced.out_spec, traced.static_args, backend)


def _named_after_forward(fn: Callable) -> Callable:
    """A module (an object with `forward`) is traced under `forward`'s signature, so graph
    inputs carry its parameter names and `dynamic_shapes` may be keyed by them, as
    `kn.compile(model)` accepts."""
    import inspect

    forward = getattr(fn, "forward", None)
    if forward is None or not callable(forward) or inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    try:
        params = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return fn

    def call(*args):
        return fn(*args)

    name = type(fn).__name__
    call.__name__ = name if name.isidentifier() else "module"
    call.__signature__ = inspect.Signature(
        [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_ONLY) for p in params])
    return call


def load(path: str | os.PathLike, backend: str = "cpu") -> ExportedProgram:
    """Load a .kir file; a malformed or hostile file raises KilnFormatError."""
    from kiln.frontend.gil_guard import require_gil
    from kiln.ir.archive import load_graph

    require_gil("kn.load")  # the program it returns runs compiled

    graph, metadata = load_graph(path)
    try:
        in_spec = metadata.get("in_spec", {"tuple": ["*"] * len(graph.inputs)})
        out_spec = metadata.get("out_spec", {"tuple": ["*"] * len(graph.outputs)})
        statics = metadata.get("static_args", [])
        if not isinstance(statics, list) or not all(
                isinstance(s, list) and len(s) == 2 and isinstance(s[0], int) for s in statics):
            raise KilnFormatError("static_args must be a list of [index, value] pairs")
        if pytree.count_leaves(in_spec) != len(graph.inputs) + len(statics):
            raise KilnFormatError("in_spec does not match the graph's inputs")
        if pytree.count_leaves(out_spec) != len(graph.outputs):
            raise KilnFormatError("out_spec does not match the graph's outputs")
    except KilnFormatError as exc:
        raise KilnFormatError(f"{os.fspath(path)}: bad metadata: {exc.message}") from None
    except (KilnError, AttributeError, TypeError, ValueError) as exc:
        raise KilnFormatError(f"{os.fspath(path)}: bad metadata: {exc}") from None
    return ExportedProgram(graph, in_spec, out_spec, [tuple(s) for s in statics], backend)
