"""The lean eager path (kiln/frontend/eager_path.py) and the eager plan cache
(kiln/ir/emitter.py): the same values and the same numbered errors as the general path,
on every call of a signature, not only the first (issue 22 item 5)."""

from __future__ import annotations

import gc
import operator
import warnings

import ml_dtypes
import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnArgumentError, KilnDTypeError, KilnError, KilnShapeError
from kiln.ir.emitter import EAGER
from kiln.runtime import set_memory_fraction

torch = pytest.importorskip("torch")

OPS = [operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
       kn.maximum, kn.minimum, operator.eq, operator.lt, operator.ge]
TORCH = {kn.maximum: lambda x, y: torch.clamp(x, min=y) if not isinstance(y, torch.Tensor)
         else torch.maximum(x, y),
         kn.minimum: lambda x, y: torch.clamp(x, max=y) if not isinstance(y, torch.Tensor)
         else torch.minimum(x, y)}
DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def _data(dtype, shape=(5, 7), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.5, 2.0, shape)).astype(dtype)


def _torch(a):
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _numpy(t):
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda f: getattr(f, "__name__", str(f)))
def test_tensor_tensor_and_scalar_operands_match_torch(op, dtype):
    a, b = _data(dtype, seed=1), _data(dtype, seed=2)
    ka, kb = kn.tensor(a), kn.tensor(b)
    ta, tb = _torch(a), _torch(b)
    top = TORCH.get(op, op)
    for _ in range(3):  # the first call plans, the next ones replay the plan
        cases = [(op(ka, kb), top(ta, tb)), (op(ka, 1.5), top(ta, 1.5)), (op(ka, 2), top(ta, 2))]
        if op not in (kn.maximum, kn.minimum):
            cases.append((op(0.75, ka), top(0.75, ta)))
        for got, want in cases:
            want = _numpy(want)
            assert got.numpy().dtype == (np.bool_ if want.dtype == np.bool_ else np.dtype(dtype))
            np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64),
                                       rtol=1e-2 if np.dtype(dtype).itemsize == 2 else 1e-6)


@pytest.mark.parametrize("name", ["exp", "tanh", "sqrt", "log", "sin", "sigmoid", "erf"])
def test_unary_float_ops_match_torch(name):
    a = _data(np.float32, seed=3)
    for _ in range(3):
        got = getattr(kn, name)(kn.tensor(a)).numpy()
        want = getattr(torch, name)(torch.from_numpy(a)).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_the_result_is_a_new_array_and_inputs_are_unchanged():
    a = _data(np.float32)
    ka = kn.tensor(a)
    before = ka.numpy().copy()
    out = ka * 1.0
    assert out.numpy() is not ka.numpy()
    out.numpy()[0, 0] = 99.0  # the 0-d fill of 1.0 is shared between calls: read only
    again = ka * 1.0
    np.testing.assert_array_equal(ka.numpy(), before)
    np.testing.assert_array_equal(again.numpy(), before)


@pytest.mark.parametrize("case, error, words", [
    (lambda x, y: x & y, KilnDTypeError, ["and", "f32"]),  # float operands: the type rule
    (lambda x, y: x + kn.ones(4), KilnShapeError, ["add", "broadcast"]),
    (lambda x, y: x + 2**70, KilnArgumentError, ["full", "64 bits"]),
    (lambda x, y: kn.tensor([True, False]) + 2**70, KilnArgumentError, ["full"]),
])
def test_bad_input_raises_its_error_on_every_call(case, error, words):
    x, y = kn.tensor(_data(np.float32, (3,))), kn.tensor(_data(np.float32, (3,), seed=5))
    for _ in range(3):  # a failed check is never planned, so the replay cannot skip it
        with pytest.raises(error) as info:
            case(x, y)
        for w in words:
            assert w in str(info.value)


def test_the_memory_limit_is_checked_on_a_replayed_plan():
    x = kn.tensor(np.ones((256, 256), np.float32))
    x + x  # planned under the default limit
    set_memory_fraction(1e-9)  # a few dozen bytes
    try:
        for _ in range(2):
            with pytest.raises(KilnError, match="K170|over the limit") as info:
                x + x
            assert getattr(info.value, "code", "K170") == "K170"
    finally:
        set_memory_fraction(1.0)
    np.testing.assert_array_equal((x + x).numpy(), np.full((256, 256), 2, np.float32))


def test_results_are_counted_by_the_cpu_allocator():
    x = kn.tensor(np.ones((128, 128), np.float32))
    x * 2.0
    gc.collect()
    before = kn.memory.memory_allocated("cpu")
    ys = [x * 2.0, kn.tanh(x), x + x]
    assert kn.memory.memory_allocated("cpu") - before == 3 * 128 * 128 * 4
    del ys
    gc.collect()
    assert kn.memory.memory_allocated("cpu") == before


def test_float_errors_are_results_not_warnings_and_numpy_state_is_kept():
    x = kn.tensor(np.array([1e30, -1.0, 0.0], np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):  # the user's own numpy state
            big = (x * x).numpy()
            logs = kn.log(x).numpy()
            quotient = (x / 0.0).numpy()
            with pytest.raises(FloatingPointError):  # still the user's state outside kiln
                np.float32(1e30) * np.float32(1e30)
    assert np.isinf(big[0]) and np.isnan(logs[1]) and np.isinf(logs[2])
    assert np.isinf(quotient[0]) and np.isnan(quotient[2])
    assert np.geterr()["over"] == "warn"


def test_traced_and_taped_operands_take_the_general_path():
    w = kn.tensor(_data(np.float32, (3,)))

    @kn.compile
    def f(x):
        return x * w + 1.0  # w, an eager tensor, becomes a graph constant

    x = _data(np.float32, (3,), seed=7)
    np.testing.assert_allclose(f(x).numpy(), x * w.numpy() + 1.0, rtol=1e-6)
    leaf = kn.tensor(x, requires_grad=True)
    (leaf * w * 2.0).sum().backward()
    np.testing.assert_allclose(leaf.grad.numpy(), 2 * w.numpy(), rtol=1e-6)


def test_a_signature_cache_over_its_limit_starts_over(monkeypatch):
    from kiln.ir import emitter

    monkeypatch.setattr(emitter, "_PLAN_LIMIT", 8)
    EAGER._plans.clear()  # earlier tests filled them past this limit
    EAGER._alike.clear()
    for n in range(1001, 1030):
        x = kn.tensor(np.ones(n, np.float32))
        np.testing.assert_array_equal((x + x).numpy(), np.full(n, 2, np.float32))
        assert len(EAGER._plans) <= 8 and len(EAGER._alike) <= 8


def test_a_replayed_plan_keeps_this_calls_attributes():
    # -0.0 == 0.0 and 1 == 1.0 == True: a plan keyed on == would replay the wrong fill
    assert not np.signbit(kn.full((3,), 0.0).numpy()).any()
    assert np.signbit(kn.full((3,), -0.0).numpy()).all()
    assert kn.full((2,), 1).dtype == kn.int64 and kn.full((2,), True).dtype == kn.bool_
    assert kn.full((2,), 1.0).dtype == kn.float32


def test_signed_zero_scalars_keep_their_sign():
    x = kn.tensor(np.array([1.0, -2.0], np.float32))
    for _ in range(2):
        np.testing.assert_array_equal(np.signbit((x * 0.0).numpy()), [False, True])
        np.testing.assert_array_equal(np.signbit((x * -0.0).numpy()), [True, False])
        np.testing.assert_array_equal(np.signbit((-0.0 + kn.zeros(2)).numpy()), [False, False])
