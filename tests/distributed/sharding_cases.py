"""One small input per op of the registry, for the sharded-op numerics walk.

`case(name, rng)` returns (operands as numpy arrays, attrs). Elementwise ops get
same-shape operands of the first dtype their type rule accepts, with values inside
every op's domain (acos, log, rem, shifts). Shapes are chosen so that 4 ranks get
uneven chunks, some of them empty (6 rows: 2, 2, 2, 0).

NOT_RUN names the ops whose operands are not arrays (regions, collective handles,
graph-bound constants); their rules are still checked by the registry walk.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.registry import ELEMENTWISE
from kiln.ir.types import TensorType

NOT_RUN = {
    "cond": "owns regions (its branches are graphs, not arrays)",
    "while_loop": "owns regions",
    "fused": "owns a region (made by the fusion pass)",
    "collective_wait": "its operand is a handle of a collective in flight",
    "constant": "graph-bound: its value lives in the graph, not in an operand",
}
SHAPE = (6, 5)


def _floats(rng, shape, lo=0.2, hi=0.9):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _elementwise(name: str, rng):
    op = registry.get(name)
    n = op.num_operands
    attrs = {}
    if name == "convert":
        attrs = {"dtype": dt.float64}
    if name == "bitcast_convert":
        attrs = {"dtype": dt.int32}
    for dtype in (dt.float32, dt.int32, dt.bool_, dt.complex64):
        types = [TensorType(dtype, SHAPE)] * n
        if name == "select":
            types = [TensorType(dt.bool_, SHAPE), TensorType(dt.float32, SHAPE),
                     TensorType(dt.float32, SHAPE)]
        try:
            op.infer(types, op.normalize_attrs(attrs))
        except Exception:
            continue
        arrays = []
        for t in types:
            if t.dtype == dt.float32:
                arrays.append(_floats(rng, SHAPE))
            elif t.dtype == dt.int32:
                arrays.append(rng.integers(1, 5, SHAPE).astype(np.int32))
            elif t.dtype == dt.bool_:
                arrays.append(rng.integers(0, 2, SHAPE).astype(bool))
            else:
                arrays.append((_floats(rng, SHAPE) + 1j * _floats(rng, SHAPE)).astype(np.complex64))
        if name == "clamp":  # lo <= hi
            arrays[1], arrays[2] = np.minimum(arrays[1], arrays[2]), np.maximum(arrays[1], arrays[2])
        return arrays, attrs
    raise AssertionError("no dtype fits elementwise op %s" % name)


def _lowp(name: str, rng):
    """Quantizers on float32 input; scaled_matmul on the quantizers' own outputs."""
    quant = lambda op, x, **attrs: registry.get(op).reference(  # noqa: E731
        x, **registry.get(op).normalize_attrs(attrs))
    x = _floats(rng, (8, 64))
    if name == "quantize_fp8":
        return [x], {"per_row": True}
    if name in ("quantize_mxfp8", "quantize_nvfp4"):
        return [x], {}
    a, sa = quant("quantize_fp8", _floats(rng, (8, 16)), per_row=True)
    b, sb = quant("quantize_fp8", _floats(rng, (16, 4)))
    return [a, b, sa, sb], {}


