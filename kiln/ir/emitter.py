"""Emitters: one interface for applying ops, whether eagerly or into a graph.

Decompositions and the frontend are written once against `Emitter`; the
`EagerEmitter` runs each op's numpy reference on arrays, the `GraphBuilder` appends
typed nodes to a region. The implicit conveniences of user code (Python scalars,
numpy promotion, broadcasting) become explicit `full`, `convert` and
`broadcast_in_dim` ops here, in one place, so the IR never has to re-derive them.
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import Any, Iterator, Sequence

import numpy as np

from kiln.errors import KilnDTypeError, KilnError
from kiln import memory_limits
from kiln.memory_limits import check_request, nbytes_of
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.shapes import broadcast_shapes, dims_equal, shapes_equal
from kiln.ir.types import TensorType
from kiln.ir.verifier import signature_key
from kiln.ir.quiet_numpy import _QUIET, _extobj_contextvar as _ERRSTATE, float_fn, quiet_state

Scalar = (bool, int, float, complex, np.bool_, np.integer, np.floating, np.complexfloating)


def is_python_scalar(x) -> bool:
    return isinstance(x, Scalar)


class Emitter(abc.ABC):
    """Applies ops to values of one representation (arrays or graph values)."""

    @abc.abstractmethod
    def apply(self, op: str, operands: Sequence[Any], attrs: dict[str, Any]) -> list:
        """Apply `op` and return its results as a list."""

    @abc.abstractmethod
    def type_of(self, x) -> TensorType:
        """The TensorType of one value of this emitter's representation."""

    @abc.abstractmethod
    def constant(self, array: np.ndarray):
        """A value holding the data of `array`."""

    # -- calling ops -------------------------------------------------------------

    def call(self, op: str, *operands, **attrs):
        results = self.apply(op, operands, attrs)
        return results[0] if len(results) == 1 else tuple(results)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        registry.get(name)  # unknown names fail with KilnUnknownOpError
        return lambda *operands, **attrs: self.call(name, *operands, **attrs)

    def decompose(self, op: str, operands: Sequence[Any], attrs: dict[str, Any]) -> list:
        """Apply a composite through its decomposition instead of as one node."""
        opdef = registry.get(op)
        attrs = opdef.normalize_attrs(attrs)
        opdef.infer([self.type_of(x) for x in operands], attrs)  # errors name the composite
        result = opdef.decompose(self, *operands, **attrs)
        return list(result) if isinstance(result, (tuple, list)) else [result]

    # -- explicit conversions ------------------------------------------------------

    def full(self, value, dtype: dt.DType, shape=()):
        if dtype.is_complex:  # `full` is real: a complex fill is two float32 fills
            value = complex(value)
            parts = [self.call("full", value=part, dtype=dt.float32, shape=tuple(shape))
                     for part in (value.real, value.imag)]
            return self.call("complex", *parts)
        return self.call("full", value=value, dtype=dtype, shape=tuple(shape))

    def convert(self, x, dtype: dt.DType):
        dtype = dt.dtype(dtype)
        return x if self.type_of(x).dtype == dtype else self.call("convert", x, dtype=dtype)

    def broadcast_to(self, x, shape):
        """numpy-style broadcast (right-aligned) as an explicit broadcast_in_dim."""
        xt = self.type_of(x)
        shape = tuple(shape)
        if shapes_equal(xt.shape, shape):
            return x
        broadcast_shapes("broadcast_to", xt.shape, shape)  # raises on mismatch
        offset = len(shape) - xt.rank
        return self.call("broadcast_in_dim", x, shape=shape,
                         broadcast_dimensions=tuple(range(offset, len(shape))))

    def as_value(self, x, like_dtype: dt.DType | None = None, shape=()):
        """A Python scalar becomes a `full` of the weak dtype; values pass through."""
        if is_python_scalar(x):
            dtype = dt.python_scalar_dtype(x) if like_dtype is None else like_dtype
            return self.full(x, dtype, shape)
        return x

    def result_dtype(self, *operands) -> dt.DType:
        """Promotion across tensors, then Python scalars as weak types."""
        tensor_dtypes = [self.type_of(x).dtype for x in operands if not is_python_scalar(x)]
        scalars = [x for x in operands if is_python_scalar(x)]
        if not tensor_dtypes:
            result = dt.python_scalar_dtype(scalars[0])
            for s in scalars[1:]:
                result = dt.promote_types(result, dt.python_scalar_dtype(s))
            return result
        result = tensor_dtypes[0]
        for d in tensor_dtypes[1:]:
            result = dt.promote_types(result, d)
        for s in scalars:
            result = dt.weak_scalar_dtype(result, s)
        return result

    def promote(self, op: str, *operands, dtype: dt.DType | None = None) -> list:
        """Operands converted to one dtype and broadcast to one shape, explicitly."""
        dtype = dtype or self.result_dtype(*operands)
        tensor_types = [self.type_of(x) for x in operands if not is_python_scalar(x)]
        if tensor_types:
            out_shape = broadcast_shapes(
                op, *(t.shape for t in tensor_types),
                describe=lambda: " with ".join(str(t) for t in tensor_types))
        else:
            out_shape = ()
        result = []
        for x in operands:
            if is_python_scalar(x):
                result.append(self.full(x, dtype, out_shape))
            else:
                result.append(self.broadcast_to(self.convert(x, dtype), out_shape))
        return result

    def binary(self, op: str, x, y, dtype: dt.DType | None = None):
        a, b = self.promote(op, x, y, dtype=dtype)
        return self.call(op, a, b)

    def shape_of(self, x):
        return self.type_of(x).shape


