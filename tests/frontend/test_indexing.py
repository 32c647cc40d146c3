"""`tensor[index]` against the same index applied to the numpy array: ints, slices of
any step and bounds, None, Ellipsis, integer lists/arrays/tensors (numpy's placement
rules for one or several advanced indices) and boolean masks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, mutually_broadcastable_shapes

import kiln as kn
from kiln import KilnIndexError

SHAPES = array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


def _array(shape, dtype=np.int64):
    return (np.arange(int(np.prod(shape, dtype=np.int64))) * 3 - 7).astype(dtype).reshape(shape)


def _same(got, want):
    assert isinstance(got, kn.Tensor)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == kn.Tensor(want).dtype
    np.testing.assert_array_equal(got.numpy(), want)


def _slices(size):
    bound = st.one_of(st.none(), st.integers(-size - 3, size + 3))
    step = st.one_of(st.none(), st.integers(-3, 3).filter(bool))
    return st.builds(slice, bound, bound, step)


@st.composite
def basic_index(draw, shape):
    """A tuple of ints, slices, None and at most one Ellipsis that fits `shape`."""
    items, dim = [], 0
    ellipsis = False
    # items after an Ellipsis align with the last dims, so they must reach the end
    while dim < len(shape) and (ellipsis or draw(st.booleans())):
        kind = draw(st.sampled_from(["int", "slice", "slice", "none", "ellipsis"]))
        size = shape[dim]
        if kind == "int" and size:
            items.append(draw(st.integers(-size, size - 1)))
            dim += 1
        elif kind == "none":
            items.append(None)
        elif kind == "ellipsis" and not ellipsis and not any(i is None for i in items[-1:]):
            ellipsis = True
            items.append(Ellipsis)
            dim = len(shape) - draw(st.integers(0, len(shape) - dim))
        else:
            items.append(draw(_slices(size)))
            dim += 1
    if draw(st.booleans()):
        items.append(None)
    return tuple(items)


@settings(deadline=None, max_examples=200)
@given(st.data())
def test_basic_indexing(d):
    shape = d.draw(SHAPES)
    x = _array(shape)
    index = d.draw(basic_index(shape))
    want = x[index]
    _same(kn.tensor(x)[index], want)
    if len(index) == 1:
        _same(kn.tensor(x)[index[0]], x[index[0]])


@settings(deadline=None, max_examples=40)
@given(st.data())
def test_basic_indexing_of_low_precision_and_bool(d):
    dtype = d.draw(st.sampled_from([np.float16, ml_dtypes.bfloat16, np.bool_, np.uint8]))
    shape = d.draw(SHAPES)
    x = (_array(shape) % 5).astype(dtype)
    index = d.draw(basic_index(shape))
    _same(kn.tensor(x)[index], x[index])


def _index_array(draw, shape, size):
    values = draw(st.lists(st.integers(-size, size - 1), min_size=int(np.prod(shape)),
                           max_size=int(np.prod(shape))))
    a = np.array(values, dtype=np.int64).reshape(shape)
    return draw(st.sampled_from(["list", "array", "tensor", "int32"])), a


def _as_kind(kind, a):
    if kind == "list":
        return a.tolist()
    if kind == "tensor":
        return kn.tensor(a)
    if kind == "int32":
        return kn.tensor(a.astype(np.int32))
    return a


@settings(deadline=None, max_examples=200)
@given(st.data())
def test_advanced_indexing_follows_numpy_placement(d):
    shape = d.draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4))
    x = _array(shape)
    rank = len(shape)
    # which dims get an index array: adjacent or not, one or several
    dims = sorted(d.draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=min(rank, 3))))
    bshapes = d.draw(mutually_broadcastable_shapes(num_shapes=len(dims), min_dims=0, max_dims=2,
                                                   min_side=0, max_side=3)).input_shapes
    items_np, items_kn = [], []
    for i in range(rank):
        if i in dims:
            kind, a = _index_array(d.draw, bshapes[dims.index(i)], shape[i])
            if kind == "list" and (a.ndim == 0 or a.size == 0 and a.ndim > 1):
                kind = "array"  # a bare int is basic indexing; [] loses an empty array's shape
            items_np.append(a)
            items_kn.append(_as_kind(kind, a))
        else:
            choice = d.draw(st.sampled_from(["slice", "int", "full"]))
            if choice == "slice":
                s = d.draw(_slices(shape[i]))
                items_np.append(s)
                items_kn.append(s)
            elif choice == "int":
                j = d.draw(st.integers(-shape[i], shape[i] - 1))
                items_np.append(j)
                items_kn.append(j)
            else:
                items_np.append(slice(None))
                items_kn.append(slice(None))
    # trailing full slices may be dropped, or replaced by an Ellipsis
    if d.draw(st.booleans()):
        while items_np and isinstance(items_np[-1], slice) and items_np[-1] == slice(None):
            items_np.pop()
            items_kn.pop()
        if d.draw(st.booleans()):
            items_np.append(Ellipsis)
            items_kn.append(Ellipsis)
    # kiln follows PyTorch where it differs from numpy: an int next to index arrays is
    # basic indexing (its dim is dropped first), not one more broadcast index array
    ints = tuple(i if isinstance(i, int) else slice(None) for i in items_np if i is not Ellipsis)
    rest = tuple(i for i in items_np if not isinstance(i, int))
    want = x[ints][rest]
    _same(kn.tensor(x)[tuple(items_kn)], want)
    if not any(isinstance(i, int) for i in items_np):
        _same(kn.tensor(x)[tuple(items_kn)], x[tuple(items_np)])


def test_int_among_index_arrays_follows_torch_not_numpy():
    torch = pytest.importorskip("torch")
    x = _array((2, 3, 4))
    for index in [(0, slice(None), [0, 1]), (slice(None), 0, [0, 1]), ([1, 0], slice(None), 2),
                  (1, [0, 2], slice(None), ), (0, [[0], [2]], [1, 3])]:
        want = torch.tensor(x)[index]
        got = kn.tensor(x)[index]
        assert got.shape == tuple(want.shape), index
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_advanced_placement_examples():
    x = _array((2, 3, 4, 5))
    t = kn.tensor(x)
    i, j = np.array([0, 2, 1]), np.array([[1], [3]])
    cases = [
        (slice(None), i, j),              # adjacent: the broadcast dims stay in place
        (i[:2] // 2, slice(None), j),     # separated: the broadcast dims go first
        (Ellipsis, i, j[:, :1]),
        (1, i, slice(None), j),           # an int counts as an advanced index in numpy
        (None, slice(None), i, None),
        ([0, 1], [2, 0], [1, 1], [4, -1]),
        (kn.tensor([1]), Ellipsis),
    ]
    for index in cases:
        np_index = tuple(np.asarray(v) if isinstance(v, kn.Tensor) else v for v in index)
        _same(t[index], x[np_index])


@settings(deadline=None, max_examples=100)
@given(st.data())
def test_boolean_masks(d):
    shape = d.draw(array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4))
    x = _array(shape)
    t = kn.tensor(x)
    k = d.draw(st.integers(1, len(shape)))
    start = d.draw(st.integers(0, len(shape) - k))
    mshape = shape[start:start + k]
    mask = np.array(d.draw(st.lists(st.booleans(), min_size=int(np.prod(mshape)),
                                    max_size=int(np.prod(mshape))))).reshape(mshape).astype(bool)
    kind = d.draw(st.sampled_from(["array", "tensor", "list"]))
    m = kn.tensor(mask) if kind == "tensor" else (mask.tolist() if kind == "list" else mask)
    if kind == "list" and mask.size == 0:
        return  # an empty list is an (empty) integer index in numpy, not a mask
    index_np = (slice(None),) * start + (mask,)
    index_kn = (slice(None),) * start + (m,)
    _same(t[index_kn], x[index_np])
    if start == 0:
        _same(t[m], x[mask])
        # the mask can be a comparison on the tensor itself
        if k == len(shape):
            _same(t[t > 0], x[x > 0])


def test_mask_with_other_indices_and_scalar_mask():
    x = _array((3, 4))
    t = kn.tensor(x)
    mask = np.array([True, False, True, True])
    _same(t[1, mask], x[1, mask])
    two = np.array([False, True, False, True])
    _same(t[[0, 2], two], x[[0, 2], two])
    _same(t[:, two.tolist()], x[:, two])
    _same(t[kn.tensor([True, False, True])], x[np.array([True, False, True])])


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_out_of_range_indices_are_kiln_index_errors(d):
    shape = d.draw(array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4))
    x = _array(shape)
    t = kn.tensor(x)
    dim = d.draw(st.integers(0, len(shape) - 1))
    size = shape[dim]
    bad = d.draw(st.one_of(st.integers(size, size + 5), st.integers(-size - 5, -size - 1)))
    kind = d.draw(st.sampled_from(["int", "list", "array", "tensor"]))
    item = {"int": bad, "list": [0 if size else bad, bad] if size else [bad],
            "array": np.array([bad]), "tensor": kn.tensor([bad])}[kind]
    index = (slice(None),) * dim + (item,)
    with pytest.raises(IndexError):
        x[tuple(np.asarray(i) if isinstance(i, kn.Tensor) else i for i in index)]
    with pytest.raises(KilnIndexError):
        t[index]


def test_index_errors_and_messages():
    t = kn.tensor(_array((2, 3)))
    with pytest.raises(KilnIndexError, match="5.*dim 0.*size 2"):
        t[5]
    with pytest.raises(KilnIndexError, match="-4.*dim 1.*size 3"):
        t[:, -4]
    with pytest.raises(KilnIndexError, match="too many indices"):
        t[0, 0, 0]
    with pytest.raises(KilnIndexError, match="ellipsis"):
        t[..., 0, ...]
    with pytest.raises(KilnIndexError, match="step"):
        t[::0]
    with pytest.raises(KilnIndexError, match="float"):
        t[1.5]
    with pytest.raises(KilnIndexError):
        t[np.array([True, False, True])]
    with pytest.raises(KilnIndexError):
        t[kn.tensor([0.0, 1.0])]
    with pytest.raises(KilnIndexError):
        kn.tensor(3.0)[0]


def test_zero_d_and_integer_like_indices():
    x = _array((3, 4))
    t = kn.tensor(x)
    _same(t[np.int64(1)], x[1])
    _same(t[kn.tensor(2)], x[np.array(2)])
    _same(t[np.array(1), 2], x[np.array(1), 2])
    _same(kn.tensor(5.0)[()], np.array(5.0, np.float32))
    _same(kn.tensor(5.0)[None], np.array([5.0], np.float32))
    _same(kn.tensor(5.0)[...], np.array(5.0, np.float32))


def test_indexing_matches_torch():
    torch = pytest.importorskip("torch")
    x = _array((3, 4, 5))
    tt, kt = torch.tensor(x), kn.tensor(x)
    for index in [(slice(None), [0, 2], [1, 3]), ([0, 2], slice(None), [1, 3]),
                  (1, slice(None, None, 2), [4, 0]), (Ellipsis, [1]), (slice(1, None), None, 0)]:
        want = tt[tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)]
        got = kt[index]
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_iteration_and_len():
    x = _array((3, 2))
    t = kn.tensor(x)
    assert len(t) == 3
    rows = list(t)
    assert len(rows) == 3
    for r, w in zip(rows, x):
        _same(r, w)
    with pytest.raises(TypeError):
        len(kn.tensor(1.0))
