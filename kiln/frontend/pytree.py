"""Nested containers of tensors (tuples, lists, dicts, None) flattened to leaves and
rebuilt, with a JSON-able description of the structure for exported programs."""

from __future__ import annotations

from typing import Any, Callable

from kiln.errors import KilnArgumentError


def flatten(tree, is_leaf: Callable[[Any], bool]) -> tuple[list, Any]:
    """Leaves in order and a `spec` describing the nesting (JSON-able)."""
    leaves: list = []

    def walk(node):
        if is_leaf(node):
            leaves.append(node)
            return "*"
        if node is None:
            return None
        if isinstance(node, tuple):
            return {"tuple": [walk(x) for x in node]}
        if isinstance(node, list):
            return {"list": [walk(x) for x in node]}
        if isinstance(node, dict):
            keys = list(node)
            if not all(isinstance(k, str) for k in keys):
                raise KilnArgumentError("pytree: dict keys must be strings")
            return {"dict": [[k, walk(node[k])] for k in keys]}
        raise KilnArgumentError(f"pytree: {type(node).__name__} is not a tensor, tuple, list or dict")

    return leaves, walk(tree)


def unflatten(spec, leaves: list):
    """Rebuild the structure `spec` from `leaves`."""
    return _build(spec, iter(leaves))


def _build(node, it):
    # a module-level function, not a closure over `it`: a recursive closure is a
    # reference cycle, which kept every leaf (a compiled function's outputs) alive
    # until the garbage collector ran
    if node == "*":
        return next(it)
    if node is None:
        return None
    if isinstance(node, dict) and len(node) == 1:
        (kind, items), = node.items()
        if kind == "tuple":
            return tuple(_build(x, it) for x in items)
        if kind == "list":
            return [_build(x, it) for x in items]
        if kind == "dict":
            return {k: _build(v, it) for k, v in items}
    raise KilnArgumentError(f"pytree: malformed structure spec {node!r}")


_MAX_DEPTH = 200


def count_leaves(spec, _depth: int = 0) -> int:
    """The number of leaves of a structure spec, checking its whole shape on the way (a
    spec read from a file is untrusted): dict keys are strings, items are lists."""
    if spec == "*":
        return 1
    if spec is None:
        return 0
    if _depth > _MAX_DEPTH:
        raise KilnArgumentError(f"pytree: structure spec nested deeper than {_MAX_DEPTH} levels")
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, items), = spec.items()
        if isinstance(items, list):
            if kind == "dict":
                if not all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)
                           for kv in items):
                    raise KilnArgumentError(f"pytree: a dict spec's items must be [string key, "
                                            f"spec] pairs, got {items!r:.200}")
                return sum(count_leaves(v, _depth + 1) for _, v in items)
            if kind in ("tuple", "list"):
                return sum(count_leaves(x, _depth + 1) for x in items)
    raise KilnArgumentError(f"pytree: malformed structure spec {spec!r:.200}")