def _check_results(op: str, results: list, types: list[TensorType]) -> list:
    """Eager results must be exactly what the type rule promised."""
    if len(results) != len(types):
        raise KilnError(f"internal: {op} reference returned {len(results)} results, "
                        f"type rule says {len(types)}")
    out = []
    for r, t in zip(results, types):
        r = np.asarray(r)
        if r.dtype != t.dtype.np_dtype or r.shape != t.shape:
            raise KilnError(f"internal: {op} reference returned {r.dtype}{list(r.shape)}, "
                            f"type rule says {t}")
        out.append(r)
    return out


# A plan is what an eager op's checks concluded for one signature (op, operand dtypes
# and shapes, attributes): the normalized attributes, the result types and the numpy
# dtype and shape each result must have. Replaying it skips the type rule, which would
# reach the same conclusion (and raise nothing) again; a signature that fails its
# checks is never planned, so bad input always goes through them and gets its error.
_PLAN_LIMIT = 4096  # a program with more signatures than this starts the cache over
_ATOMIC_ATTRS = frozenset({int, float, str, bool, type(None), dt.DType})


def _attrs_key(attrs: dict[str, Any]):
    """A hashable key for attributes whose equality is exact (a bool is not an int, a
    tuple holds only ints, -0.0 is not 0.0; NaN never equals itself, so it never hits),
    or None when they have anything else. Equal keys mean identical attributes: a plan
    replays the attributes of the call that made it."""
    items = []
    for name, value in attrs.items():
        kind = type(value)
        if kind is tuple:
            for v in value:
                if type(v) is not int:
                    return None
        elif kind is float:  # -0.0 == 0.0: the sign too, as the plan replays these attrs
            items.append((name, kind, value, math.copysign(1.0, value)))
            continue
        elif kind not in _ATOMIC_ATTRS:
            return None
        items.append((name, kind, value))
    return tuple(items)


def _signature(op: str, typed: Sequence[Any], attrs: dict[str, Any]) -> tuple | None:
    """(op, dtype, shape, dtype, shape, ..., attributes), or None when an operand is not
    an ndarray or an attribute has no exact key (those are checked on every call)."""
    if len(typed) == 2:  # the common cases first, without a loop
        a, b = typed
        if type(a) is not np.ndarray or type(b) is not np.ndarray:
            return None
        key = (op, a.dtype, a.shape, b.dtype, b.shape)
    elif len(typed) == 1:
        a = typed[0]
        if type(a) is not np.ndarray:
            return None
        key = (op, a.dtype, a.shape)
    else:
        parts = [op]
        for x in typed:
            if type(x) is not np.ndarray:
                return None
            parts.append(x.dtype)
            parts.append(x.shape)
        key = tuple(parts)
    if attrs:
        akey = _attrs_key(attrs)
        return None if akey is None else (key, akey)
    return key


