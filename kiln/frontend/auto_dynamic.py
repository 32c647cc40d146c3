"""`kn.compile(dynamic=...)`: which dims become symbolic without a declared spec.

PyTorch's three settings, and what kiln does for each (a `dynamic_shapes=` spec or
`@kn.dynamic_spec` always wins over them):

- `dynamic=False`: every dim of every specialization is static; a new size recompiles.
- `dynamic=True`: every dim of every tensor argument is symbolic from the first call.
- `dynamic=None` (the default, PyTorch's "automatic dynamic"): the first call compiles
  static; a recompile caused by dims that changed marks exactly those dims dynamic, so
  the second specialization serves every later size.

The guards are what the code needs, as Dynamo derives them: a dim of size 0 or 1 stays
static (broadcasting and squeezing depend on it, so a symbolic dim is guarded `>= 2`);
dims whose example sizes are equal share one symbol ("duck sizing": `x + y` over two
equal dims traces without a broadcast), guarded equal; and when the code cannot trace
with a symbolic dim at all (a Python `int` computed from it, a reshape to a literal
size), the specialization falls back to static dims and `stats()` says why. Symbolic
dims apply to tensors passed directly as arguments; tensors inside pytrees (a module's
parameters, a dict of weights) stay static, as PyTorch keeps parameters static.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.frontend.specs import STATIC, TensorSpec
from kiln.ir.shapes import ShapeVar

ALL = "all"


def top_level_tensors(args: tuple) -> dict[int, int]:
    """Leaf position -> argument position, for arguments that are one tensor each."""
    from kiln.frontend import pytree
    from kiln.frontend.tracing import _leaf, is_tensor_like

    out, leaf = {}, 0
    for position, arg in enumerate(args):
        leaves, _ = pytree.flatten(arg, _leaf)
        if len(leaves) == 1 and is_tensor_like(arg):
            out[leaf] = position
        leaf += len(leaves)
    return out


def _shape(arg) -> tuple:
    return tuple(arg.shape) if hasattr(arg, "shape") else np.shape(arg)


def auto_spec(args: tuple, marked) -> tuple | None:
    """A `dynamic_shapes` tuple by argument position: the `marked` dims ({leaf position:
    axes}, or ALL) of top-level tensors symbolic, sizes 0 and 1 kept static, equal sizes
    sharing one ShapeVar. None when no dim ends up symbolic."""
    tensors = top_level_tensors(args)
    symbols: dict[int, ShapeVar] = {}
    specs: list[Any] = [None] * len(args)
    any_symbolic = False
    for leaf, position in tensors.items():
        shape = _shape(args[position])
        axes = set(range(len(shape))) if marked == ALL else set(marked.get(leaf, ()))
        dims = []
        for axis, n in enumerate(shape):
            if axis in axes and n >= 2:
                if n not in symbols:
                    symbols[n] = ShapeVar(f"s{len(symbols)}", min=2)
                dims.append(symbols[n])
                any_symbolic = True
            else:
                dims.append(STATIC)
        specs[position] = TensorSpec(dims)
    return tuple(specs) if any_symbolic else None


def refine_key(parts: list, leaves, dynamic: dict) -> list:
    """Key parts for automatic dims: a symbolic dim's size 0/1 is a key of its own (that
    specialization keeps it static), and the pattern of equal sizes among symbolic dims
    is part of the key (dims that shared a symbol must still be equal)."""
    sizes, pattern = {}, []
    for leaf, axes in sorted(dynamic.items()):
        part = parts[leaf]
        if part[0] == "static":
            continue
        shape = np.shape(leaves[leaf]) if not hasattr(leaves[leaf], "shape") else leaves[leaf].shape
        new = list(part[1])
        for axis in sorted(axes):
            if axis >= len(shape):
                continue
            n = shape[axis]
            if n < 2:
                new[axis] = n
            else:
                pattern.append((leaf, axis, sizes.setdefault(n, len(sizes))))
        parts[leaf] = (part[0], tuple(new))
    parts.append(("duck", tuple(pattern)))
    return parts


def changed_dims(key, old_keys) -> dict[int, set]:
    """Dims (leaf -> axes) that differ from the nearest old key of the same structure,
    dtypes and ranks: what automatic dynamic marks symbolic on a recompile."""
    spec, parts = key
    parts = _leaf_parts(parts)
    best: dict[int, set] | None = None
    for old_spec, old_parts in old_keys:
        old_parts = _leaf_parts(old_parts)
        if old_spec != spec or len(old_parts) != len(parts):
            continue
        changed: dict[int, set] = {}
        ok = True
        for i, (new, old) in enumerate(zip(parts, old_parts)):
            if new == old or new[0] == "duck":
                continue
            if new[0] == "static" or old[0] == "static" or new[0] != old[0] \
                    or len(new[1]) != len(old[1]):
                ok = False
                break
            changed[i] = {a for a, (x, y) in enumerate(zip(new[1], old[1])) if x != y}
        if ok and changed and (best is None or sum(map(len, changed.values()))
                               < sum(map(len, best.values()))):
            best = changed
    return best or {}


def _leaf_parts(parts) -> tuple:
    return parts[:-1] if parts and parts[-1][0] == "duck" else parts


def symbolic_dims(args: tuple, marked) -> list[tuple[int, int]]:
    """The (leaf, axis) pairs `auto_spec` makes symbolic, in order."""
    out = []
    for leaf, position in top_level_tensors(args).items():
        shape = _shape(args[position])
        axes = set(range(len(shape))) if marked == ALL else set(marked.get(leaf, ()))
        out += [(leaf, axis) for axis, n in enumerate(shape) if axis in axes and n >= 2]
    return out
