"""The registry test: every op carries every rule its kind needs (STYLE.md §1)."""

import inspect

import numpy as np
import pytest

from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder
from kiln.ir.registry import COLLECTIVE, COMPOSITE, CONTROL, ELEMENTWISE, EXTERN, PRIMITIVE
from kiln.ir.types import TensorType

OPS = registry.all_ops()
# ops whose reference needs the surrounding graph rather than arrays alone
GRAPH_BOUND = {"constant"}


def test_registry_holds_the_primitive_set():
    expected = {
        "full", "iota", "constant", "random_bits", "convert", "bitcast_convert",
        "neg", "abs", "sign", "floor", "round", "exp", "log", "sin", "cos", "tanh", "sqrt", "rsqrt",
        "erf", "not", "add", "sub", "mul", "div", "rem", "pow", "max", "min", "and", "or", "xor",
        "shift_left", "shift_right_logical", "shift_right_arithmetic", "eq", "ne", "lt", "le", "gt",
        "ge", "select", "clamp", "reshape", "broadcast_in_dim", "transpose", "slice", "pad",
        "concatenate", "reverse", "dynamic_slice", "dynamic_update_slice", "take", "take_along",
        "scatter_along", "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and",
        "reduce_or", "argmax", "argmin", "cumsum", "cumprod", "sort", "dot_general", "convolution",
        "cond", "while_loop", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
        "all_to_all",
    }
    missing = expected - set(OPS)
    assert not missing, f"primitives missing from the registry: {sorted(missing)}"


def test_user_facing_composites_are_registered():
    composites = {"sigmoid", "relu", "gelu", "silu", "softplus", "mean", "var", "logsumexp",
                  "softmax", "log_softmax", "layer_norm", "rms_norm",
                  "scaled_dot_product_attention", "matmul", "conv2d", "floor_divide",
                  "remainder", "uniform", "normal"}
    missing = composites - {name for name, op in OPS.items() if op.kind == COMPOSITE}
    assert not missing, f"composites missing: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_the_rules_its_kind_needs(name):
    op = OPS[name]
    assert op.kind in (ELEMENTWISE, PRIMITIVE, COMPOSITE, CONTROL, EXTERN, COLLECTIVE)
    assert callable(op.type_rule), f"{name}: no type rule"
    assert op.doc or op.kind == ELEMENTWISE, f"{name}: no docstring saying what it computes"
    if name not in GRAPH_BOUND:
        assert callable(op.reference), f"{name}: no numpy reference"
    if op.kind == COMPOSITE:
        assert callable(op.decompose), f"{name}: composite without a decomposition"
    elif op.kind == ELEMENTWISE:
        # optional: the legalize pass expands it for a backend whose scalar table lacks the op
        assert op.decompose is None or callable(op.decompose), f"{name}: decomposition not callable"
    else:
        assert op.decompose is None, f"{name}: only composites and elementwise ops decompose"
    if op.kind == CONTROL:
        assert "regions" in inspect.signature(op.type_rule).parameters
    else:
        assert op.num_regions == 0
    if op.kind == COLLECTIVE:  # sharding propagation maps layouts through every collective
        assert callable(op.sharding), f"{name}: collective without a sharding rule"
    if op.differentiable and op.kind != COMPOSITE:
        # composites without a rule of their own are differentiated through their decomposition
        assert callable(op.vjp), f"{name}: differentiable op without a vjp rule"
    for attr, default in op.attrs.items():
        assert attr.isidentifier()


@pytest.mark.parametrize("name", sorted(n for n, op in OPS.items() if op.kind == ELEMENTWISE
                                        and op.num_operands in (1, 2)))
def test_elementwise_type_rule_agrees_with_reference(name):
    """Shape and dtype promised by the type rule are what the reference returns."""
    op = OPS[name]
    rng = np.random.default_rng(0)
    tried = 0
    for dtype in (dt.float32, dt.float64, dt.bfloat16, dt.int32, dt.int64, dt.uint8, dt.bool_,
                  dt.complex64):
        data = rng.standard_normal((3, 4)) * 3
        arrays = [np.abs(data).astype(dtype.np_dtype) + (1 if not dtype.is_bool else 0)
                  for _ in range(op.num_operands)]
        arrays = [a.astype(dtype.np_dtype) for a in arrays]
        attrs = {"dtype": dt.float32} if "dtype" in op.attrs else {}
        try:
            types = op.infer([EAGER.type_of(a) for a in arrays], op.normalize_attrs(attrs))
        except Exception as exc:  # the rule refused this dtype: it must say so as a KilnError
            from kiln.errors import KilnError

            assert isinstance(exc, KilnError), f"{name} on {dtype}: {type(exc).__name__}: {exc}"
            continue
        results = EAGER.apply(name, arrays, attrs)
        assert [TensorType(dt.from_numpy(r.dtype), r.shape) for r in results] == types
        tried += 1
    assert tried, f"{name} accepted no dtype at all"


@pytest.mark.parametrize("name", sorted(n for n, op in OPS.items() if op.kind == ELEMENTWISE
                                        and op.num_operands in (1, 2)))
def test_elementwise_rules_work_on_symbolic_shapes(name):
    from kiln.ir.shapes import symbol

    op = OPS[name]
    b = GraphBuilder()
    b.graph.shape_vars["B"] = __import__("kiln").ShapeVar("B")
    for dtype in (dt.float32, dt.int32, dt.bool_, dt.complex64):
        t = TensorType(dtype, (symbol("B"), 4))
        try:
            types = op.infer([t] * op.num_operands,
                             op.normalize_attrs({"dtype": dt.float32} if "dtype" in op.attrs else {}))
        except Exception:
            continue
        assert types[0].shape == t.shape
        return
    pytest.fail(f"{name} accepted no dtype on a symbolic shape")