class _Plan:
    """One signature's conclusions, and how to run it: `reference` (with `dtype`/`shape`,
    the one result it must give) when the op is a reference without attributes giving one
    result; `direct`, the bare numpy function such a float32/64 reference runs quietly
    (`float_fn`); `trusted` once `direct` is a ufunc whose result passed the check: numpy
    picks a ufunc's loop from the operand dtypes alone, so an operand list of the planned
    dtypes gives that result type and shape again, and the check is not repeated."""

    __slots__ = ("opdef", "attrs", "types", "outs", "nbytes", "reference", "dtype", "shape",
                 "direct", "trusted")

    def __init__(self, opdef, attrs, types):
        self.opdef, self.attrs, self.types = opdef, attrs, types
        self.outs = tuple((t.dtype.np_dtype, tuple(t.shape)) for t in types)
        self.nbytes = max((nbytes_of(t.shape, t.dtype.np_dtype.itemsize) for t in types),
                          default=0)
        single = opdef.reference is not None and not attrs and len(types) == 1
        self.reference = opdef.reference if single else None
        self.dtype, self.shape = self.outs[0] if single else (None, None)
        self.direct = None
        self.trusted = False

    def with_direct(self, dtypes) -> "_Plan":
        """This plan, calling the bare numpy function for operands of `dtypes` when there is one."""
        if self.reference is not None and quiet_state() is not None:
            self.direct = float_fn(self.reference, dtypes)
        return self


