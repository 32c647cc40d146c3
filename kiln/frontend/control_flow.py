"""Structured control flow: `kn.cond`, `kn.switch`, `kn.while_loop` (and eager `kn.nonzero`).

Eagerly they are plain Python: pick a branch, loop while the condition holds. While
tracing, each branch (or the loop's condition and body) is traced into its own IR
region, pushed on the builder's region stack, so nested control flow nests regions.
A region must be self-contained: every traced value of an enclosing region that a
branch closes over, and every eager tensor it uses (a constant), becomes an explicit
operand of the node and an extra parameter of each region (for `while_loop`, an extra
carried value that the body passes through unchanged).

A predicate or index that is already known in Python (a Python bool or int, or an
eager tensor) picks the branch at trace time, so only that branch is traced; JAX's
`lax.cond` does the same for concrete predicates under `jit`.

`kn.nonzero` and boolean-mask indexing have data-dependent result shapes: they run
eagerly and raise K140 while tracing (see docs/dynamic-shapes.md).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError, KilnTraceError, user_location
from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER, GraphBuilder, is_python_scalar
from kiln.ir.graph import Region, Value
from kiln.ir.regions import add_params, captured_values
from kiln.ir.types import TensorType
from kiln.frontend import pytree
from kiln.frontend.dispatch import current_builder, emitter_for, raw, to_array
from kiln.frontend.tensor import Tensor

__all__ = ["cond", "switch", "while_loop", "nonzero"]


def _is_leaf(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray)) or is_python_scalar(x) or isinstance(x, str)


def _is_tensor(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray))


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _builder(*trees) -> GraphBuilder | None:
    """The graph being traced, if any: the traced operands' builder, else the active trace."""
    leaves = []
    for tree in trees:
        leaves += pytree.flatten(tree, _is_leaf)[0]
    em = emitter_for(*leaves)
    return em if em is not EAGER else current_builder()


# -- tracing one region ----------------------------------------------------------------------


def _trace_region(builder: GraphBuilder, fn: Callable, types: list[TensorType], call_args,
                  writes: list | None = None):
    """Trace `fn` into a new region whose parameters have `types`; `call_args(params)`
    builds the Python arguments from the parameter tensors. Returns (region, out_spec).
    Handles from outside that fn rebinds in place are put back, and their new values
    appended to `writes` (kiln/frontend/region_mutation.py)."""
    from kiln.frontend import region_mutation

    region = Region([Value(t) for t in types])
    with builder.entering(region):  # constants made inside stay scoped to the region
        with region_mutation.journaling() as journal:
            try:
                result = fn(*call_args([Tensor._make(p, builder) for p in region.params]))
                leaves, spec = pytree.flatten(result, _is_leaf)
                region.results = [region_value(builder, leaf, _name(fn)) for leaf in leaves]
            finally:
                written = region_mutation.settle(journal, region)
    if writes is not None:
        writes.append(written)
    elif written:
        raise region_mutation.unsupported_write(_name(fn), written)
    return region, spec


def region_value(builder: GraphBuilder, leaf, who: str) -> Value:
    """A traced function's result leaf as a value of `builder` (scalars become `full`);
    `who` names the function in errors."""
    if isinstance(leaf, Tensor) and leaf.is_traced:
        if leaf._builder is not builder:
            raise KilnTraceError(f"{who} returned a tensor of another trace", where=user_location())
        return leaf.value
    if _is_tensor(leaf):
        return raw(builder, leaf)
    if is_python_scalar(leaf):
        return builder.full(leaf, dt.python_scalar_dtype(leaf))
    raise KilnTraceError(f"{who} returned a {type(leaf).__name__}; it must return tensors "
                         "(in tuples, lists or dicts)", where=user_location())


def _mismatch(op: str, what: str, index: int, got: TensorType, ref_what: str,
              expected: TensorType) -> Exception:
    cls = KilnDTypeError if got.dtype != expected.dtype else KilnShapeError
    return cls(f"{op}: {what} output {index} is {got} but {ref_what} output {index} is {expected}; "
               "every branch must return the same types", where=user_location(),
               hint="convert or reshape inside the branch so that the outputs agree")


# -- operands: tensors become region parameters, everything else stays Python ----------------


