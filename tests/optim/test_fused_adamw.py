"""A compiled AdamW step updates every parameter in ONE launch (batch_updates: the
multi-tensor kernel), and matches torch.optim.AdamW over several steps with weight
decay and parameter groups."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn, optim
from kiln.passes.batch_updates import batch_updates
from kiln.ir.parser import parse_graph

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")

SHAPES = [(33, 17), (17,), (17, 5), (5,), (3, 4, 5), ()]
STEPS = 4


def _param_batches(compiled) -> list:
    """The batch tag of the kernel producing each output of the compiled program."""
    graph = compiled.compiled_graphs()[0].optimized
    producer = {id(r): n for n in graph.body.nodes for r in n.results}
    return [producer[id(v)].attrs.get("batch") if id(v) in producer else None
            for v in graph.body.results]


def test_functional_step_is_one_launch_and_matches_torch():
    rng = np.random.default_rng(0)
    p0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(STEPS)]
    opt = optim.AdamW(lr=0.05, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.2)
    update = kn.compile(opt.update)
    params = [kn.tensor(p) for p in p0]
    state = opt.init(params)
    for g in grads:
        params, state = update([kn.tensor(x) for x in g], state, params)
    assert update.stats()["compiles"] == 1
    tags = _param_batches(update)
    # the new value of every parameter: one batch, one launch (a 0-d parameter's update
    # shares the kernel that computes the step's scalars, the bias corrections)
    tensors = [t for t, s in zip(tags, SHAPES) if s]
    assert tensors[0] is not None and len(set(tensors)) == 1
    kernels = update.compiled_graphs()[0].program.kernels
    assert sum(1 for k in kernels.values() if type(k).__name__ == "BatchKernel") >= 1

    ts = [torch.tensor(p, requires_grad=True) for p in p0]
    topt = torch.optim.AdamW(ts, lr=0.05, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.2)
    for g in grads:
        for t, x in zip(ts, g):
            t.grad = torch.tensor(x)
        topt.step()
    for got, want in zip(params, ts):
        np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=3e-6, atol=3e-6)


def test_torch_style_groups_compiled_training_step_matches_torch():
    """loss.backward(); opt.step() with two parameter groups (decay / no decay, their own
    lr) inside kn.compile, step for step against torch."""
    rng = np.random.default_rng(1)
    w1, w2 = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    xs = [rng.standard_normal((10, 6)).astype(np.float32) for _ in range(STEPS)]

    kp = [nn.Parameter(kn.tensor(a)) for a in (w1, w2, b1)]
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in (w1, w2, b1)]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0,
                                                          "lr": 0.03}]

    kopt = optim.AdamW(groups(kp), lr=0.01, betas=(0.9, 0.98))
    topt = torch.optim.AdamW(groups(tp), lr=0.01, betas=(0.9, 0.98))

    @kn.compile
    def kstep(x):
        loss = ((kn.tanh(x @ kp[0] + kp[2]) @ kp[1]) ** 2).mean()
        loss.backward()
        kopt.step()
        kopt.zero_grad(set_to_none=True)
        return loss

    for x in xs:
        kloss = kstep(kn.tensor(x))
        tloss = ((torch.tanh(torch.tensor(x) @ tp[0] + tp[2]) @ tp[1]) ** 2).mean()
        tloss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        np.testing.assert_allclose(kloss.numpy(), tloss.detach().numpy(), rtol=2e-5, atol=2e-6)
    for k, t in zip(kp, tp):
        np.testing.assert_allclose(k.numpy(), t.detach().numpy(), rtol=2e-5, atol=2e-6)


def test_pass_batches_sinks_sharing_a_computed_scalar():
    g = parse_graph("""
graph @g(%a: f32[4], %b: f32[3, 2], %c: f32[5], %t: f32[]) -> (f32[4], f32[3, 2], f32[4], f32[5])
  %0 = fused(%t) {kind="loop"} : f32[]
    region(%1: f32[]):
      %2 = exp(%1) : f32[]
      yield %2
    end
  %3 = fused(%a, %0) {kind="loop"} : f32[4]
    region(%4: f32[4], %5: f32[]):
      %6 = broadcast_in_dim(%5) {broadcast_dimensions=(), shape=(4,)} : f32[4]
      %7 = mul(%4, %6) : f32[4]
      yield %7
    end
  %8 = fused(%b, %0) {kind="loop"} : f32[3, 2]
    region(%9: f32[3, 2], %10: f32[]):
      %11 = broadcast_in_dim(%10) {broadcast_dimensions=(), shape=(3, 2)} : f32[3, 2]
      %12 = sub(%9, %11) : f32[3, 2]
      yield %12
    end
  %13 = fused(%3) {kind="loop"} : f32[4]
    region(%14: f32[4]):
      %15 = abs(%14) : f32[4]
      yield %15
    end
  %16 = fused(%c) {kind="loop"} : f32[5]
    region(%17: f32[5]):
      %18 = neg(%17) : f32[5]
      yield %18
    end
  return %3, %8, %13, %16
""")
    out = batch_updates(g)
    tags = {str(n.results[0].type): n.attrs.get("batch") for n in out.body.nodes}
    # %3 feeds %13 (not a sink); %8 and %13 do not share the scalar; %16 reads none:
    # nothing qualifies
    assert set(tags.values()) == {None}
    g2 = parse_graph(str(g).replace("%13 = fused(%3)", "%13 = fused(%a)"))
    out = batch_updates(g2)
    nodes = out.body.nodes
    # now %3 and %8 are sinks reading the computed scalar %0: one batch, listed last
    assert [n.attrs.get("batch") for n in nodes[-2:]] == [0, 0]
    assert [str(n.results[0].type) for n in nodes[-2:]] == ["f32[4]", "f32[3, 2]"]
    assert all(n.attrs.get("batch") is None for n in nodes[:-2])
    assert "batch=" not in str(g2)  # the input graph is left alone


def test_eager_torch_style_step_is_one_compiled_program_and_matches_torch():
    """opt.step() outside kn.compile: every parameter of every group updated by one
    compiled program (built once, the lr an input), step for step against torch."""
    rng = np.random.default_rng(4)
    shapes = [(7, 5), (5,), (5, 3), (3,)]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(STEPS)]
    kp = [nn.Parameter(kn.tensor(a)) for a in p0]
    tp = [torch.nn.Parameter(torch.tensor(a)) for a in p0]

    def groups(ps):
        return [{"params": ps[::2], "weight_decay": 0.2}, {"params": ps[1::2], "weight_decay": 0.0,
                                                           "lr": 0.05}]

    kopt = optim.AdamW(groups(kp), lr=0.01, betas=(0.8, 0.99), amsgrad=True)
    topt = torch.optim.AdamW(groups(tp), lr=0.01, betas=(0.8, 0.99), amsgrad=True)
    for step, g in enumerate(grads):
        if step == 2:  # a new learning rate is an input, not a recompile
            kopt.param_groups[0]["lr"] = topt.param_groups[0]["lr"] = 0.003
        for k, t, x in zip(kp, tp, g):
            k.grad, t.grad = kn.tensor(x), torch.tensor(x)
        kopt.step()
        topt.step()
    for k, t in zip(kp, tp):
        np.testing.assert_allclose(k.numpy(), t.detach().numpy(), rtol=2e-6, atol=2e-6)
    (program,) = kopt._groups._fused.values()
    assert program.stats()["compiles"] == 1
    assert int(kopt.state[kp[0]]["step"].item()) == STEPS
