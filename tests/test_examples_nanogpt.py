"""The acceptance test of the PyTorch port: nanoGPT's model file and a nanoGPT-style
training loop (examples/nanogpt/), ported by changing import lines only, train with the
same losses as the torch original step for step, and generate the same greedy tokens."""

import difflib
import pathlib
import sys
import types

import numpy as np
import pytest

import kiln as kn

torch = pytest.importorskip("torch")
HERE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "nanogpt"
TORCH_IMPORTS = {"import kiln as torch  # was: import torch": "import torch",
                 "import kiln.nn as nn  # was: import torch.nn as nn": "import torch.nn as nn",
                 "from kiln.nn import functional as F  # was: from torch.nn import functional as F":
                     "from torch.nn import functional as F"}


def _torch_source(name: str) -> str:
    text = (HERE / name).read_text()
    for kiln_line, torch_line in TORCH_IMPORTS.items():
        text = text.replace(kiln_line, torch_line)
    return text


def _load(name: str, source: str, model_module=None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(HERE / "x.py")
    saved = sys.modules.get("model")
    if model_module is not None:
        sys.modules["model"] = model_module
    try:
        exec(compile(source, str(HERE / name), "exec"), module.__dict__)
    finally:
        if saved is not None:
            sys.modules["model"] = saved
        elif model_module is not None:
            del sys.modules["model"]
    return module


@pytest.fixture(scope="module")
def worlds():
    kmodel_mod = _load("kiln_model", (HERE / "model.py").read_text())
    tmodel_mod = _load("torch_model", _torch_source("model.py"))
    ktrain = _load("kiln_train", (HERE / "train.py").read_text(), kmodel_mod)
    ttrain = _load("torch_train", _torch_source("train.py"), tmodel_mod)
    return kmodel_mod, tmodel_mod, ktrain, ttrain


def test_the_port_changes_import_lines_only():
    for name in ("model.py", "train.py"):
        kiln_lines = (HERE / name).read_text().splitlines()
        torch_lines = _torch_source(name).splitlines()
        changed = [line for line in difflib.unified_diff(torch_lines, kiln_lines, lineterm="", n=0)
                   if line.startswith("+") and not line.startswith("+++")]
        assert changed and all("# was: " in line and "import" in line for line in changed), changed


def _batches(data, block_size, batch_size, count, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ix = rng.integers(0, len(data) - block_size, batch_size)
        x = np.stack([data[i:i + block_size].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1:i + 1 + block_size].astype(np.int64) for i in ix])
        out.append((x, y))
    return out


def test_training_matches_torch_step_for_step(worlds):
    kmodel_mod, tmodel_mod, ktrain, ttrain = worlds
    for mod in (ktrain, ttrain):
        mod.eval_iters, mod.max_iters, mod.print = 2, 8, lambda *a, **k: None
    kmodel_mod.print = tmodel_mod.print = lambda *a, **k: None
    kn.manual_seed(0)
    kmodel = ktrain.make_model()
    tmodel = ttrain.make_model()
    tmodel.load_state_dict({k: torch.tensor(v.numpy()) for k, v in kmodel.state_dict().items()})
    assert kmodel.transformer.wte.weight is kmodel.lm_head.weight
    kopt = kmodel.configure_optimizers(0.1, 3e-3, (0.9, 0.99), "cpu")
    topt = tmodel.configure_optimizers(0.1, 3e-3, (0.9, 0.99), "cpu")
    batches = _batches(ktrain.train_data, ktrain.block_size, ktrain.batch_size, 20, seed=3)

    def feeder(convert):
        it = iter(batches)
        return lambda split: tuple(convert(a) for a in next(it))

    klosses = ktrain.train(kmodel, kopt, feeder(kn.tensor), max_iters=8, log=lambda s: None)
    tlosses = ttrain.train(tmodel, topt, feeder(torch.tensor), max_iters=8, log=lambda s: None)
    np.testing.assert_allclose(klosses, tlosses, rtol=2e-5)
    assert klosses[-1] < klosses[0]
    for (name, p), (_, tp) in zip(kmodel.named_parameters(), tmodel.named_parameters()):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-4, atol=2e-6,
                                   err_msg=name)
    kev = ktrain.estimate_loss(kmodel, feeder(kn.tensor))
    tev = ttrain.estimate_loss(tmodel, feeder(torch.tensor))
    np.testing.assert_allclose([float(kev["val"])], [float(tev["val"])], rtol=2e-5)
    assert kmodel.training

    start = [[1, 2, 3]]
    kmodel.eval()
    tmodel.eval()
    greedy = kmodel.generate(kn.tensor(start), 6, top_k=1).tolist()
    assert greedy == tmodel.generate(torch.tensor(start), 6, top_k=1).tolist()
    sampled = kmodel.generate(kn.tensor(start), 6, temperature=0.8, top_k=5)
    assert sampled.shape == (1, 9) and sampled.dtype == kn.int64


