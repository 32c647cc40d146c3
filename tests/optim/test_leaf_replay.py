"""kiln.optim.leaf_replay: an optimizer's per-parameter body traced once per (dtype, shape)
and replayed for the other parameters of that signature. Oracles: the graph the plain
per-parameter loop traces (text equal, node for node) and torch.optim's numbers."""

import numpy as np
import pytest

import kiln as kn
from kiln import optim
from kiln.optim import adam as adam_module
from kiln.optim import sgd as sgd_module
from kiln.optim import leaf_replay

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")

# repeated signatures (what the replay serves), one float64 leaf beside a float32 one of
# the same shape (a different signature), a 0-d leaf
SHAPES = {"w1": ((5, 3), np.float32), "w2": ((5, 3), np.float32), "b1": ((3,), np.float32),
          "b2": ((3,), np.float32), "d": ((3,), np.float64), "s1": ((), np.float32),
          "s2": ((), np.float32)}
STEPS = 3


def plain_map(body, columns):
    return [tuple(body(*column)) for column in columns]


def problem(seed=0):
    rng = np.random.default_rng(seed)
    p0 = {k: rng.standard_normal(s).astype(d) for k, (s, d) in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(d) for k, (s, d) in SHAPES.items()}
             for _ in range(STEPS)]
    return p0, grads


CASES = [
    ("adamw", adam_module, lambda: optim.AdamW(lr=0.01, weight_decay=0.1),
     lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    ("adam-l2-amsgrad-maximize", adam_module,
     lambda: optim.Adam(lr=0.05, weight_decay=0.1, amsgrad=True, maximize=True),
     lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1, amsgrad=True, maximize=True)),
    ("sgd", sgd_module, lambda: optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd-nesterov-l2", sgd_module, lambda: optim.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
    ("sgd-dampening-maximize", sgd_module,
     lambda: optim.SGD(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01, maximize=True),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01, maximize=True)),
]


@pytest.mark.parametrize("name,module,make,make_torch", CASES, ids=[c[0] for c in CASES])
def test_traced_update_is_the_plain_loops_graph_and_matches_torch(name, module, make, make_torch,
                                                                  monkeypatch):
    p0, grads = problem()
    opt = make()
    params = {k: kn.tensor(v) for k, v in p0.items()}
    state = opt.init(params)
    replays = []
    real_replay = leaf_replay._Recording.replay
    monkeypatch.setattr(leaf_replay._Recording, "replay",
                        lambda self, *a: replays.append(1) or real_replay(self, *a))
    replayed = kn.trace(opt.update, grads[0], state, params)
    assert len(replays) == 3  # w2, b2 and s2 replay w1, b1 and s1
    with monkeypatch.context() as m:
        m.setattr(module, "map_leaves", plain_map)
        plain = kn.trace(opt.update, grads[0], state, params)
    assert str(replayed) == str(plain)

    update = kn.compile(opt.update)
    for g in grads:
        params, state = update({k: kn.tensor(v) for k, v in g.items()}, state, params)
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
    topt = make_torch(list(ts.values()))
    for g in grads:
        for k, t in ts.items():
            t.grad = torch.tensor(g[k])
        topt.step()
    for k, t in ts.items():
        np.testing.assert_allclose(params[k].numpy(), t.detach().numpy(), rtol=2e-6, atol=2e-6,
                                   err_msg=f"{name} {k}")


def test_aliased_entries_are_part_of_the_signature():
    """(a, a) and then (b, c) of the same shapes: the second column is traced itself."""
    def body(x, y):
        return (x * 2.0 + y,)

    def fn(a, b, c):
        return [r for (r,) in leaf_replay.map_leaves(body, [(a, a), (b, c), (c, b)])]

    def plain(a, b, c):
        return [r for (r,) in plain_map(body, [(a, a), (b, c), (c, b)])]

    args = [kn.tensor(np.full(4, v, np.float32)) for v in (1.0, 2.0, 3.0)]
    assert str(kn.trace(fn, *args, name="g")) == str(kn.trace(plain, *args, name="g"))
    got = [r.numpy() for r in kn.compile(fn)(*args)]
    for r, want in zip(got, (3.0, 7.0, 8.0)):
        np.testing.assert_array_equal(r, np.full(4, want, np.float32))


def test_a_body_that_makes_a_constant_or_returns_an_outside_tensor_is_not_replayed():
    table = np.arange(4, dtype=np.float32)

    def with_constant(x):
        return (x + kn.tensor(table),)

    def fn(a, b, outside):
        made = leaf_replay.map_leaves(with_constant, [(a,), (b,)])
        handed = leaf_replay.map_leaves(lambda x: (x * 2.0, outside), [(a,), (b,)])
        return [made[0][0], made[1][0], handed[0][0], handed[1][0], handed[1][1]]

    def plain(a, b, outside):
        made = plain_map(with_constant, [(a,), (b,)])
        handed = plain_map(lambda x: (x * 2.0, outside), [(a,), (b,)])
        return [made[0][0], made[1][0], handed[0][0], handed[1][0], handed[1][1]]

    args = [kn.tensor(np.full(4, v, np.float32)) for v in (1.0, 5.0, 7.0)]
    assert str(kn.trace(fn, *args, name="g")) == str(kn.trace(plain, *args, name="g"))
    got = kn.compile(fn)(*args)
    wants = [table + 1, table + 5, np.full(4, 2.0), np.full(4, 10.0), np.full(4, 7.0)]
    for r, want in zip(got, wants):
        np.testing.assert_array_equal(r.numpy(), want.astype(np.float32))


def test_eager_and_taped_tensors_run_the_body_every_time():
    calls = []

    def body(x):
        calls.append(1)
        return (x * 3.0,)

    a, b = kn.tensor(np.ones(3, np.float32)), kn.tensor(np.full(3, 2.0, np.float32))
    out = leaf_replay.map_leaves(body, [(a,), (b,)])
    assert len(calls) == 2
    np.testing.assert_array_equal(out[1][0].numpy(), np.full(3, 6.0, np.float32))
    w = kn.tensor(np.ones(3, np.float32), requires_grad=True)
    v = kn.tensor(np.ones(3, np.float32), requires_grad=True)
    (y1,), (y2,) = leaf_replay.map_leaves(body, [(w,), (v,)])
    (y1 + y2).sum().backward()
    np.testing.assert_array_equal(v.grad.numpy(), np.full(3, 3.0, np.float32))