def case(name: str, rng):
    """(operands, attrs) for op `name`."""
    if registry.get(name).kind == ELEMENTWISE:
        return _elementwise(name, rng)
    if registry.get(name).family == "lowp":
        return _lowp(name, rng)
    f = lambda *s: _floats(rng, s)  # noqa: E731
    x = f(*SHAPE)
    key = np.array([7, 11], np.uint32)
    world = {"group": "world", "world_size": 4}
    table = {
        "all_reduce": ([x], {"reduce_op": "sum", **world}),
        "all_gather": ([x], {"axis": 1, **world}),
        "reduce_scatter": ([f(8, 5)], {"reduce_op": "sum", "axis": 0, **world}),
        "broadcast": ([x], {"src": 0, **world}),
        "all_to_all": ([f(8, 4)], {"split_axis": 0, "concat_axis": 1, **world}),
        "reduce_sum": ([x], {"axes": (0,)}), "reduce_prod": ([x], {"axes": (1,)}),
        "reduce_max": ([x], {"axes": (0, 1)}), "reduce_min": ([x], {"axes": (0,)}),
        "reduce_and": ([x > 0.5], {"axes": (0,)}), "reduce_or": ([x > 0.5], {"axes": (1,)}),
        "argmax": ([x], {"axis": 0}), "argmin": ([x], {"axis": 1}),
        "cumsum": ([x], {"axis": 0}), "cumprod": ([x], {"axis": 1}),
        "cummax": ([x], {"axis": 0}), "cummin": ([x], {"axis": 1}),
        "sort": ([x], {"axis": 0}),
        "broadcast_in_dim": ([f(6, 1)], {"shape": (6, 4, 5), "broadcast_dimensions": (0, 2)}),
        "concatenate": ([x, f(6, 3)], {"dimension": 1}),
        "dynamic_slice": ([x, np.array(1, np.int64), np.array(0, np.int64)], {"sizes": (3, 5)}),
        "dynamic_update_slice": ([x, f(6, 2), np.array(0, np.int64), np.array(2, np.int64)], {}),
        "pad": ([x, np.array(0.5, np.float32)], {"low": (0, 1), "high": (0, 2), "interior": (0, 0)}),
        "reshape": ([f(8, 6)], {"shape": (4, 2, 6)}),
        "reverse": ([x], {"dims": (1,)}),
        "scatter_along": ([x, rng.integers(0, 5, (6, 3)).astype(np.int64), f(6, 3)],
                          {"axis": 1, "mode": "add"}),
        "slice": ([x], {"start": (0, 1), "limit": (6, 4), "stride": (1, 1)}),
        "take": ([x, rng.integers(0, 5, (3,)).astype(np.int64)], {"axis": 1}),
        "take_along": ([x, rng.integers(0, 6, (6, 5)).astype(np.int64)], {"axis": 0}),
        "transpose": ([x], {"permutation": (1, 0)}),
        "check_index": ([rng.integers(0, 4, (6, 5)).astype(np.int64)],
                        {"size": 4, "caller": "test"}),
        "cholesky": ([_spd(rng, 6)], {}), "eigh": ([_spd(rng, 6)], {}),
        "qr": ([f(6, 4, 3)], {}), "svd": ([f(6, 4, 3)], {}),
        "solve": ([_spd(rng, 6), f(6, 3, 5)], {}),
        "triangular_solve": ([_spd(rng, 6), f(6, 3, 5)], {"lower": True}),
        "full": ([], {"value": 1.5, "dtype": dt.float32, "shape": (6, 5)}),
        "iota": ([], {"dtype": dt.int32, "shape": (6, 5), "dimension": 1}),
        "random_bits": ([key], {"shape": (6, 5)}),
        "conv2d": ([f(6, 4, 5, 5), f(8, 4, 3, 3)], {"padding": (1, 1)}),
        "convolution": ([f(6, 4, 5, 5), f(8, 4, 3, 3)], {"window_strides": (1, 1),
                                                         "padding": ((1, 1), (0, 0))}),
        "dot_general": ([f(6, 8, 5), f(6, 5, 7)], {"lhs_contracting": (2,), "rhs_contracting": (1,),
                                                  "lhs_batch": (0,), "rhs_batch": (0,)}),
        "matmul": ([f(6, 8), f(8, 5)], {}),
        "grouped_matmul": ([f(6, 8), f(3, 8, 5), np.array([2, 0, 4], np.int64)], {}),
        "grouped_matmul_dw": ([f(6, 8), f(6, 5), np.array([2, 0, 4], np.int64)], {}),
        "gelu": ([x], {}), "relu": ([x - 0.5], {}), "sigmoid": ([x], {}), "silu": ([x], {}),
        "softplus": ([x], {}), "stop_gradient": ([x], {}),
        "floor_divide": ([x * 10, x + 0.5], {}), "remainder": ([x * 10, x + 0.5], {}),
        "layer_norm": ([f(6, 4, 5), f(5), f(5)], {"normalized_ndim": 1, "has_weight": True,
                                                   "has_bias": True}),
        "rms_norm": ([f(6, 4, 5), f(4, 5)], {"normalized_ndim": 2, "has_weight": True}),
        "log_softmax": ([x], {"dim": 1}), "softmax": ([x], {"dim": 0}),
        "logsumexp": ([x], {"axes": (1,)}), "mean": ([f(8, 5)], {"axes": (0,)}),
        "var": ([x], {"axes": (0,)}),
        "normal": ([key], {"shape": (6, 5)}), "uniform": ([key], {"shape": (6, 5)}),
        "scaled_dot_product_attention": ([f(6, 2, 4, 3), f(6, 2, 5, 3), f(6, 2, 5, 3)], {}),
        "fft": ([(f(6, 5) + 1j * f(6, 5)).astype(np.complex64)], {"axis": 1, "inverse": True}),
        "rfft": ([f(6, 5)], {"axis": 1, "norm": "ortho"}),
        "irfft": ([(f(6, 3) + 1j * f(6, 3)).astype(np.complex64)], {"axis": 1, "n": 5}),
        "view_as_real": ([(f(6, 5) + 1j * f(6, 5)).astype(np.complex64)], {}),
        "view_as_complex": ([f(6, 5, 2)], {}),
    }
    for base in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        table[base + "_start"] = table[base]
    return table[name]


def _spd(rng, batch: int) -> np.ndarray:
    a = rng.uniform(-1, 1, (batch, 3, 3)).astype(np.float32)
    return (a @ a.transpose(0, 2, 1) + 3 * np.eye(3, dtype=np.float32)).astype(np.float32)


def runnable_ops() -> list[str]:
    return sorted(n for n in registry.all_ops() if n not in NOT_RUN)