def test_compiled_model_trains_like_torch(worlds):
    """nanoGPT's `model = torch.compile(model)`: forward compiled, backward through the
    compiled program's pullback, optimizer eager; losses match torch's eager run."""
    kmodel_mod, tmodel_mod, ktrain, ttrain = worlds
    kmodel_mod.print = tmodel_mod.print = lambda *a, **k: None
    kn.manual_seed(1)
    kmodel = ktrain.make_model()
    tmodel = ttrain.make_model()
    tmodel.load_state_dict({k: torch.tensor(v.numpy()) for k, v in kmodel.state_dict().items()})
    kopt = kmodel.configure_optimizers(0.1, 3e-3, (0.9, 0.99), "cpu")
    topt = tmodel.configure_optimizers(0.1, 3e-3, (0.9, 0.99), "cpu")
    compiled = kn.compile(kmodel)
    batches = _batches(ktrain.train_data, ktrain.block_size, ktrain.batch_size, 8, seed=4)

    def feeder(convert):
        it = iter(batches)
        return lambda split: tuple(convert(a) for a in next(it))

    klosses = ktrain.train(compiled, kopt, feeder(kn.tensor), max_iters=5, log=lambda s: None)
    tlosses = ttrain.train(tmodel, topt, feeder(torch.tensor), max_iters=5, log=lambda s: None)
    np.testing.assert_allclose(klosses, tlosses, rtol=5e-5)
    assert compiled.stats()["compiles"] == 1


def test_a_whole_training_step_compiles_into_one_program(worlds):
    """kn.compile of `loss.backward(); clip; opt.step(); opt.zero_grad()`: parameters,
    grads, AdamW state and the scheduler's lr are lifted into inputs and written back;
    the losses match torch eager step for step, with one compile."""
    kmodel_mod, tmodel_mod, ktrain, ttrain = worlds
    kmodel_mod.print = tmodel_mod.print = lambda *a, **k: None
    kn.manual_seed(2)
    kmodel = ktrain.make_model()
    tmodel = ttrain.make_model()
    tmodel.load_state_dict({k: torch.tensor(v.numpy()) for k, v in kmodel.state_dict().items()})
    kopt = kmodel.configure_optimizers(0.1, 3e-3, (0.9, 0.99), "cpu")
    topt = tmodel.configure_optimizers(0.1, 3e-3, (0.9, 0.99), "cpu")
    ksched = kn.optim.lr_scheduler.CosineAnnealingLR(kopt, T_max=6)
    tsched = torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=6)

    def make_step(model, opt, lib):
        def step(X, Y):
            _, loss = model(X, Y)
            loss.backward()
            lib.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step

    kstep = kn.compile(make_step(kmodel, kopt, kn))
    tstep = make_step(tmodel, topt, torch)
    klosses, tlosses = [], []
    for x, y in _batches(ktrain.train_data, ktrain.block_size, ktrain.batch_size, 5, seed=5):
        klosses.append(float(kstep(kn.tensor(x), kn.tensor(y))))
        tlosses.append(float(tstep(torch.tensor(x), torch.tensor(y)).detach()))
        ksched.step()
        tsched.step()
    np.testing.assert_allclose(klosses, tlosses, rtol=5e-5)
    assert kstep.stats()["compiles"] == 1
    assert all(p.grad is None and not p.is_traced for p in kmodel.parameters())
    for (name, p), (_, tp) in zip(kmodel.named_parameters(), tmodel.named_parameters()):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-4, atol=2e-6,
                                   err_msg=name)