def _split_operands(builder: GraphBuilder, operands: tuple):
    leaves, spec = pytree.flatten(operands, _is_leaf)
    values = [raw(builder, leaf) for leaf in leaves if _is_tensor(leaf)]

    def call_args(params):
        it = iter(params)
        rebuilt = [next(it) if _is_tensor(leaf) else leaf for leaf in leaves]
        return pytree.unflatten(spec, rebuilt)

    return values, call_args


def _traced_branches(op: str, builder: GraphBuilder, index: Value, branches: list[Callable],
                     labels: list[str], operands: tuple):
    from kiln.frontend import region_mutation

    values, call_args = _split_operands(builder, operands)
    types = [v.type for v in values]
    regions, specs, writes = [], [], []
    # an operand written in place through its parameter in a branch is written outside
    watch = region_mutation.OperandWrites(builder, pytree.flatten(operands, _is_leaf)[0], values)
    for fn in branches:
        region, spec = _trace_region(builder, watch.branch(fn), types, watch.call_args(call_args),
                                     writes)
        watch.collect(region, writes[-1])
        regions.append(region)
        specs.append(spec)
    ref = 0 if op == "switch" else 1  # cond's regions are (false, true): compare with true_fn
    for k, (region, spec) in enumerate(zip(regions, specs)):
        if spec != specs[ref]:
            raise KilnShapeError(
                f"{op}: {labels[k]} returns {len(region.results)} output(s) shaped as {spec} but "
                f"{labels[ref]} returns {len(regions[ref].results)} shaped as {specs[ref]}; every "
                "branch must return the same structure", where=user_location())
        for i, (got, want) in enumerate(zip(region.result_types, regions[ref].result_types)):
            if got != want:
                raise _mismatch(op, labels[k], i, got, labels[ref], want)
    n = len(regions[ref].results)
    written = region_mutation.merge_branch_writes(regions, writes)  # in-place writes: results
    captured = captured_values(regions)
    for region in regions:
        add_params(region, captured)
    results = builder.apply("cond", [index] + values + captured, {}, regions=regions)
    for t, r in zip(written, results[n:]):
        watch.bind(t, r)
    region_mutation.resync_views(written)
    tensors = [Tensor._make(r, builder) for r in results[:n]]
    return pytree.unflatten(specs[ref], tensors)


# -- the public functions --------------------------------------------------------------------


