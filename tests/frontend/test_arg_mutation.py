"""A compiled function that changes its own arguments in place leaves in the caller's
tensors what torch leaves there (kiln/frontend/arg_mutation.py), on the first call and
on a cached one; kn.export refuses such a function (K450)."""

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.arg_mutation import KilnExportMutationError, KilnWriteBackError
from kiln.frontend.region_mutation import KilnBranchWriteError

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(7)


def _data(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _check(fn, torch_fn, *arrays, calls=2):
    """fn compiled and torch_fn eager on copies of `arrays`, `calls` times with new data:
    the results and every argument afterwards agree; one compile serves every call."""
    f = kn.compile(fn)
    for call in range(calls):
        data = [a if call == 0 else _data(*a.shape) for a in arrays]
        ks, ts = [kn.tensor(a) for a in data], [torch.tensor(a) for a in data]
        got, want = f(*ks), torch_fn(*ts)
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,)):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)
        for k, t in zip(ks, ts):
            np.testing.assert_allclose(k.numpy(), t.numpy(), rtol=1e-6, atol=1e-6)
    assert f.stats()["compiles"] == 1
    return f


def test_add_in_place_on_an_argument():
    _check(lambda x: x.add_(1), lambda x: x.add_(1), _data(3, 4))
    _check(lambda x, y: (x.mul_(y), y + 1), lambda x, y: (x.mul_(y), y + 1), _data(5), _data(5))


def test_in_place_on_a_view_of_an_argument():
    def fn(x):
        x[1:].mul_(2)
        x.transpose(0, 1)[0].add_(10)
        x.view(-1)[:2].zero_()
        return x.sum()

    _check(fn, fn, _data(3, 4))


def test_mask_assignment_on_an_argument():
    def fn(x, m):
        x[x > 0.5] = -1.0
        x[m > 0] = 0.25
        return x * 2

    _check(fn, fn, _data(4, 6), _data(4, 6))


def test_argument_written_inside_cond_branches():
    def fn(x):
        def grow():
            x.add_(1)

        def scale_first_row():
            x[0].mul_(3)

        kn.cond(x.sum() > 0, grow, scale_first_row)
        return x * 2

    def ref(x):
        x.add_(1) if x.sum() > 0 else x[0].mul_(3)
        return x * 2

    f = kn.compile(fn)
    for data in (np.abs(_data(3, 2)), -np.abs(_data(3, 2))):  # both branches, one program
        k, t = kn.tensor(data), torch.tensor(data)
        np.testing.assert_allclose(f(k).numpy(), ref(t).numpy(), rtol=1e-6)
        np.testing.assert_allclose(k.numpy(), t.numpy(), rtol=1e-6)
    assert f.stats()["compiles"] == 1


def test_operand_written_through_the_branch_parameter():
    def fn(x, p, i):
        def grow(v):
            v.add_(1)

        def scale_first(v):
            v[0].mul_(5)

        kn.cond(p > 0, grow, scale_first, x)
        kn.switch(i, [grow, scale_first, lambda v: None], x[1:])  # an operand that is a view
        return x * 2

    f = kn.compile(fn)
    for p in (1.0, -1.0):
        for i in (0, 1, 2):
            data = _data(4)
            k, e = kn.tensor(data), kn.tensor(data)
            want = fn(e, kn.tensor(p), kn.tensor(i))  # eager: the branch changes x itself
            np.testing.assert_allclose(f(k, kn.tensor(p), kn.tensor(i)).numpy(), want.numpy(),
                                       rtol=1e-6)
            np.testing.assert_allclose(k.numpy(), e.numpy(), rtol=1e-6)
    assert f.stats()["compiles"] == 1


