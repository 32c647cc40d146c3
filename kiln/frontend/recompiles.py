"""Why a compiled function compiled again: recompile explanations and strict mode.

A specialization is guarded by its argument structure, each tensor's dtype and static
dims, and the Python values baked into its trace. When a call fails those guards, the
explanation names, as Dynamo's `TORCH_LOGS=recompiles` does:

- the argument, by parameter name and path into pytrees (`params["w"]`, `batch[1]`);
- what changed (the dim, the dtype, the rank, the Python value) and the guard that
  failed, written as code (`x.shape[0] == 4`);
- the user source line that created the guard: the first line of the user's code that
  computed with that argument while the specialization was traced (every dim an op
  reads there is fixed unless declared dynamic).

`KILN_LOGS=recompiles` (a comma-separated list, as `TORCH_LOGS`) or
`kn.compile(..., explain=True)` prints each explanation to stderr as it happens;
`strict=True` makes any recompile after the first compile a `KilnRecompileError`
(K321) carrying it.

    >>> f = kn.compile(lambda x: x * 2, strict=True)
    >>> f(kn.ones(4)); f(kn.ones(8))    # K321: argument `x` dim 0 changed from 4 to 8 ...
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from kiln.errors import KilnError, user_location
from kiln.ir.emitter import GraphBuilder


class KilnRecompileError(KilnError):
    code = "K321"
    title = "a recompile under strict=True"


class LocatingBuilder(GraphBuilder):
    """A GraphBuilder that remembers, for each graph input, the user line of the first
    op that read it (where its guards were fixed)."""

    def __init__(self, graph=None):
        super().__init__(graph)
        self.first_use: dict[int, str | None] = {}
        self._ids: tuple[int, frozenset] = (-1, frozenset())  # (len(params), their ids)

    def apply(self, op, operands, attrs, regions=None):
        results = super().apply(op, operands, attrs, regions)
        params = self.graph.body.params
        if len(self.first_use) < len(params):
            if self._ids[0] != len(params):  # not once per op: a model has many inputs
                self._ids = (len(params), frozenset(id(p) for p in params))
            ids = self._ids[1]
            for x in operands:
                if id(x) in ids and id(x) not in self.first_use:
                    self.first_use[id(x)] = user_location()
        return results

    def sources(self) -> list[str | None]:
        """Per graph input, in order: the line that first used it (None: unused)."""
        return [self.first_use.get(id(p)) for p in self.graph.body.params]


@dataclass
class SpecializationGuards:
    """What one specialization was traced for: each leaf's path and, for tensor leaves,
    the user line that first used it."""

    paths: list[str]
    sources: dict[int, str | None]  # leaf position -> line


def leaf_paths(fn: Callable, spec: Any, count: int) -> list[str]:
    """A readable path per argument leaf: parameter names, then `[i]` / `["key"]`.

    >>> leaf_paths(lambda params, x: ..., spec, 3)   # ['params["b"]', 'params["w"]', 'x']
    """
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    if spec is None:
        return [names[i] if i < len(names) else f"args[{i}]" for i in range(count)]
    out: list[str] = []

    def walk(node, path: str) -> None:
        if node == "*":
            out.append(path)
        elif isinstance(node, dict):
            for kind, items in node.items():
                if kind == "dict":
                    for key, sub in items:
                        walk(sub, f"{path}[{key!r}]".replace("'", '"'))
                else:
                    for i, sub in enumerate(items):
                        walk(sub, f"{path}[{i}]")

    top = spec.get("tuple", []) if isinstance(spec, dict) else []
    for i, sub in enumerate(top):
        walk(sub, names[i] if i < len(names) else f"args[{i}]")
    return out if len(out) == count else [f"leaf {i}" for i in range(count)]


def explain(key, entries: list[tuple[Any, SpecializationGuards | None]], paths: list[str]) -> str:
    """Why `key` (a cache key of `CompiledFunction`) matches none of `entries` (their keys
    and guards), against the nearest one: every guard it fails, with its source line."""
    spec, parts = key
    parts, duck = _split_duck(parts)
    best = None
    for old_key, guards in entries:
        old_spec, old_parts = old_key
        old_parts, old_duck = _split_duck(old_parts)
        if old_spec != spec or len(old_parts) != len(parts):
            failures = [STRUCTURE_CHANGED]
        else:
            failures = [f for i, (new, old) in enumerate(zip(parts, old_parts)) if new != old
                        for f in [_leaf_failure(i, new, old, paths, guards)]]
            if duck is not None and old_duck is not None and duck != old_duck:
                failures += [f for f in [_duck_failure(duck[1], old_duck[1], paths)] if f]
        if failures and (best is None or len(failures) < len(best)):
            best = failures
    return "; ".join(best) if best else "a new specialization was needed"


def _split_duck(parts) -> tuple:
    """A key's leaf parts, and its duck-sizing pattern part (auto_dynamic) or None."""
    if parts and parts[-1][0] == "duck":
        return parts[:-1], parts[-1]
    return parts, None