def _as_tensor(x, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    try:
        return Tensor._make(to_array(x))
    except (KilnDTypeError, TypeError, ValueError):
        raise KilnArgumentError(f"{what} must be a tensor, got {type(x).__name__}") from None


def cond(pred, true_fn: Callable, false_fn: Callable, *operands):
    """`true_fn(*operands)` if `pred` else `false_fn(*operands)`; traced, both become regions.

    `pred` is a Python bool or a bool scalar tensor. Both branches must return the same
    structure of tensors with the same dtypes and shapes.

    >>> x = kn.tensor([1.0, -2.0])
    >>> kn.cond(x.sum() > 0, lambda v: v * 2, lambda v: -v, x)
    tensor([-1.,  2.], dtype=kiln.float32)
    """
    if isinstance(pred, (bool, np.bool_)):
        return (true_fn if pred else false_fn)(*operands)
    pred = _as_tensor(pred, "cond: pred")
    if pred.ndim != 0 or not pred.dtype.is_bool:
        raise KilnDTypeError(f"cond: pred must be a bool scalar tensor, got {pred.dtype.short}"
                             f"{list(pred.shape)}", where=user_location(),
                             hint="reduce it first: (x > 0).all(), x.sum() > 0")
    builder = _builder(pred, operands)
    if not pred.is_traced:
        return (true_fn if bool(pred.numpy()) else false_fn)(*operands)
    labels = [f"false_fn {_name(false_fn)!r}", f"true_fn {_name(true_fn)!r}"]
    return _traced_branches("cond", builder, pred.value, [false_fn, true_fn], labels, operands)


def switch(index, branches: Sequence[Callable], *operands):
    """`branches[clamp(index, 0, len(branches) - 1)](*operands)`, as `jax.lax.switch`.

    `index` is a Python int or an integer scalar tensor; out-of-range indices clamp.
    Traced, it is one `cond` node with an int32 index and one region per branch.

    >>> kn.switch(kn.tensor(7), [lambda v: v, lambda v: v + 1, lambda v: v * 10], kn.ones(2))
    tensor([10., 10.], dtype=kiln.float32)
    """
    branches = list(branches)
    if not branches or not all(callable(b) for b in branches):
        raise KilnArgumentError("switch: branches must be a non-empty sequence of functions")
    last = len(branches) - 1
    if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
        return branches[min(max(int(index), 0), last)](*operands)
    index = _as_tensor(index, "switch: index")
    if index.ndim != 0 or not index.dtype.is_integer:
        raise KilnDTypeError(f"switch: index must be an integer scalar tensor, got "
                             f"{index.dtype.short}{list(index.shape)}", where=user_location(),
                             hint="for a bool predicate use kn.cond")
    builder = _builder(index, operands)
    if not index.is_traced:
        return branches[min(max(int(index.numpy()), 0), last)](*operands)
    from kiln.frontend.functional import clamp, to

    if index.dtype != dt.int32:
        # clamp in the index's own dtype first: converting 2**32 to int32 would wrap to 0
        index = to(clamp(index, 0, last), dt.int32)
    labels = [f"branch {k} {_name(fn)!r}" for k, fn in enumerate(branches)]
    return _traced_branches("switch", builder, index.value, branches, labels, operands)


def _carried_tensors(carried) -> list[Tensor]:
    if isinstance(carried, (Tensor, np.ndarray)):
        carried = (carried,)
    if not isinstance(carried, (tuple, list)) or not carried:
        raise KilnArgumentError("while_loop: carried must be a non-empty tuple of tensors")
    return [_as_tensor(c, f"while_loop: carried value {i}") if not is_python_scalar(c)
            else Tensor._make(np.asarray(c, dt.python_scalar_dtype(c).np_dtype))
            for i, c in enumerate(carried)]


def _body_outputs(out, n: int, body_fn) -> list:
    if isinstance(out, (Tensor, np.ndarray)) or is_python_scalar(out):
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != n:
        count = len(out) if isinstance(out, (tuple, list)) else type(out).__name__
        raise KilnShapeError(f"while_loop: body_fn {_name(body_fn)!r} returns {count} value(s) but "
                             f"{n} are carried; it must return one per carried value",
                             where=user_location())
    return list(out)


def _type_of(x: Tensor) -> TensorType:
    return x.value.type if x.is_traced else TensorType(x.dtype, x.shape)


def _check_body_types(got: list[TensorType], want: list[TensorType], body_fn) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            cls = KilnDTypeError if g.dtype != w.dtype else KilnShapeError
            raise cls(f"while_loop: body_fn {_name(body_fn)!r} output {i} is {g} but carried value "
                      f"{i} is {w}; the body must return the carried types", where=user_location(),
                      hint="convert or reshape inside the body so that the types stay the same")


def _truth(value, cond_fn) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    t = _as_tensor(value, f"while_loop: cond_fn {_name(cond_fn)!r} result")
    if t.ndim != 0 or not t.dtype.is_bool:
        raise KilnDTypeError(f"while_loop: cond_fn {_name(cond_fn)!r} must return a bool scalar, "
                             f"returns {t.dtype.short}{list(t.shape)}", where=user_location())
    return bool(t.numpy())


def while_loop(cond_fn: Callable, body_fn: Callable, carried, *, max_iterations: int | None = None):
    """Repeat `carried = body_fn(*carried)` while `cond_fn(*carried)`; return the final tuple.

    torch.while_loop's conventions: `cond_fn` returns a bool scalar tensor, `body_fn`
    returns a tuple with the same dtypes and shapes as `carried`. Traced, the loop is
    one `while_loop` node, so its trip count may depend on data.

    `max_iterations=N` stops the loop after at most N trips (even if `cond_fn` is still
    true) and makes it differentiable: `kn.grad` saves each trip's carried values
    (memory: N times the carried size) and runs the trips backwards.

    >>> kn.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (kn.tensor(0), kn.ones(2)))
    (tensor(3), tensor([8., 8.], dtype=kiln.float32))
    """
    if max_iterations is not None and (not isinstance(max_iterations, int)
                                       or isinstance(max_iterations, bool) or max_iterations < 0):
        raise KilnArgumentError(f"while_loop: max_iterations must be a non-negative int, got "
                                f"{max_iterations!r}")
    tensors = _carried_tensors(carried)
    n = len(tensors)
    builder = _builder(tensors)
    if builder is None:
        want = [_type_of(t) for t in tensors]
        trips = 0
        while (max_iterations is None or trips < max_iterations) and \
                _truth(cond_fn(*tensors), cond_fn):
            trips += 1
            out = _body_outputs(body_fn(*tensors), n, body_fn)
            out = [o if isinstance(o, Tensor) else _as_tensor(o, "while_loop: body output") for o in out]
            _check_body_types([_type_of(o) for o in out], want, body_fn)
            tensors = out
        return tuple(tensors)
    if max_iterations is not None:
        return _bounded_while(builder, cond_fn, body_fn, tensors, max_iterations)
    return _traced_while(builder, cond_fn, body_fn, tensors)


def _traced_while(builder: GraphBuilder, cond_fn, body_fn, tensors, attrs: dict | None = None):
    from kiln.frontend import region_mutation

    n = len(tensors)
    values = [raw(builder, t) for t in tensors]
    types = [v.type for v in values]
    cond_region, _ = _trace_region(builder, cond_fn, types, list)
    results = cond_region.result_types
    if len(results) != 1 or results[0].rank != 0 or not results[0].dtype.is_bool:
        raise KilnDTypeError(f"while_loop: cond_fn {_name(cond_fn)!r} must return one bool scalar, "
                             f"returns ({', '.join(map(str, results))})", where=user_location(),
                             hint="reduce it first: (x > 0).all(), i < n")
    writes: list = []
    body, _ = _trace_region(builder, lambda *a: tuple(_body_outputs(body_fn(*a), n, body_fn)),
                            types, list, writes)
    handles = [t for t, _, _ in writes[0].values()]
    if handles:  # outside handles the body writes in place: traced again, carried through
        out = _traced_while(builder, *region_mutation.carried_loop(cond_fn, body_fn, handles, n),
                            list(tensors) + [Tensor._make(t._x, builder) for t in handles], attrs)
        for t, r in zip(handles, out[n:]):
            region_mutation.bind(t, r._x, builder)
        region_mutation.resync_views(handles)
        return out[:n]
    _check_body_types(body.result_types, types, body_fn)
    captured = captured_values([cond_region, body])
    add_params(cond_region, captured)
    passed = add_params(body, captured)
    body.results = body.results + passed  # captured values pass through the body unchanged
    outs = builder.apply("while_loop", values + captured, attrs or {}, regions=[cond_region, body])
    return tuple(Tensor._make(r, builder) for r in outs[:n])


def _bounded_while(builder: GraphBuilder, cond_fn, body_fn, tensors, max_iterations: int):
    """The loop with a trip counter carried first: cond is `t < N and cond_fn(...)`."""
    from kiln.frontend.functional import logical_and

    n = len(tensors)
    counter = Tensor._make(builder.full(0, dt.int32), builder)

    def bounded_cond(t, *carried):
        return logical_and(t < max_iterations, cond_fn(*carried))

    def bounded_body(t, *carried):
        return (t + 1,) + tuple(_body_outputs(body_fn(*carried), n, body_fn))

    out = _traced_while(builder, bounded_cond, bounded_body, [counter] + list(tensors),
                        {"max_trips": max_iterations})
    return out[1:]


# -- data-dependent shapes: eager only ----------------------------------------------------------


def nonzero(x, *, as_tuple: bool = False):
    """Indices of the nonzero elements: int64 `[count, ndim]` (or one vector per dim).

    The count depends on the data, so `nonzero` runs eagerly only; inside a traced or
    compiled function it raises K140 (use `kn.where(mask, x, fill)` to keep shapes static).

    >>> kn.nonzero(kn.tensor([0, 3, 0, 5]))
    tensor([[1],
           [3]])
    """
    if isinstance(x, Tensor) and x.is_traced:
        raise KilnTraceError("nonzero has a data-dependent result shape and cannot be traced",
                             where=user_location(),
                             hint="use kn.where(mask, x, fill) to keep the shape static, or call "
                                  "nonzero outside the compiled function")
    array = x.numpy() if isinstance(x, Tensor) else to_array(x)
    if as_tuple:
        return tuple(Tensor._make(i.astype(np.int64)) for i in np.nonzero(np.atleast_1d(array)))
    return Tensor._make(np.ascontiguousarray(np.argwhere(array).astype(np.int64)))