def test_argument_written_inside_switch_and_nested_cond():
    def fn(x, i):
        def outer():
            def seven():
                x.fill_(7.0)

            kn.cond(x[0] > 0, seven, lambda: None)

        def negate():
            x.neg_()

        kn.switch(i, [negate, outer, lambda: None])
        return x + 0

    def ref(x, i):
        i = min(max(int(i), 0), 2)
        if i == 0:
            x.neg_()
        elif i == 1 and x[0] > 0:
            x.fill_(7.0)
        return x + 0

    f = kn.compile(fn)
    for index in (0, 1, 2, 5):
        for sign in (1, -1):
            data = sign * np.abs(_data(4))
            k, t = kn.tensor(data), torch.tensor(data)
            np.testing.assert_allclose(f(k, kn.tensor(index)).numpy(), ref(t, index).numpy())
            np.testing.assert_allclose(k.numpy(), t.numpy())
    assert f.stats()["compiles"] == 1


@pytest.mark.parametrize("bounded", [False, True])
def test_argument_written_inside_while_loop(bounded):
    def fn(x, n):
        def body(i, acc):
            x[0] += 1.0
            x.mul_(0.5)
            return i + 1, acc + x.sum()

        extra = {"max_iterations": 20} if bounded else {}
        return kn.while_loop(lambda i, acc: i < n, body, (kn.tensor(0), kn.tensor(0.0)), **extra)[1]

    def ref(x, n):
        acc = torch.tensor(0.0)
        for _ in range(int(n)):
            x[0] += 1.0
            x.mul_(0.5)
            acc = acc + x.sum()
        return acc

    f = kn.compile(fn)
    for trips in (0, 3, 7):
        data = _data(5)
        k, t = kn.tensor(data), torch.tensor(data)
        np.testing.assert_allclose(f(k, kn.tensor(trips)).numpy(), ref(t, trips).numpy(), rtol=1e-5)
        np.testing.assert_allclose(k.numpy(), t.numpy(), rtol=1e-6)
    assert f.stats()["compiles"] == 1


def test_while_loop_condition_may_not_write():
    def fn(x):
        def cond(i):
            x.add_(1)
            return i < 3
        return kn.while_loop(cond, lambda i: (i + 1,), (kn.tensor(0),))[0]

    with pytest.raises(KilnBranchWriteError, match="cond"):
        kn.compile(fn)(kn.ones(2))


def test_same_tensor_passed_twice():
    def fn(a, b):
        a.add_(1)
        b.mul_(2)
        return a + b

    f = kn.compile(fn)
    for same in (True, False, True):
        data = _data(3)
        k1, t1 = kn.tensor(data), torch.tensor(data)
        k2, t2 = (k1, t1) if same else (kn.tensor(data), torch.tensor(data))
        np.testing.assert_allclose(f(k1, k2).numpy(), fn(t1, t2).numpy(), rtol=1e-6)
        np.testing.assert_allclose(k1.numpy(), t1.numpy(), rtol=1e-6)
        np.testing.assert_allclose(k2.numpy(), t2.numpy(), rtol=1e-6)
    stats = f.stats()
    assert stats["compiles"] == 2 and stats["hits"] == 1  # aliasing is part of the key


def test_mutated_and_returned_argument_is_the_callers_tensor():
    f = kn.compile(lambda x: x.add_(1))
    g = kn.compile(lambda x: (x.mul_(2), x * 3, x))
    x = kn.tensor(_data(4))
    for _ in range(2):
        before = x.numpy().copy()
        assert f(x) is x
        np.testing.assert_allclose(x.numpy(), before + 1, rtol=1e-6)
        a, b, c = g(x)
        assert a is x and c is x and b is not x
        np.testing.assert_allclose(b.numpy(), x.numpy() * 3, rtol=1e-6)