class EagerEmitter(Emitter):
    """Runs each op's numpy reference: this is eager mode.

    The per-op checks (attributes, type rule, memory limit) run once per signature; a
    repeated signature replays their plan, so a small op costs little more than its
    numpy call (issue 22)."""

    def __init__(self):
        # cleared in place, never replaced: the lean eager path holds these dicts
        self._plans: dict[tuple, _Plan] = {}
        self._alike: dict[tuple, _Plan] = {}  # run1's: (op, dtype, shape, arity) -> plan
        self._types: dict[tuple, TensorType] = {}

    def type_of(self, x) -> TensorType:
        key = (x.dtype, x.shape)
        t = self._types.get(key)
        if t is None:
            t = TensorType(dt.from_numpy(x.dtype), x.shape)
            if len(self._types) >= _PLAN_LIMIT:
                self._types.clear()
            self._types[key] = t  # frozen, so one object serves every array of this type
        return t

    def constant(self, array: np.ndarray):
        return array

    def apply(self, op: str, operands: Sequence[Any], attrs: dict[str, Any]) -> list:
        return self.run(op, operands, attrs, operands)

    def run(self, op: str, operands: Sequence[Any], attrs: dict[str, Any],
            typed: Sequence[Any]) -> list:
        """`apply`, with the checks made on the types of `typed` instead of `operands`'
        own: the lean eager path passes a Python scalar's fill as a 0-d array that numpy
        broadcasts, typed as the full-shape `full` the general path would make."""
        key = _signature(op, typed, attrs)
        if key is not None:
            plan = self._plans.get(key)
            if plan is not None and plan.nbytes <= memory_limits._limit:  # process_limit()
                if plan.reference is not None:
                    return [self.call1(op, plan, operands)]
                return self._replay(op, plan, operands)
        plan = self._plan(op, [self.type_of(x) for x in typed], attrs)
        plan.with_direct([x.dtype for x in typed])
        if key is not None:
            if len(self._plans) >= _PLAN_LIMIT:
                self._plans.clear()
            self._plans[key] = plan
            if plan.reference is not None and len(typed) == 1:  # where the lean path looks
                self._remember_alike(op, typed[0], 1, plan)
        return self._replay(op, plan, operands)

    def _remember_alike(self, op: str, like: np.ndarray, arity: int, plan: _Plan) -> None:
        if len(self._alike) >= _PLAN_LIMIT:
            self._alike.clear()
        self._alike[(op, like.dtype, like.shape, arity)] = plan

    def run1(self, op: str, operands: Sequence[Any], like: np.ndarray, arity: int):
        """The one result of an op without attributes whose `arity` operands all have the
        type of the array `like` (the lean eager path's elementwise ops; a Python
        scalar's 0-d fill is typed as the full-shape `full` it stands for): `run` with
        nothing but the plan lookup, the numpy call and the result check between the
        caller and numpy. The plan is kept in `_alike`, where the lean path looks first."""
        plan = self._alike.get((op, like.dtype, like.shape, arity))
        if plan is not None and plan.nbytes <= memory_limits._limit:  # process_limit()
            return self.call1(op, plan, operands)
        typed = (like,) * arity
        result = self.run(op, operands, {}, typed)[0]
        plan = self._plans.get(_signature(op, typed, None))
        if plan is not None and plan.reference is not None and type(like) is np.ndarray:
            self._remember_alike(op, like, arity, plan)
        return result

    def call1(self, op: str, plan: _Plan, operands: Sequence[Any]) -> np.ndarray:
        """The one result of a single-result plan without attributes (`plan.reference`) on
        operands of its planned dtypes (numpy broadcasts a smaller one to the planned
        shape), checked against the plan until `plan.trusted`."""
        direct = plan.direct
        if direct is not None:  # float32/64: the numpy function, quietly, unwrapped
            token = _ERRSTATE.set(_QUIET.get(_ERRSTATE.get()) or quiet_state())
            try:
                r = direct(*operands)
            finally:
                _ERRSTATE.reset(token)
            if plan.trusted:
                return r
            if type(r) is not np.ndarray:  # a ufunc's 0-d result is a numpy scalar
                r = np.asarray(r)
            if r.dtype == plan.dtype and r.shape == plan.shape:
                plan.trusted = type(direct) is np.ufunc and plan.shape != ()
                return r
        r = plan.reference(*operands)
        if type(r) is not np.ndarray:
            r = np.asarray(r)
        if r.dtype != plan.dtype or r.shape != plan.shape:
            _check_results(op, [r], plan.types)
        return r

    def call_plan(self, op: str, plan: _Plan, operands: Sequence[Any]) -> np.ndarray:
        """The first result of any plan (with attributes, a composite's too) on operands of
        its planned types, checked."""
        if plan.reference is not None:
            return self.call1(op, plan, operands)
        return self._replay(op, plan, operands)[0]

    def plan_types(self, op: str, types: Sequence[TensorType], attrs: dict[str, Any]) -> _Plan:
        """The plan of `op` on operands of `types` (every check made; bad input raises its
        numbered error), for callers that run it with `call1` (the lean eager path's
        broadcasting binary ops)."""
        return self._plan(op, types, attrs).with_direct([t.dtype.np_dtype for t in types])

    def _plan(self, op: str, types: Sequence[TensorType], attrs: dict[str, Any]) -> _Plan:
        """Every check of an eager op, raising its numbered error on bad input."""
        opdef = registry.get(op)
        attrs = opdef.normalize_attrs(attrs)
        types = opdef.infer(list(types), attrs)
        for t in types:  # refuse an absurd result before numpy tries to allocate it
            if all(isinstance(d, int) for d in t.shape):
                nbytes = nbytes_of(t.shape, t.dtype.np_dtype.itemsize)
                if nbytes > memory_limits.process_limit():
                    check_request(f"{op}: the result {t}", nbytes)
        return _Plan(opdef, attrs, types)

    def _replay(self, op: str, plan: _Plan, operands: Sequence[Any]) -> list:
        opdef = plan.opdef
        if opdef.reference is None:  # a composite: its parts are planned one by one
            result = opdef.decompose(self, *operands, **plan.attrs)
            results = list(result) if isinstance(result, (tuple, list)) else [result]
        else:
            result = opdef.reference(*operands, **plan.attrs)
            results = list(result) if isinstance(result, tuple) else [result]
        outs = plan.outs
        if len(results) == 1 and len(outs) == 1:
            r = results[0]
            if type(r) is not np.ndarray:
                r = np.asarray(r)
            if r.dtype != outs[0][0] or r.shape != outs[0][1]:
                _check_results(op, [r], plan.types)
            return [r]
        return _check_results(op, results, plan.types)


