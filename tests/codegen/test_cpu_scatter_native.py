"""scatter_along on the CPU as native code (cpu/scatter_native.py): bit-identical to the
op's numpy reference in both of its sum regimes, the reference's K104 for a bad index,
the reference itself for what the native path does not take, and what compiled programs
run for the op."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.nn import functional as F
from kiln.codegen.cpu import scatter_native
from kiln.codegen.cpu.backend import CpuBackend
from kiln.codegen.kernel_ir import template_externs
from kiln.errors import KilnIndexError
from kiln.ir.ops.shape import scatter_along


def reference(x, idx, upd, axis, mode="add"):
    return scatter_along.reference(x, idx, upd, axis=axis, mode=mode)


def operands(rng, x_shape, idx_shape, axis, dtype, upd_shape=None, negative=True):
    x = rng.standard_normal(x_shape).astype(dtype)
    low = -x_shape[axis] if negative else 0
    idx = rng.integers(low, x_shape[axis], idx_shape)
    upd = rng.standard_normal(upd_shape or idx_shape).astype(dtype)
    return x, idx, upd


CASES = [  # x shape, indices shape, axis
    ((65, 64), (512, 64), 0),      # a token embedding's gradient (many duplicates)
    ((7, 5, 3), (7, 9, 3), 1),
    ((4, 6), (4, 11), -1),
    ((5,), (40,), 0),
    ((3, 1, 2), (3, 4, 2), 1),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("x_shape,idx_shape,axis", CASES)
def test_bit_identical_to_the_reference(dtype, x_shape, idx_shape, axis):
    rng = np.random.default_rng(len(idx_shape) + idx_shape[0])
    x, idx, upd = operands(rng, x_shape, idx_shape, axis, dtype)
    x.flat[:3] = [-0.0, np.inf, np.nan]
    upd.flat[:4] = [-0.0, -np.inf, 1e-30, 3e38]
    assert scatter_native.supports(x, idx, upd, axis % x.ndim)
    with np.errstate(invalid="ignore"):  # inf + -inf, in both
        got = scatter_native.run_scatter_along([x, idx, upd], {"axis": axis, "mode": "add"})[0]
        want = reference(x, idx, upd, axis)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_direct_regime_adds_in_order_as_add_at(dtype):
    """An output far larger than the updates: the reference adds in the output dtype
    (np.add.at), leaving untouched positions as they were (-0.0 stays)."""
    rng = np.random.default_rng(3)
    x, idx, upd = operands(rng, (2000, 40), (6, 40), 0, dtype)
    idx[1] = idx[0]  # duplicates meet on a position
    x[:] = -0.0
    assert x.size > 4 * upd.size + 65536
    got = scatter_native.scatter_add(x, idx, upd, 0)
    want = reference(x, idx, upd, 0)
    assert got.tobytes() == want.tobytes()
    assert np.signbit(got[np.setdiff1d(np.arange(2000), idx % 2000)]).all()


def test_updates_larger_than_the_indices_use_their_leading_block():
    rng = np.random.default_rng(4)
    x, idx, _ = operands(rng, (6, 4), (9, 4), 0, np.float32)
    upd = rng.standard_normal((12, 5)).astype(np.float32)
    got = scatter_native.run_scatter_along([x, idx, upd], {"axis": 0, "mode": "add"})[0]
    assert got.tobytes() == reference(x, idx, upd, 0).tobytes()


def test_no_updates_and_the_result_is_fresh_memory():
    x = np.array([[-0.0, 1.0]], np.float32)
    idx, upd = np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float32)
    got = scatter_native.scatter_add(x, idx, upd, 0)
    assert got.tobytes() == reference(x, idx, upd, 0).tobytes()
    assert not np.may_share_memory(got, x)


@pytest.mark.parametrize("bad", [65, -66, 10 ** 12])
def test_an_index_out_of_range_is_the_references_k104(bad):
    rng = np.random.default_rng(5)
    x, idx, upd = operands(rng, (65, 8), (30, 8), 0, np.float32)
    idx[7, 3], idx[20, 1] = bad, 99  # the first in C order is named
    with pytest.raises(KilnIndexError) as native:
        scatter_native.scatter_add(x, idx, upd, 0)
    with pytest.raises(KilnIndexError) as ref:
        reference(x, idx, upd, 0)
    assert str(native.value) == str(ref.value) and "K104" in str(native.value)
    assert str(bad) in str(native.value)


@pytest.mark.parametrize("case", ["set", "int32", "float16", "narrow indices", "int32 indices"])
def test_what_the_native_path_does_not_take_runs_the_reference(case):
    rng = np.random.default_rng(6)
    x, idx, upd = operands(rng, (6, 4), (9, 4), 0, np.float32, negative=False)
    mode = "add"
    if case == "set":
        mode = "set"
    elif case == "int32":
        x, upd = x.astype(np.int32), upd.astype(np.int32)
    elif case == "float16":
        x, upd = x.astype(np.float16), upd.astype(np.float16)
    elif case == "narrow indices":  # fewer columns than x: not the native layout
        idx, upd = idx[:, :2], upd[:, :2]
    else:
        idx = idx.astype(np.int32)
    # supports() judges the operands; run_scatter_along sends mode "set" to the reference
    assert scatter_native.supports(x, idx, upd, 0) == (case in ("set", "int32 indices"))
    got = scatter_native.run_scatter_along([x, idx, upd], {"axis": 0, "mode": mode})[0]
    assert got.tobytes() == reference(x, idx, upd, 0, mode).tobytes()


def test_the_cpu_backend_runs_it_for_the_op():
    assert template_externs(CpuBackend())["scatter_along"] is scatter_native.run_scatter_along


def _embedding_case(seed):
    """(table, tokens, weights, the gradient of an embedding loss wrt the table, its
    float64 oracle): take's vjp is a scatter-add of the weights' rows."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((65, 16)).astype(np.float32)
    tokens = rng.integers(0, 65, (8, 12))
    weights = rng.standard_normal((8, 12, 16)).astype(np.float32)

    def loss(t, ids, w):
        return (F.embedding(ids, t) * w).sum()

    oracle = np.zeros((65, 16), np.float64)
    np.add.at(oracle, tokens.reshape(-1), weights.reshape(-1, 16).astype(np.float64))
    return table, tokens, weights, kn.grad(loss), oracle