def test_caller_views_and_numpy_arguments_take_the_write():
    f = kn.compile(lambda v: v.fill_(4.0))
    base, tbase = kn.tensor(_data(3, 2)), None
    tbase = torch.tensor(base.numpy())
    f(base[1])
    tbase[1].fill_(4.0)
    np.testing.assert_array_equal(base.numpy(), tbase.numpy())
    a = _data(6)
    want = a * 3
    out = kn.compile(lambda a: a.mul_(3))(a)
    np.testing.assert_allclose(a, want, rtol=1e-6)  # the numpy array itself
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
    frozen = _data(6)
    frozen.flags.writeable = False
    with pytest.raises(KilnWriteBackError, match="read-only"):
        kn.compile(lambda a: a.mul_(3))(frozen)


def test_dynamic_sizes_and_closed_over_state_together():
    state = kn.zeros(1)

    def step(x):
        state.add_(x.sum())
        x.sub_(x.mean())
        return x.max()

    f = kn.compile(step, dynamic=True)
    total = 0.0
    for n in (4, 9, 5):
        data = _data(n)
        x = kn.tensor(data)
        got = f(x).numpy()
        total += data.sum()
        np.testing.assert_allclose(x.numpy(), data - data.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, (data - data.mean()).max(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.numpy(), [total], rtol=1e-5)
    assert f.stats()["compiles"] == 1


def test_export_refuses_argument_mutation_naming_it():
    def fn(x, y):
        y[0] = 1.0
        return x + 1

    with pytest.raises(KilnExportMutationError, match="`y`"):
        kn.export(fn, (kn.ones(2), kn.ones(2)))
    prog = kn.export(lambda x, y: x + y, (kn.ones(2), kn.ones(2)))  # pure ones still export
    np.testing.assert_array_equal(prog(kn.ones(2), kn.ones(2)).numpy(), [2, 2])


def _view_writes(x):
    x[1:].mul_(2)
    x.transpose(0, 1)[0].add_(10)
    return x.sum()


def _mask_write(x, m):
    x[x > 0.5] = -1.0
    x[m > 0] = 0.25
    return x * 2


def _two_names(a, b):
    a.add_(1)
    b.mul_(2)
    return a + b


@pytest.mark.parametrize("fn,arity,same", [(lambda x: x.add_(1), 1, False), (_view_writes, 1, False),
                                           (_mask_write, 2, False), (_two_names, 2, True),
                                           (_two_names, 2, False)])
def test_matches_torch_compile(fn, arity, same, tmp_path, monkeypatch):
    """torch.compile (AOTAutograd's functionalization: backend aot_eager) as the oracle."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing outside tmp
    tc = torch.compile(fn, backend="aot_eager", fullgraph=True)
    kc = kn.compile(fn)
    for _ in range(2):
        data = [_data(4, 3) for _ in range(arity)]
        if same:
            data[1] = data[0]
        ts = [torch.tensor(a) for a in data]
        ks = [kn.tensor(a) for a in data]
        if same:
            ts[1], ks[1] = ts[0], ks[0]
        want, got = tc(*ts), kc(*ks)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
        for k, t in zip(ks, ts):
            np.testing.assert_allclose(k.numpy(), t.numpy(), rtol=1e-6)


def test_strided_numpy_arguments_are_read_and_written_back_like_contiguous_ones():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = base.T  # not C-contiguous
    np.testing.assert_array_equal(kn.compile(lambda x: x * 2)(a).numpy(), base.T * 2)
    out = np.zeros((4, 3), np.float32).T  # strided destination of a write-back
    kn.compile(lambda x: x.add_(1))(out)
    np.testing.assert_array_equal(out, np.ones((3, 4), np.float32))


def test_zero_d_numpy_arguments_stay_zero_d():
    pick = kn.compile(lambda k, x: kn.switch(k, [lambda v: v + 1, lambda v: v * 3], x))
    x = kn.tensor(np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(pick(np.array(1), x).numpy(), np.full(4, 6.0, np.float32))
    np.testing.assert_array_equal(kn.compile(lambda s, x: x * s)(np.float32(3.0), x).numpy(), np.full(4, 6.0))
