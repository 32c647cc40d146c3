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


class EagerEmitter(Emitter):
    """Runs each op's numpy reference: this is eager mode."""

    def type_of(self, x) -> TensorType:
        return TensorType(dt.from_numpy(x.dtype), x.shape)

    def constant(self, array: np.ndarray):
        return array

    def apply(self, op: str, operands: Sequence[Any], attrs: dict[str, Any]) -> list:
        opdef = registry.get(op)
        attrs = opdef.normalize_attrs(attrs)
        types = opdef.infer([self.type_of(x) for x in operands], attrs)
        for t in types:  # refuse an absurd result before numpy tries to allocate it
            if all(isinstance(d, int) for d in t.shape):
                nbytes = nbytes_of(t.shape, t.dtype.np_dtype.itemsize)
                if nbytes > memory_limits.process_limit():
                    check_request(f"{op}: the result {t}", nbytes)
        if opdef.reference is None:
            results = self.decompose(op, operands, attrs)
        else:
            result = opdef.reference(*operands, **attrs)
            results = list(result) if isinstance(result, tuple) else [result]
        return _check_results(op, results, types)


EAGER = EagerEmitter()


class GraphBuilder(Emitter):
    """Appends typed nodes to a graph; regions nest for control flow."""

    def __init__(self, graph: Graph | None = None):
        self.graph = graph if graph is not None else Graph()
        self.regions: list[Region] = [self.graph.body]
        self._constant_ids: dict[int, tuple[np.ndarray, Value]] = {}

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
            types = opdef.infer([x.type for x in operands], attrs)
        node = Node(op, list(operands), attrs, types, regions)
        self.region.nodes.append(node)
        return node.results

    def append(self, node: Node) -> list[Value]:
        self.region.nodes.append(node)
        return node.results

    def same_shape(self, a: Value, b: Value) -> bool:
        return shapes_equal(a.shape, b.shape)

    def dims_equal(self, a, b) -> bool:
        return dims_equal(a, b)
