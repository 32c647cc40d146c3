"""Property test: on random graphs full of the shapes the patterns look for (constant
operands, transpose/reshape/broadcast chains, converts, negations, repeats), every
exact pass and the exact part of the pipeline give bit-identical results, on inputs
that include -0.0, inf and NaN (where a careless `x + 0` or `x * 0` would show)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.interpret import run_graph
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.passes.canonicalize import canonicalize
from kiln.passes.cse import cse
from kiln.passes.dce import dce
from kiln.passes.fold_constants import fold_constants
from kiln.passes.manager import Pipeline

SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.5, 3.0], np.float64)
DTYPES = [dt.float32, dt.float16, dt.int32, dt.int8]


def _fill(draw, dtype):
    if dtype.is_integer:
        return draw(st.sampled_from([0, 1, -1, 2, 256]))
    return draw(st.sampled_from([0, 0.0, -0.0, 1, 1.0, 2.0, float("nan"), float("inf")]))


@st.composite
def random_graphs(draw):
    b = GraphBuilder()
    dtype = draw(st.sampled_from(DTYPES))
    x = b.add_input(TensorType(dtype, (2, 3)), "x")
    values = [x]
    for _ in range(draw(st.integers(1, 10))):
        v = draw(st.sampled_from(values))
        t = v.type
        kind = draw(st.sampled_from(["binary_const", "const_binary", "binary", "neg", "transpose2",
                                     "reshape2", "broadcast", "convert2", "select", "repeat"]))
        if kind in ("binary_const", "const_binary"):
            op = draw(st.sampled_from(["add", "sub", "mul", "div", "max", "min"]))
            c = b.full(_fill(draw, t.dtype), t.dtype, t.shape)
            values.append(b.call(op, v, c) if kind == "binary_const" else b.call(op, c, v))
        elif kind == "binary":
            w = draw(st.sampled_from(values))
            if w.type == t:
                values.append(b.call(draw(st.sampled_from(["add", "mul", "max"])), v, w))
        elif kind == "neg":
            values.append(b.neg(b.neg(v)) if draw(st.booleans()) else b.neg(v))
        elif kind == "transpose2" and t.rank == 2:
            values.append(b.transpose(b.transpose(v, permutation=(1, 0)), permutation=(1, 0)))
        elif kind == "reshape2":
            flat = b.reshape(v, shape=(int(np.prod(t.shape)),))
            values.append(b.reshape(flat, shape=tuple(t.shape)))
        elif kind == "broadcast" and t.rank == 2:
            up = b.broadcast_in_dim(v, shape=(1,) + tuple(t.shape), broadcast_dimensions=(1, 2))
            values.append(b.reshape(b.broadcast_in_dim(up, shape=(2,) + tuple(t.shape),
                                                       broadcast_dimensions=(0, 1, 2)),
                                    shape=(2 * t.shape[0], t.shape[1])))
        elif kind == "convert2":
            mid = draw(st.sampled_from([dt.float64, dt.float32, dt.int64, dt.float16]))
            values.append(b.convert(b.convert(v, mid), t.dtype))
        elif kind == "select":
            pred = b.full(draw(st.booleans()), dt.bool_, t.shape)
            values.append(b.select(pred, v, b.neg(v)))
        elif kind == "repeat":
            values.append(b.add(b.abs(v), b.abs(v)))
    b.graph.body.results = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3))
    return b.graph, dtype


def _input(dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype.is_integer:
        return rng.integers(-100, 100, size=(2, 3)).astype(dtype.np_dtype)
    return rng.choice(SPECIAL, size=(2, 3)).astype(dtype.np_dtype)


def _same_bits(a, b):
    """Equal bit for bit, signed zeros included; a NaN need only stay a NaN (IEEE
    leaves the sign and payload of a computed NaN unspecified)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.kind != "f":
        assert a.tobytes() == b.tobytes()
        return
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    assert np.array_equal(a[~nan], b[~nan]) and np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan]))


EXACT = Pipeline([("canonicalize", canonicalize), ("fold_constants", fold_constants),
                  ("cse", cse), ("dce", dce)], debug=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@given(random_graphs(), st.integers(0, 2 ** 16))
def test_exact_passes_keep_every_bit(case, seed):
    graph, dtype = case
    x = _input(dtype, seed)
    want = run_graph(graph, x)
    for fn in (canonicalize, fold_constants, cse, dce, EXACT):
        result = fn(graph)
        verify(result)
        for w, g in zip(want, run_graph(result, x)):
            _same_bits(g, w)
