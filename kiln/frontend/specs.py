"""Declared dynamic shapes: `TensorSpec([B, T, STATIC])` per argument, given to
`@dynamic_spec`, or as `dynamic_shapes=` to `trace`, `export` and `compile`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from kiln.errors import KilnArgumentError, KilnShapeSpecError
from kiln.ir.shapes import ShapeVar


class _Static:
    """A dim that is fixed at the example input's size."""

    def __repr__(self) -> str:
        return "STATIC"


STATIC = _Static()


@dataclass(frozen=True)
class TensorSpec:
    """One entry per dim: a ShapeVar (dynamic), STATIC / None (the example's size) or an int."""

    dims: tuple

    def __init__(self, dims):
        object.__setattr__(self, "dims", tuple(dims))
        for d in self.dims:
            if not (isinstance(d, (ShapeVar, int)) or d is STATIC or d is None):
                raise KilnArgumentError(f"TensorSpec: entry {d!r} must be a ShapeVar, STATIC, None or an int")


def dynamic_spec(spec: dict[str, TensorSpec]):
    """Declare which dims of which arguments are dynamic; honoured by compile, export and trace.

    >>> @kn.dynamic_spec({"x": TensorSpec([ShapeVar("B", min=1), STATIC])})
    ... def f(x): return x * 2
    """
    if not isinstance(spec, dict):
        raise KilnArgumentError("dynamic_spec: expects a dict from argument name to TensorSpec")

    def wrap(fn: Callable) -> Callable:
        fn.__kiln_dynamic_spec__ = spec
        return fn

    return wrap


def specs_by_position(fn: Callable, args: tuple, dynamic_shapes) -> list:
    """The TensorSpec (or None) of each positional argument of `fn`."""
    spec = dynamic_shapes if dynamic_shapes is not None else getattr(fn, "__kiln_dynamic_spec__", None)
    if spec is None:
        return [None] * len(args)
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(args):
            raise KilnArgumentError(f"dynamic_shapes: {len(spec)} entries for {len(args)} arguments")
        return [_as_spec(s) for s in spec]
    if not isinstance(spec, dict):
        raise KilnArgumentError("dynamic_shapes must be a dict by argument name or a tuple by position")
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    unknown = set(spec) - set(names[:len(args)])
    if unknown:
        raise KilnArgumentError(f"dynamic_shapes names unknown argument(s) {sorted(unknown)}; "
                                f"the function takes {names[:len(args)]}")
    return [_as_spec(spec.get(name)) for name in names[:len(args)]] + [None] * (len(args) - len(names))


def _as_spec(s) -> Any:
    if s is None or isinstance(s, TensorSpec):
        return s
    if isinstance(s, (list, tuple)):
        return TensorSpec(s)
    raise KilnArgumentError(f"dynamic_shapes: {s!r} is not a TensorSpec")


def symbolic_shape(spec: TensorSpec | None, shape: tuple, label: str, shape_vars: dict) -> tuple:
    """The example `shape` with the spec's dynamic dims replaced by their symbols."""
    if spec is None:
        return tuple(shape)
    if len(spec.dims) != len(shape):
        raise KilnShapeSpecError(f"{label}: spec has {len(spec.dims)} dims but the input has shape "
                                 f"{list(shape)}")
    out = []
    for axis, (d, n) in enumerate(zip(spec.dims, shape)):
        if isinstance(d, ShapeVar):
            known = shape_vars.setdefault(d.name, d)
            if known != d:
                raise KilnArgumentError(f"two different ShapeVars are named {d.name}: {known} and {d}")
            broken = d.check(n)
            if broken is not None:
                raise KilnShapeSpecError(f"{label}: dim {axis} ({d.name}) is {n}, which breaks "
                                         f"{d.describe()}", hint=f"the spec requires {broken}")
            out.append(d.symbol)
        elif isinstance(d, int) and n != d:
            raise KilnShapeSpecError(f"{label}: dim {axis} is {n} but the spec fixes it to {d}")
        else:
            out.append(n)
    return tuple(out)
