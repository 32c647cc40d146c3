"""The lean eager path's binary plans (kiln/frontend/eager_path.py, issue 22 item 5):
broadcasting, promotion, 0-d tensors, int and bool operands and Python scalars give what
the general path gives (the oracle: the same call with the lean path switched off), with
the same dtype and the same numbered errors, on the call that plans and on the ones that
replay; torch checks the promotion rules themselves."""

from __future__ import annotations

import gc
import operator
import warnings

import ml_dtypes
import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnError
from kiln.frontend import dispatch, eager_path, functional, methods
from kiln.runtime import set_memory_fraction

torch = pytest.importorskip("torch")

OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
       "pow": operator.pow, "floordiv": operator.floordiv, "mod": operator.mod,
       "maximum": kn.maximum, "minimum": kn.minimum, "eq": operator.eq, "lt": operator.lt,
       "ge": operator.ge, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
       "atan2": kn.atan2}
INEXACT_OPS = {"pow", "atan2"}  # numpy may take another loop for a broadcast operand
SHAPES = [((3, 4), (4,)), ((3, 1), (1, 4)), ((3, 4), ()), ((), (3, 4)), ((2, 3, 4), (3, 1))]
DTYPES = [(np.float32, np.float32), (np.float32, np.float64), (np.float16, np.float32),
          (ml_dtypes.bfloat16, np.float32), (np.int32, np.float32), (np.int64, np.int32),
          (np.uint8, np.int8), (np.bool_, np.float32), (np.bool_, np.bool_),
          (np.int32, np.int32), (np.float64, np.float64)]
SCALARS = [2, 1.5, True, -0.0, -3]


def _data(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    values = rng.uniform(-3.0, 3.0, shape)
    if np.dtype(dtype) == np.bool_:
        return values > 0
    if np.dtype(dtype).kind in "iu":
        values = np.where(values == 0, 1, np.round(values) + (3 if np.dtype(dtype).kind == "u" else 0))
    return np.asarray(values).astype(dtype)


@pytest.fixture
def general_path(monkeypatch):
    """Runs a function with every lean eager entry point switched off."""

    def run(fn):
        with monkeypatch.context() as m:
            for module in (dispatch, functional, methods):
                for name in ("eager_binary", "lean_binary", "eager_apply"):
                    if hasattr(module, name):
                        m.setattr(module, name, lambda *a, **k: None)
            return fn()
    return run


def _outcome(fn):
    try:
        out = fn()
    except KilnError as e:
        return type(e)
    return out.numpy().copy()


def _same(got, want, inexact: bool):
    if isinstance(want, type):
        assert got is want, f"the lean path gave {got!r}, the general path raised {want.__name__}"
        return
    assert not isinstance(got, type), f"the lean path raised {got.__name__}"
    assert got.dtype == want.dtype and got.shape == want.shape
    if inexact:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-6)
    else:
        if got.dtype.kind == "V":  # ml_dtypes' floats: numpy's NaN-equal compare needs a builtin one
            got, want = got.astype(np.float64), want.astype(np.float64)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", sorted(OPS))
