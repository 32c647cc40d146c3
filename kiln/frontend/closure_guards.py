"""Guards on what a function reads besides its arguments, so that eager `kn.grad` can
reuse a traced program and still behave as if it re-traced.

A trace bakes in everything the function closes over: tensors become graph constants,
Python values decide shapes and branches. Reusing the trace is right only while those
are the same objects. `closure_guards(fn, sources)` walks what `fn` can reach (closure
cells, the globals its code names, defaults, `functools.partial` and bound-method
state, object attributes, lists, tuples and dicts, recursively through the functions it
reaches) and returns guards that hold while:

- every binding on those paths still refers to the same object (a rebound global, a
  replaced module attribute or a flipped `training` flag fails it), containers keep
  their length;
- every tensor whose data the trace took as a constant still holds that array (kiln's
  in-place ops, an optimizer step, rebind `_x`, so they fail it).

Python modules, classes and builtins are not walked (their bindings are guarded). A
walk that meets more than `MAX_OBJECTS` objects gives up (None): the caller re-traces
every call, which is never wrong.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import numpy as np

MAX_OBJECTS = 20_000
_ATOMS = (int, float, complex, str, bytes, bool, type(None), np.generic, np.dtype)
_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType, types.BuiltinMethodType)


class Guards:
    """`check()` is True while every binding and constant tensor is unchanged."""

    __slots__ = ("edges", "lengths", "tensors")

    def __init__(self):
        self.edges: list = []    # (getter, owner, key, expected object)
        self.lengths: list = []  # (container, length)
        self.tensors: list = []  # (tensor, its constant array)

    def check(self) -> bool:
        try:
            for get, owner, key, expected in self.edges:
                if get(owner, key) is not expected:
                    return False
        except (KeyError, IndexError, AttributeError, ValueError):
            return False
        for container, n in self.lengths:
            if len(container) != n:
                return False
        for tensor, array in self.tensors:
            if tensor._x is not array:
                return False
        return True


def _cell(cell, _key):
    return cell.cell_contents


def _item(container, key):
    return container[key]


def _attr(obj, key):
    return vars(obj)[key]


def _global(namespace, key):
    return namespace[key]


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:  # nested functions and comprehensions
        if isinstance(const, types.CodeType):
            yield from _names(const)


def closure_guards(fn: Callable, sources: list) -> Guards | None:
    """Guards for reusing a trace of `fn` whose graph constants came from the arrays
    `sources`; None when `fn` reaches too much to guard. (Arguments need none: they are
    pytrees of tensors, scalars, strings and None, all in the cache key.)"""
    from kiln.frontend.tensor import Tensor

    constant_ids = {id(a) for a in sources}
    guards = Guards()
    seen: set[int] = set()
    stack: list = [fn]
    keep = []  # objects whose id is in `seen` stay alive for the walk

    def edge(get, owner, key, child) -> None:
        guards.edges.append((get, owner, key, child))
        stack.append(child)

    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or isinstance(obj, _OPAQUE) or id(obj) in seen:
            continue
        seen.add(id(obj))
        keep.append(obj)
        if len(seen) > MAX_OBJECTS:
            return None
        if isinstance(obj, Tensor):
            if id(obj._x) in constant_ids:
                guards.tensors.append((obj, obj._x))
            continue
        if isinstance(obj, np.ndarray):
            continue  # its identity is guarded by the edge that reached it
        if isinstance(obj, (types.FunctionType, types.LambdaType)):
            for cell in obj.__closure__ or ():
                try:
                    edge(_cell, cell, None, cell.cell_contents)
                except ValueError:  # an empty cell (a name assigned later)
                    continue
            namespace = obj.__globals__
            for name in set(_names(obj.__code__)):
                if name in namespace:
                    edge(_global, namespace, name, namespace[name])
            for i, default in enumerate(obj.__defaults__ or ()):
                edge(_item, obj.__defaults__, i, default)
            if obj.__kwdefaults__:
                stack.append(obj.__kwdefaults__)
            continue
        if isinstance(obj, types.MethodType):
            edge(getattr, obj, "__self__", obj.__self__)
            edge(getattr, obj, "__func__", obj.__func__)
            continue
        if isinstance(obj, functools.partial):
            edge(getattr, obj, "func", obj.func)
            edge(getattr, obj, "args", obj.args)
            edge(getattr, obj, "keywords", obj.keywords)
            continue
        if isinstance(obj, (list, tuple)):
            if isinstance(obj, list):
                guards.lengths.append((obj, len(obj)))
            for i, item in enumerate(obj):
                edge(_item, obj, i, item)
            continue
        if isinstance(obj, dict):
            guards.lengths.append((obj, len(obj)))
            for key, value in list(obj.items()):
                edge(_item, obj, key, value)
            continue
        if isinstance(obj, (set, frozenset)):
            continue  # members cannot be tensors (unhashable) that a trace reads by key
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):  # a module object, an optimizer, a config
            guards.lengths.append((attrs, len(attrs)))
            for key, value in list(attrs.items()):
                edge(_attr, obj, key, value)
    return guards
