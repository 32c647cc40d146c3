"""torch.optim's stateful interface and schedulers against torch, step for step."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn, optim

torch = pytest.importorskip("torch")
W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
X = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)


def _run(name, kwargs, steps=4):
    tw, tb = torch.nn.Parameter(torch.tensor(W)), torch.nn.Parameter(torch.zeros(3))
    kw, kb = nn.Parameter(kn.tensor(W)), nn.Parameter(kn.zeros(3))
    topt = getattr(torch.optim, name)([{"params": [tw]}, {"params": [tb], "weight_decay": 0.0,
                                                          "lr": 0.02}], **kwargs)
    kopt = getattr(optim, name)([{"params": [kw]}, {"params": [kb], "weight_decay": 0.0,
                                                    "lr": 0.02}], **kwargs)
    for _ in range(steps):
        ((torch.tensor(X) @ tw + tb).tanh() ** 2).mean().backward()
        topt.step()
        topt.zero_grad()
        ((kn.tensor(X) @ kw + kb).tanh() ** 2).mean().backward()
        kopt.step()
        kopt.zero_grad()
    return (tw, tb, topt), (kw, kb, kopt)


@pytest.mark.parametrize("name,kwargs", [
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05)), ("Adam", dict(lr=0.01, weight_decay=0.01)),
    ("AdamW", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, amsgrad=True))])
def test_groups_match_torch_step_for_step(name, kwargs):
    (tw, tb, topt), (kw, kb, kopt) = _run(name, kwargs)
    np.testing.assert_allclose(kw.numpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kb.numpy(), tb.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert kw.grad is None and kopt.param_groups[1]["weight_decay"] == 0.0


def test_state_dict_round_trip_continues_identically():
    _, (kw, kb, kopt) = _run("AdamW", dict(lr=0.01), steps=2)
    sd = kopt.state_dict()
    assert sd["param_groups"][1]["params"] == [1] and int(sd["state"][0]["step"].item()) == 2
    kw2, kb2 = nn.Parameter(kn.tensor(kw.numpy())), nn.Parameter(kn.tensor(kb.numpy()))
    other = optim.AdamW([{"params": [kw2]}, {"params": [kb2], "weight_decay": 0.0, "lr": 0.02}])
    other.load_state_dict(sd)
    for opt, (w, b) in ((kopt, (kw, kb)), (other, (kw2, kb2))):
        ((kn.tensor(X) @ w + b) ** 2).mean().backward()
        opt.step()
    np.testing.assert_array_equal(kw.numpy(), kw2.numpy())


def test_functional_form_still_works_and_errors_name_the_fix():
    opt = optim.SGD(lr=0.1)
    params = {"w": kn.ones(2)}
    new, _ = opt.update({"w": kn.ones(2)}, opt.init(params), params)
    np.testing.assert_allclose(new["w"].numpy(), [0.9, 0.9])
    with pytest.raises(kn.KilnArgumentError, match="model.parameters"):
        opt.zero_grad()
    with pytest.raises(kn.KilnArgumentError, match="unknown group option"):
        optim.AdamW([{"params": [nn.Parameter(kn.ones(2))], "momentum": 0.9}])


@pytest.mark.parametrize("make", [
    lambda o, m: m.StepLR(o, step_size=3, gamma=0.5),
    lambda o, m: m.LambdaLR(o, lambda e: 0.9 ** e),
    lambda o, m: m.LinearLR(o, start_factor=0.2, total_iters=4),
    lambda o, m: m.CosineAnnealingLR(o, T_max=5, eta_min=0.001),
    lambda o, m: m.OneCycleLR(o, max_lr=0.5, total_steps=12),
    lambda o, m: m.SequentialLR(o, [m.LinearLR(o, start_factor=0.1, total_iters=3),
                                    m.CosineAnnealingLR(o, T_max=6)], milestones=[3]),
])
def test_schedulers_match_torch(make):
    tp = torch.nn.Parameter(torch.zeros(2))
    kp = nn.Parameter(kn.zeros(2))
    topt, kopt = torch.optim.SGD([tp], lr=0.1), optim.SGD([kp], lr=0.1)
    ts, ks = make(topt, torch.optim.lr_scheduler), make(kopt, optim.lr_scheduler)
    for _ in range(11):
        np.testing.assert_allclose(ks.get_last_lr(), ts.get_last_lr(), rtol=1e-12)
        topt.step()
        kopt.step()
        ts.step()
        ks.step()
