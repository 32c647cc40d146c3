"""The per-call fast path of `kn.compile`: a prepared call per exact argument signature.

`signature(args)` is what a call must match to reuse a prepared call: per argument its
shape and dtype (a tensor) or its class and value (a Python scalar baked into the
trace), the nesting of tuples, lists and dicts (their keys) around them, and no tensor
passed twice. That is finer than the specialization cache's
key (whose dynamic dims are wildcards), so every decision the general path makes for a
call — which specialization, which size guards hold, the shape variables' values and
their constraints — is the same for every call of one signature, and is made by the
general path; when the signature comes back (its second call: a signature seen once,
such as a size changing every call, does not pay the ~50 us of preparing) `FastCall`
keeps the answer: the
input positions, a `kiln.runtime.fast_call.FastPlan` for the program at those sizes, and
how the outputs are returned.

What keeps a call on the general path: a tensor on a device, a view (it re-reads its
base), a traced tensor (the general path raises), any other argument type (numpy
scalars, namedtuples, dict subclasses), a strided array (copied there), arguments mutated in place (written
back there), a program the plan does not cover (control flow, externs, launches split
over the pool), a busy plan (another thread), and `kn.profile()`.

    >>> sig, leaves = signature((x,))     # (((4, 4), dtype('float32')),), (x,)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.frontend import pytree
from kiln.frontend.tensor import Tensor

MAX_SIGNATURES = 64  # prepared calls kept per compiled function (then cleared)

_SCALARS = frozenset({int, float, bool, complex, str})


class _SeenOnce:
    """The mark of a signature the general path ran once (falsy: no prepared call)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False


SEEN_ONCE = _SeenOnce()


def signature(args: tuple) -> tuple:
    """(the exact signature of `args` for the fast path, or None: the general path; the
    leaves in pytree order, or `args` itself when every argument is a leaf)."""
    parts = []
    tensors = 0
    for a in args:
        c = a.__class__
        if c is Tensor:
            if a._device is not None or a._builder is not None or a._view is not None:
                return None, args
            x = a._x
            parts.append((x.shape, x.dtype))
            tensors += 1
        elif c is np.ndarray:
            parts.append((a.shape, a.dtype))
            tensors += 1
        elif c in _SCALARS:
            parts.append((c, a))
        else:
            return _nested(args)
    if tensors > 1 and _aliased(args, tensors):
        return None, args
    return tuple(parts), args


def _aliased(leaves, tensors: int) -> bool:
    """The same tensor twice is one handle: a specialization of its own."""
    ids = {id(a) for a in leaves if a.__class__ is np.ndarray or isinstance(a, Tensor)}
    return len(ids) < tensors


class _General(Exception):
    """An argument the fast path does not key: the general path."""


def _nested(args: tuple) -> tuple:
    """`signature` for arguments with containers (tuples, lists, dicts of str keys, None:
    what pytree.flatten walks, in its order) or Tensor subclasses (Parameters): the
    structure is part of the signature, as its JSON text is part of the cache key."""
    parts: list = ["nested"]
    leaves: list = []
    try:
        _walk(args, parts, leaves)
    except (_General, RecursionError):  # the general path gives its own answer or error
        return None, args
    tensors = sum(1 for a in leaves if a.__class__ is np.ndarray or isinstance(a, Tensor))
    if tensors > 1 and _aliased(leaves, tensors):
        return None, args
    return tuple(parts), leaves


def _walk(node, parts: list, leaves: list) -> None:
    c = node.__class__
    if c is Tensor or isinstance(node, Tensor):
        if node._device is not None or node._builder is not None or node._view is not None:
            raise _General
        x = node._x
        parts.append((c, x.shape, x.dtype))
        leaves.append(node)
    elif c is np.ndarray:
        parts.append((c, node.shape, node.dtype))
        leaves.append(node)
    elif c in _SCALARS:
        parts.append((c, node))
        leaves.append(node)
    elif c is dict:
        keys = tuple(node)
        parts.append((dict, keys))
        for k in keys:
            if k.__class__ is not str:
                raise _General  # the general path raises its error
            _walk(node[k], parts, leaves)
    elif c is tuple or c is list:
        parts.append((c, len(node)))
        for item in node:
            _walk(item, parts, leaves)
    elif node is None:
        parts.append(None)
    else:
        raise _General


class FastCall:
    """A specialization bound to one signature: `call(args)` returns the result, or
    None when this call must take the general path."""

    __slots__ = ("inputs", "plan", "out_spec", "single")

    def __init__(self, inputs: tuple, plan, out_spec: Any):
        self.inputs = inputs  # positions of the array arguments, in the program's order
        self.plan = plan
        self.out_spec = out_spec
        self.single = out_spec == "*"

    def __call__(self, leaves):
        arrays = []
        for i in self.inputs:
            a = leaves[i]
            x = a if a.__class__ is np.ndarray else a._x
            if x.__class__ is not np.ndarray or not x.flags.c_contiguous:
                return None  # the general path makes it contiguous (or refuses it)
            arrays.append(x)
        outs = self.plan.run(arrays)
        if outs is None:
            return None
        make = Tensor._make
        if self.single:
            return make(outs[0])
        return pytree.unflatten(self.out_spec, [make(o) for o in outs])


def prepare(leaves, entry, arrays: list, sizes: dict | None) -> FastCall | bool:
    """A FastCall for `entry` (a specialization that just ran on `leaves`, whose array
    leaves are `arrays` at shape-variable values `sizes`), or False when the fast path
    does not apply to it."""
    from kiln.runtime.fast_call import FastPlan

    if entry.write_back is not None or entry.device is not None:
        return False
    statics = entry.static_positions
    inputs = tuple(i for i in range(len(leaves)) if i not in statics)
    if any(not (leaves[i].__class__ is np.ndarray or isinstance(leaves[i], Tensor)) for i in inputs):
        return False
    compiled = entry.compiled
    if sizes is None:
        sizes = compiled.binder(arrays)
    plan = FastPlan.build(compiled.executable, sizes)
    if plan is None:
        return False
    return FastCall(inputs, plan, entry.out_spec)