def test_compiled_embedding_gradient_matches_eager_and_numpy():
    """The token-embedding gradient of a compiled step (take's vjp: a scatter-add of the
    rows) against eager kiln and a numpy oracle."""
    table, tokens, weights, grad, oracle = _embedding_case(7)
    compiled = kn.compile(grad)(table, tokens, weights).numpy()
    eager = grad(kn.tensor(table), kn.tensor(tokens), kn.tensor(weights)).numpy()
    np.testing.assert_array_equal(compiled, eager)
    np.testing.assert_allclose(compiled, oracle, rtol=1e-5, atol=1e-5)


def test_a_graphs_scatter_entries_are_built_ahead_and_only_the_ones_it_runs():
    """Each float dtype and sum regime is an entry of its own, built on first use; a
    cold compile builds the ones its graph's nodes will call on the glue thread
    (`template_warmers`), so the first step finds them built."""
    from kiln.codegen.cpu.backend import template_warmers

    table, tokens, weights, grad, oracle = _embedding_case(8)
    graph = kn.trace(grad, table, tokens, weights)
    assert [n.op for n in graph.body.nodes].count("scatter_along") == 1
    scatter_native._entry.cache_clear()
    warmers = template_warmers(graph)
    assert len(warmers) == 1
    warmers[0]()
    assert scatter_native._entry.cache_info().currsize == 1  # float32, one regime only
    text = scatter_native.module_text((scatter_native.entry("float", True),))
    assert text.count("define i64 @") == 1
    got = kn.compile(grad)(table, tokens, weights).numpy()
    info = scatter_native._entry.cache_info()
    assert info.currsize == 1 and info.hits >= 1  # the step ran the entry built ahead
    np.testing.assert_allclose(got, oracle, rtol=1e-5, atol=1e-5)
    # a graph without static operands or of another op yields nothing
    assert template_warmers(kn.trace(lambda t: t * 2, table)) == []