def test_tensor_operands_match_the_general_path(name, general_path):
    op = OPS[name]
    for i, (sa, sb) in enumerate(SHAPES):
        for j, (da, db) in enumerate(DTYPES):
            x, y = kn.tensor(_data(da, sa, i)), kn.tensor(_data(db, sb, j + 10))
            want = general_path(lambda: _outcome(lambda: op(x, y)))
            for _ in range(3):  # the first call plans, the others replay
                _same(_outcome(lambda: op(x, y)), want, name in INEXACT_OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_python_scalar_operands_match_the_general_path(name, general_path):
    op = OPS[name]
    for j, (dtype, _) in enumerate(DTYPES):
        x = kn.tensor(_data(dtype, (3, 4), j))
        for s in SCALARS:
            for call in (lambda: op(x, s), lambda: op(s, x)):
                want = general_path(lambda: _outcome(call))
                for _ in range(3):
                    _same(_outcome(call), want, name in INEXACT_OPS)


@pytest.mark.parametrize("pair", [(np.int32, np.float32), (np.uint8, np.int8), (np.int64, np.int32),
                                  (np.bool_, np.int32), (np.float16, np.float64)],
                         ids=lambda p: "-".join(np.dtype(d).name for d in p))
def test_promotion_matches_torch(pair):
    a, b = _data(pair[0], (3, 4), 1), _data(pair[1], (4,), 2)
    ka, kb = kn.tensor(a), kn.tensor(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    for _ in range(2):
        for kop, top in ((operator.add, torch.add), (operator.mul, torch.mul),
                         (operator.truediv, torch.div), (operator.lt, torch.lt)):
            got, want = kop(ka, kb).numpy(), top(ta, tb).numpy()
            assert got.dtype == want.dtype, (kop, got.dtype, want.dtype)
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3)
        for s in (2, 1.5, True):
            got, want = (ka * s).numpy(), (ta * s).numpy()
            assert got.dtype == want.dtype, (s, got.dtype, want.dtype)


def test_bool_and_integer_policies_hold_on_replay():
    t, f = kn.tensor(np.array([True, False, True])), kn.tensor(np.array([True, True, False]))
    i, j = kn.tensor(np.array([7, -7, 3], np.int32)), kn.tensor(np.array([2, 2, 2], np.int32))
    for _ in range(3):
        np.testing.assert_array_equal((t + f).numpy(), [True, True, True])  # or, as torch
        np.testing.assert_array_equal((t * f).numpy(), [True, False, False])  # and
        quotient = i / j  # true division in float32
        assert quotient.dtype == kn.float32
        np.testing.assert_array_equal(quotient.numpy(), [3.5, -3.5, 1.5])
        np.testing.assert_array_equal((i // j).numpy(), [3, -4, 1])
        np.testing.assert_array_equal((i / 2).numpy(), [3.5, -3.5, 1.5])
        assert (i + 1).dtype == kn.int32 and (i * 1.5).dtype == kn.float32


def test_broadcast_results_are_new_and_counted_once():
    x, v = kn.tensor(np.ones((64, 32), np.float32)), kn.tensor(np.arange(32, dtype=np.float64))
    s = kn.tensor(np.float32(2.0))
    for _ in range(2):  # plan the signatures first
        x + v, x * s
    gc.collect()
    before = kn.memory.memory_allocated("cpu")
    out = [x + v, x * s, s * x, x - 1]
    assert kn.memory.memory_allocated("cpu") - before == 64 * 32 * (8 + 4 + 4 + 4)
    out[1].numpy()[0, 0] = 99.0  # neither an operand nor a shared fill
    np.testing.assert_array_equal(x.numpy(), 1.0)
    np.testing.assert_array_equal((x * s).numpy(), 2.0)
    assert s.numpy() == 2.0
    del out
    gc.collect()
    assert kn.memory.memory_allocated("cpu") == before


def test_the_memory_limit_is_checked_on_replayed_and_trusted_plans():
    x, v = kn.tensor(np.ones((256, 256), np.float32)), kn.tensor(np.ones(256, np.float32))
    for _ in range(3):  # planned, then trusted (numpy's result no longer checked)
        x + x, x * 2.0, x + v, x.tanh()
    set_memory_fraction(1e-9)
    try:
        for case in (lambda: x + x, lambda: x * 2.0, lambda: x + v, lambda: x.tanh(),
                     lambda: kn.tanh(x)):
            for _ in range(2):
                with pytest.raises(KilnError, match="over the limit"):
                    case()
    finally:
        set_memory_fraction(1.0)
    np.testing.assert_array_equal((x + v).numpy(), 2.0)


def test_broadcast_errors_are_raised_on_every_call():
    x = kn.tensor(np.ones((3, 4), np.float32))
    for _ in range(3):
        with pytest.raises(kn.KilnError, match="broadcast"):
            x + kn.ones(3)
        with pytest.raises(kn.KilnError, match="and"):
            x & kn.ones(4)


def test_float_errors_stay_quiet_with_broadcasting():
    x = kn.tensor(np.array([[1e30, -1.0, 0.0]], np.float32))
    big = kn.tensor(np.float32(1e30))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            for _ in range(3):
                out = (x * big).numpy()
                ratio = (x / kn.zeros(3, dtype=kn.float64)).numpy()
    assert np.isinf(out[0, 0]) and ratio.dtype == np.float64 and np.isnan(ratio[0, 2])


def test_grad_through_broadcasting_and_promotion_matches_torch():
    w0, v0 = _data(np.float32, (3, 4), 1), _data(np.float64, (4,), 2)
    w, v = kn.tensor(w0, requires_grad=True), kn.tensor(v0)
    v + w  # plan the plain signature first: a taped operand must not replay it
    ((w * v + 2) ** 2).sum().backward()
    tw = torch.tensor(w0, requires_grad=True)
    ((tw * torch.from_numpy(v0) + 2) ** 2).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-5)


def _forward(w, v):
    return [w + v, w * 2.0, 1.5 - w, (w * v).tanh(), kn.relu(w), w @ w.T, w.sum(-1),
            w + w, kn.exp(w), w > v]


def test_no_grad_and_frozen_parameters_take_the_plain_values(general_path):
    from kiln import nn

    w0, v0 = _data(np.float32, (4, 4), 3), _data(np.float32, (4,), 4)
    w, v = kn.tensor(w0, requires_grad=True), kn.tensor(v0)
    want = general_path(lambda: [t.numpy().copy() for t in _forward(kn.tensor(w0), v)])
    for _ in range(2):
        with kn.no_grad():  # nothing recorded: the same arrays as plain tensors
            got = _forward(w, v)
        for g, expected in zip(got, want):
            assert not g.requires_grad and g.grad_fn is None
            np.testing.assert_array_equal(g.numpy(), expected)
        frozen = nn.Parameter(kn.tensor(w0), requires_grad=False)
        for g, expected in zip(_forward(frozen, v), want):
            assert type(g) is kn.Tensor and not g.requires_grad
            np.testing.assert_array_equal(g.numpy(), expected)
    taped = _forward(w, v)  # grad mode on again: recorded
    assert taped[0].requires_grad and taped[3].grad_fn is not None
    taped[3].sum().backward()
    t = torch.tensor(w0, requires_grad=True)
    (t * torch.from_numpy(v0)).tanh().sum().backward()
    # 1 - tanh^2 cancels where tanh rounds near 1: an absolute tolerance there
    np.testing.assert_allclose(w.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)
