"""kiln.optim against torch.optim over several steps with the same gradients, eager and
compiled; the stateful `step(module, grads)` path; clipping; errors."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn, optim

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")

SHAPES = {"w": (5, 3), "b": (3,), "s": ()}
STEPS = 5


def problem(seed=0):
    rng = np.random.default_rng(seed)
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
             for _ in range(STEPS)]
    return p0, grads


def torch_run(make, p0, grads, schedule=None):
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
    opt = make(list(ts.values()))
    sched = schedule(opt) if schedule else None
    for g in grads:
        for k, t in ts.items():
            t.grad = torch.tensor(g[k])
        opt.step()
        if sched is not None:
            sched.step()
    return {k: t.detach().numpy() for k, t in ts.items()}


def kiln_run(opt, p0, grads, compiled):
    params = {k: kn.tensor(v) for k, v in p0.items()}
    state = opt.init(params)
    update = kn.compile(opt.update) if compiled else opt.update
    for g in grads:
        params, state = update({k: kn.tensor(v) for k, v in g.items()}, state, params)
    assert int(state["step"].item()) == STEPS
    if compiled:
        assert update.stats()["compiles"] == 1  # the step count is an input, never baked in
    return {k: v.numpy() for k, v in params.items()}


CASES = [
    ("sgd", lambda: optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd-momentum", lambda: optim.SGD(lr=0.1, momentum=0.9),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("sgd-nesterov-wd", lambda: optim.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
    ("sgd-dampening", lambda: optim.SGD(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01)),
    ("sgd-maximize", lambda: optim.SGD(lr=0.1, momentum=0.5, maximize=True),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, maximize=True)),
    ("adamw", lambda: optim.AdamW(lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
    ("adamw-custom", lambda: optim.AdamW(lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3),
     lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)),
    ("adamw-amsgrad", lambda: optim.AdamW(lr=0.05, amsgrad=True),
     lambda p: torch.optim.AdamW(p, lr=0.05, amsgrad=True)),
    ("adam-l2", lambda: optim.Adam(lr=0.05, weight_decay=0.1),
     lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1)),
]


@pytest.mark.parametrize("name,make,make_torch", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_updates_match_torch(name, make, make_torch, compiled):
    p0, grads = problem()
    got = kiln_run(make(), p0, grads, compiled)
    want = torch_run(make_torch, p0, grads)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6, err_msg=f"{name} {k}")


def test_step_updates_a_module_in_place_like_torch():
    model = nn.Sequential(nn.Linear(4, 3, seed=0), nn.Tanh(), nn.Linear(3, 2, seed=1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    ref.load_state_dict({k: torch.tensor(np.array(v.numpy())) for k, v in model.state_dict().items()})
    opt, topt = optim.AdamW(lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    names = [n for n, _ in model.named_parameters()]
    rng = np.random.default_rng(1)
    for _ in range(3):
        grads = {n: rng.standard_normal(p.shape).astype(np.float32)
                 for n, p in model.named_parameters()}
        opt.step(model, {n: kn.tensor(g) for n, g in grads.items()})
        for n, p in ref.named_parameters():
            p.grad = torch.tensor(grads[n])
        topt.step()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(model.state_dict()[n].numpy(), p.detach().numpy(), rtol=2e-6,
                                   atol=2e-6)
    state = opt.state_of(model)
    assert int(state["step"].item()) == 3 and names == list(state["exp_avg"])
    with pytest.raises(kn.KilnArgumentError, match="state was made for"):
        opt.step(model, {"0.weight": kn.zeros(3, 4)})
    with pytest.raises(kn.KilnArgumentError, match=r"no parameter\(s\) \['nope'\]"):
        opt.step(model, {"nope": kn.zeros(1)})


def test_a_schedule_is_a_function_of_the_step_tensor_and_compiles_once():
    # linear warmup over 4 steps, then constant: torch's LambdaLR with the same factor
    opt = optim.SGD(lr=lambda step: 0.1 * kn.minimum((step + 1).to(kn.float32) / 4.0, 1.0))
    p0, grads = problem(2)
    got = kiln_run(opt, p0, grads, compiled=True)

    want = torch_run(lambda p: torch.optim.SGD(p, lr=0.1), p0, grads, schedule=lambda o: (
        torch.optim.lr_scheduler.LambdaLR(o, lambda e: min((e + 1) / 4.0, 1.0))))
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6)


def test_clip_grad_norm_matches_torch():
    rng = np.random.default_rng(3)
    grads = {k: rng.standard_normal(s).astype(np.float32) * 3 for k, s in SHAPES.items()}
    ts = [torch.zeros(s, requires_grad=True) for s in SHAPES.values()]
    for t, g in zip(ts, grads.values()):
        t.grad = torch.tensor(g)
    norm = torch.nn.utils.clip_grad_norm_(ts, 1.5)
    clipped, knorm = optim.clip_grad_norm({k: kn.tensor(v) for k, v in grads.items()}, 1.5)
    np.testing.assert_allclose(knorm.item(), norm.item(), rtol=1e-6)
    for t, k in zip(ts, SHAPES):
        np.testing.assert_allclose(clipped[k].numpy(), t.grad.numpy(), rtol=1e-6, atol=1e-7)
    small, _ = optim.clip_grad_norm({"a": kn.full((2,), 0.1)}, 1.0)
    np.testing.assert_allclose(small["a"].numpy(), 0.1, rtol=1e-6)  # below the limit: unchanged


def test_nested_pytrees_and_reordered_grads():
    params = {"enc": [kn.ones(2), kn.ones(3)], "head": {"w": kn.ones(2, 2)}}
    opt = optim.SGD(lr=0.5, momentum=0.9)
    state = opt.init(params)
    grads = {"head": {"w": kn.ones(2, 2)}, "enc": [kn.ones(2), kn.ones(3)]}  # other key order
    new, state = opt.update(grads, state, params)
    assert list(new) == ["enc", "head"]
    np.testing.assert_allclose(new["enc"][1].numpy(), 0.5)
    with pytest.raises(kn.KilnArgumentError, match=r"lacks \['head'\]"):
        opt.update({"enc": grads["enc"]}, state, params)
    with pytest.raises(kn.KilnShapeError, match=r"gradient leaf 0 is f32\[3\]"):
        opt.update({"enc": [kn.ones(3), kn.ones(3)], "head": grads["head"]}, state, params)


def test_hyperparameter_errors():
    with pytest.raises(kn.KilnArgumentError, match="nesterov"):
        optim.SGD(lr=0.1, nesterov=True)
    with pytest.raises(kn.KilnArgumentError, match="betas"):
        optim.AdamW(betas=(0.9, 1.0))
    with pytest.raises(kn.KilnArgumentError, match="lr must be"):
        optim.AdamW(lr=-1.0)
    assert "AdamW(lr=0.001" in repr(optim.AdamW())