EAGER = EagerEmitter()


class GraphBuilder(Emitter):
    """Appends typed nodes to a graph; regions nest for control flow."""

    def __init__(self, graph: Graph | None = None):
        self.graph = graph if graph is not None else Graph()
        self.regions: list[Region] = [self.graph.body]
        self._constant_ids: dict[int, tuple[np.ndarray, Value]] = {}
        self._types: dict[tuple, tuple] = {}  # see `_infer`

    @property
    def region(self) -> Region:
        return self.regions[-1]

    @contextlib.contextmanager
    def entering(self, region: Region) -> Iterator[Region]:
        """Emit into `region` inside the block, then back into the enclosing region.
        Constants made inside stay scoped to it (a value defined in a region cannot be
        reused outside it).

        >>> with builder.entering(branch):
        ...     branch.results = [builder.add(*branch.params)]
        """
        saved_constants = dict(self._constant_ids)
        self.regions.append(region)
        try:
            yield region
        finally:
            self.regions.pop()
            self._constant_ids = saved_constants

    def constant_sources(self) -> list[np.ndarray]:
        """The arrays the constants made so far (in this region and those around it) were
        made from: what a cached trace must guard on (eager kn.grad)."""
        return [source for source, _ in self._constant_ids.values()]

    def type_of(self, x) -> TensorType:
        if not isinstance(x, Value):
            raise KilnDTypeError(f"expected a graph value, got {type(x).__name__}")
        return x.type

    def add_input(self, type: TensorType, name: str | None = None) -> Value:
        value = Value(type, name)
        self.graph.body.params.append(value)
        return value

    def constant(self, array: np.ndarray) -> Value:
        # keyed by identity, so the entry keeps the array alive: a freed temporary's id
        # may be reused by another array later in the same trace
        key = id(array)
        hit = self._constant_ids.get(key)
        if hit is not None and hit[0] is array:
            return hit[1]
        source = array
        array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes 0-d 1-d
        name = f"c{len(self.graph.constants)}"
        while name in self.graph.constants:
            name += "_"
        self.graph.constants[name] = array
        value = self.call("constant", name=name, dtype=dt.from_numpy(array.dtype),
                          shape=tuple(array.shape))
        self._constant_ids[key] = (source, value)
        return value

    def apply(self, op: str, operands: Sequence[Any], attrs: dict[str, Any],
              regions: list[Region] | None = None) -> list:
        opdef = registry.get(op)
        attrs = opdef.normalize_attrs(attrs)
        for x in operands:
            if not isinstance(x, Value):
                raise KilnDTypeError(
                    f"{op}: operands must be graph values, got {type(x).__name__}")
        if opdef.num_regions is None or opdef.num_regions:
            types = opdef.infer([x.type for x in operands],
                                dict(attrs, regions=regions or []))
        else:
            types = self._infer(opdef, operands, attrs)
        node = Node(op, list(operands), attrs, types, regions)
        self.region.nodes.append(node)
        return node.results

    def _infer(self, opdef, operands: Sequence[Value], attrs: dict[str, Any]) -> list:
        """The result types of a region-free node. A trace repeats few signatures (the GPT
        training step: ~1700 nodes built, a few hundred distinct): a type rule is a pure
        function of the operands' dtypes and shapes and the exactly-typed attributes (the
        verifier's memo relies on the same), so within one builder a signature's rule runs
        once and its result types (immutable) are shared. A rule that raises is never
        remembered: the next node of that signature raises too."""
        try:
            key = signature_key(opdef.name, operands, attrs)
            known = self._types.get(key)
        except TypeError:  # an unhashable attribute (a list, an array): not memoized
            return opdef.infer([x.type for x in operands], attrs)
        if known is None:
            known = self._types[key] = tuple(opdef.infer([x.type for x in operands], attrs))
        return list(known)

    def append(self, node: Node) -> list[Value]:
        self.region.nodes.append(node)
        return node.results

    def same_shape(self, a: Value, b: Value) -> bool:
        return shapes_equal(a.shape, b.shape)

    def dims_equal(self, a, b) -> bool:
        return dims_equal(a, b)