STRUCTURE_CHANGED = ("the argument structure changed (a different nesting, container type or "
                     "number of tensors): guard on the pytree structure of the arguments failed")


def _duck_failure(new, old, paths: list[str]) -> str | None:
    """Dims that shared a symbol (equal example sizes) and no longer agree, or back."""
    def name(leaf, axis):
        return f"{paths[leaf] if leaf < len(paths) else f'leaf {leaf}'}.shape[{axis}]"

    before = {(leaf, axis): g for leaf, axis, g in old}
    after = {(leaf, axis): g for leaf, axis, g in new}
    dims = [d for d in before if d in after]
    for a in dims:
        for b in dims:
            if a < b and (before[a] == before[b]) != (after[a] == after[b]):
                if before[a] == before[b]:
                    return (f"`{name(*a)}` and `{name(*b)}` were equal (one symbol) and now "
                            f"differ: guard `{name(*a)} == {name(*b)}` failed")
                return (f"`{name(*a)}` and `{name(*b)}` were different and are now equal: "
                        f"guard `{name(*a)} != {name(*b)}` failed")
    return None  # only dims that left the pattern (a size 0 or 1), reported per leaf


def _leaf_failure(i: int, new, old, paths: list[str], guards) -> str:
    path = paths[i] if i < len(paths) else f"leaf {i}"
    if new[0] == "static" or old[0] == "static":
        return (f"argument `{path}` changed from {old[-1]!r} to {new[-1]!r}: guard "
                f"`{path} == {old[-1]!r}` failed (a Python value is baked into the trace; "
                "pass a tensor to keep one specialization)")
    if new[0] != old[0]:
        text = (f"argument `{path}` dtype changed from {old[0]} to {new[0]}: guard "
                f"`{path}.dtype == {old[0]}` failed")
    elif len(new[1]) != len(old[1]):
        text = (f"argument `{path}` rank changed from {len(old[1])} to {len(new[1])}: guard "
                f"`{path}.ndim == {len(old[1])}` failed")
    else:
        changed = [(axis, b, a) for axis, (a, b) in enumerate(zip(new[1], old[1])) if a != b]
        text = "; ".join(_dim_failure(path, axis, b, a) for axis, b, a in changed)
    source = guards.sources.get(i) if guards is not None else None
    if source:
        text += f"; the guard comes from {source} (the first line that used `{path}`)"
    return text


def _dim_failure(path: str, axis: int, before, after) -> str:
    if before is None:  # a symbolic dim, guarded >= 2 (sizes 0 and 1 are specialized)
        return (f"argument `{path}` dim {axis} is {after}: guard `{path}.shape[{axis}] >= 2` "
                "of its dynamic dim failed (sizes 0 and 1 compile static)")
    if after is None:
        return (f"argument `{path}` dim {axis} changed from {before} to a dynamic size: guard "
                f"`{path}.shape[{axis}] == {before}` failed")
    return (f"argument `{path}` dim {axis} changed from {before} to {after} (not declared "
            f"dynamic): guard `{path}.shape[{axis}] == {before}` failed")


def logging_enabled(explain_flag: bool) -> bool:
    """`explain=True`, or `recompiles` in KILN_LOGS (comma-separated, as TORCH_LOGS)."""
    if explain_flag:
        return True
    names = os.environ.get("KILN_LOGS", "")
    return any(n.strip().lstrip("+") == "recompiles" for n in names.split(","))


def function_location(fn: Callable) -> str:
    """`name (file:line)` of the compiled function, for log lines and errors."""
    name = getattr(fn, "__name__", type(fn).__name__)
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def report(fn: Callable, reason: str, specialization: int) -> None:
    """Print one recompile explanation to stderr (KILN_LOGS=recompiles / explain=True)."""
    print(f"[kiln recompiles] {function_location(fn)}: specialization {specialization} "
          f"compiled because {reason}", file=sys.stderr)


def strict_error(fn: Callable, reason: str) -> KilnRecompileError:
    return KilnRecompileError(
        f"{function_location(fn)} would recompile, and strict=True forbids it: {reason}",
        hint="declare the changing dims dynamic (dynamic=True, or dynamic_shapes= with "
             "ShapeVar), pass changing Python numbers as tensors, or drop strict=True")
