"""The CPU's native topk (kiln/codegen/cpu/topk_native.py): exactly the reference's first
`limit` entries of the stable order (ties in index order, NaN largest, -0.0 equal to 0.0)
over float32, float64, int32 and int64, both directions, every limit, one and two
threads, in short lines and in lines of many blocks (whose masked pass keeps exactly the
entries that can enter); what it does not take (other axes, large limits, other dtypes) runs the
reference; compiled topk and its gradient match torch."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import topk_native
from kiln.ir.ops import reduction

SPECIAL = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1.0, -1.0], np.float32)


def _arrays(rng):
    for trial in range(30):
        shape = tuple(int(v) for v in rng.integers(1, 9, size=int(rng.integers(1, 4))))
        yield rng.integers(-3, 3, size=shape).astype(np.float32)  # ties
        yield rng.choice(SPECIAL, size=shape)
        yield rng.integers(-3, 3, size=shape).astype(np.int32)
        x = rng.standard_normal(shape)
        x[x > 1], x[x < -1] = np.nan, -0.0
        yield x
        yield rng.integers(-2 ** 62, 2 ** 62, size=shape).astype(np.int64)


@pytest.mark.parametrize("descending", [False, True])
def test_exactly_the_references_first_entries(split_always, monkeypatch, descending):
    monkeypatch.setattr(topk_native, "SPLIT_ELEMS", 1)
    for x in _arrays(np.random.default_rng(0)):
        for k in range(x.shape[-1] + 1):
            got = topk_native.topk_indices(x, -1, descending, k)
            values, want = reduction.sort.reference(x, axis=x.ndim - 1, descending=descending, limit=k)
            np.testing.assert_array_equal(got, want, err_msg=f"{x.dtype} {x.shape} k={k}")
            (v, i) = topk_native.run_sort([x], {"axis": x.ndim - 1, "descending": descending, "limit": k})
            np.testing.assert_array_equal(v, values)


@pytest.mark.parametrize("descending", [False, True])
def test_long_lines_keep_exactly_the_references_entries(descending):
    """Lines of many BLOCKs: after the first, only a mask's candidates are considered."""
    rng = np.random.default_rng(5)
    n = 9 * topk_native.BLOCK + 13
    lines = [rng.integers(-40, 40, size=(6, n)).astype(np.float32),  # many ties
             rng.choice(SPECIAL, size=(3, n)),  # NaN, -0.0, infinities
             np.sort(rng.standard_normal((2, n)), axis=1),  # every entry better (ascending values)
             np.sort(rng.standard_normal((2, n)), axis=1)[:, ::-1].copy(),
             rng.integers(-50, 50, size=(4, n)).astype(np.int32),
             rng.integers(-2 ** 62, 2 ** 62, size=(3, n)).astype(np.int64)]
    x = rng.standard_normal((4, n))
    x[x > 1.5], x[x < -1.5] = np.nan, -0.0
    lines.append(x)
    for x in lines:
        for k in (1, 2, 7, 10, topk_native.MAX_LIMIT):
            got = topk_native.topk_indices(x, -1, descending, k)
            _, want = reduction.sort.reference(x, axis=1, descending=descending, limit=k)
            np.testing.assert_array_equal(got, want, err_msg=f"{x.dtype} k={k}")


def test_what_it_does_not_take_runs_the_reference():
    x = np.random.default_rng(1).standard_normal((4, 100)).astype(np.float32)
    assert topk_native.topk_indices(x, 0, True, 2) is None  # not the last axis
    assert topk_native.topk_indices(x, -1, True, topk_native.MAX_LIMIT + 1) is None
    assert topk_native.topk_indices(x.astype(np.float16), -1, True, 2) is None
    for attrs in ({"axis": 0, "descending": True, "limit": 2}, {"axis": 1, "descending": False, "limit": None}):
        got = topk_native.run_sort([x], attrs)
        want = reduction.sort.reference(x, **attrs)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_compiled_topk_and_its_gradient_match_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal((6, 50)).astype(np.float32)
    f = kn.compile(lambda a: kn.topk(a, 5))
    g = kn.compile(kn.grad(lambda a: (kn.topk(a, 5)[0] ** 2).sum()))
    tx = torch.from_numpy(x).requires_grad_()
    (torch.topk(tx, 5)[0] ** 2).sum().backward()
    for _ in range(3):
        values, indices = f(x)
        want = torch.topk(torch.from_numpy(x), 5)
        np.testing.assert_array_equal(values.numpy(), want.values.numpy())
        np.testing.assert_array_equal(indices.numpy(), want.indices.numpy())  # no ties here
        np.testing.assert_allclose(g(x).numpy(), tx.grad.numpy(), rtol=1e-6)
