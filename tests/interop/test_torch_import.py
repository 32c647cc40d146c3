"""kn.from_torch: four models built here (MLP, CNN, transformer encoder, small GPT), imported
through torch.export; values (eager and compiled) and gradients checked against torch."""

import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnTorchImportError, KilnUnsupportedTorchOpError

torch = pytest.importorskip("torch", reason="kn.from_torch needs PyTorch (the torch extra)")
nn = torch.nn
F = torch.nn.functional


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(F.gelu(self.l1(x))).softmax(-1)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.fc = nn.Conv2d(8, 8, 3, stride=2), nn.Linear(8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.avg_pool2d(F.relu(self.c2(x)), 2, stride=1, padding=1, count_include_pad=False)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class GPT(nn.Module):
    def __init__(self, vocab=32, dim=16, heads=2, block=8):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(block, dim) * 0.02)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head, self.heads = nn.Linear(dim, vocab, bias=False), heads

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return self.head(self.lnf(x))


def _encoder(layers):
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def _cases():
    torch.manual_seed(0)
    cnn = CNN()
    with torch.no_grad():  # non-trivial running statistics
        cnn.bn.running_mean.uniform_(-0.5, 0.5)
        cnn.bn.running_var.uniform_(0.5, 2.0)
    return {"mlp": (MLP(), torch.randn(3, 8), 1e-5),
            "cnn": (cnn.eval(), torch.randn(2, 3, 8, 8), 1e-4),
            "encoder": (_encoder(2), torch.randn(2, 5, 16), 1e-4),
            "gpt": (GPT(), torch.randint(0, 32, (2, 8)), 1e-4)}


CASES = _cases()


def _params_grads(model, x):
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach().numpy(), {k: p.grad.numpy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_torch(name):
    model, x, tol = CASES[name]
    prog = kn.from_torch(model, (x,))
    want, grads = _params_grads(model, x)
    xk = x.numpy()
    np.testing.assert_allclose(prog(xk).numpy(), want, rtol=tol, atol=tol)  # compiled
    np.testing.assert_allclose(prog.apply(prog.params, kn.asarray(xk)).numpy(), want, rtol=tol, atol=tol)

    weights = kn.linspace(-1, 1, want.shape[-1])

    floats = {k: v for k, v in prog.params.items() if v.dtype.is_floating}

    def loss(params, x):  # integer buffers (BatchNorm's num_batches_tracked) stay constant
        return (prog.apply({**prog.params, **params}, x) * weights).sum()

    got = kn.grad(loss)(floats, kn.asarray(xk))
    for key, g in grads.items():
        np.testing.assert_allclose(got[key].numpy(), g, rtol=1e-3, atol=1e-4, err_msg=key)


def test_graph_weights_and_safetensors(tmp_path):
    model, x, _ = CASES["mlp"]
    prog = kn.from_torch(model, (x,))
    assert list(prog.params) == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    graph = prog.graph(x.numpy())
    assert graph.name == "MLP" and len(graph.inputs) == 5
    assert "gelu" in str(graph) and "softmax" in str(graph)
    path = tmp_path / "mlp.safetensors"
    prog.save_weights(path)
    from safetensors.torch import load_file

    theirs = load_file(str(path))
    np.testing.assert_array_equal(theirs["l1.weight"].numpy(), model.l1.weight.detach().numpy())
    fresh = MLP()
    fresh.load_state_dict(theirs)  # kiln-written weights load into torch
    other = kn.from_torch(MLP(), (x,))
    other.load_weights(path)
    np.testing.assert_allclose(other(x.numpy()).numpy(), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    exported = prog.export(x.numpy())
    exported.save(str(tmp_path / "mlp.kir"))
    loaded = kn.load(str(tmp_path / "mlp.kir"))
    np.testing.assert_allclose(loaded(*prog.params.values(), x.numpy()).numpy(),
                               model(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_dynamic_batch():
    model = MLP()
    batch = torch.export.Dim("batch", min=1, max=64)
    prog = kn.from_torch(model, (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    graph = prog.graph(np.zeros((4, 8), np.float32))
    assert "batch" in str(graph)
    for n in (1, 7, 33):
        x = torch.randn(n, 8)
        np.testing.assert_allclose(prog(x.numpy()).numpy(), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert prog._compiled.stats()["compiles"] == 1  # one compile serves every batch


class Lgamma(nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.lgamma(y)  # the line the error must name


def test_unsupported_op_names_op_and_line():
    with pytest.raises(KilnUnsupportedTorchOpError) as info:
        kn.from_torch(Lgamma(), (torch.rand(4) + 1,))
    message = str(info.value)
    assert message.startswith("[K346]") and "aten.lgamma" in message
    assert "test_torch_import.py" in message and "torch.lgamma(y)" in message


class MoreOps(nn.Module):
    """Group norm, cumprod, sort/argsort, leaky_relu, elu, log2, tril/triu, scatter_add."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x, idx):
        y = self.gn(x)
        z = torch.cumprod(y[:, :, 0, 0] * 0.5 + 1, dim=-1)
        values, order = torch.sort(z, dim=-1, descending=True)
        w = F.leaky_relu(y, 0.2) + F.elu(y) + torch.log2(y.abs() + 1)
        t = torch.tril(y[0, 0]) + torch.triu(y[0, 1], diagonal=1)
        s = torch.zeros(2, 4).scatter_add(1, idx, z)
        return values, order, w, t, s, torch.argsort(z, dim=1)


def test_more_ops_match_torch():
    torch.manual_seed(5)
    model = MoreOps().eval()
    x, idx = torch.randn(2, 4, 3, 3), torch.tensor([[0, 1, 1, 3], [2, 2, 0, 1]])
    prog = kn.from_torch(model, (x, idx))
    want = [w.detach().numpy() for w in model(x, idx)]
    for got in (prog(x.numpy(), idx.numpy()),
                prog.apply(prog.params, kn.asarray(x.numpy()), kn.asarray(idx.numpy()))):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.numpy().dtype == w.dtype
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 2, 2)

    def forward(self, x):
        return self.up(x)


def test_unsupported_variant_names_line():
    prog = kn.from_torch(Transposed(), (torch.randn(1, 2, 4, 4),))
    with pytest.raises(KilnUnsupportedTorchOpError, match=r"\[K346\].*transposed convolution") as info:
        prog(np.zeros((1, 2, 4, 4), np.float32))
    assert "self.up(x)" in str(info.value)


def test_import_errors():
    with pytest.raises(KilnTorchImportError, match=r"\[K345\].*torch.nn.Module"):
        kn.from_torch(lambda x: x, (torch.randn(2),))
    with pytest.raises(KilnTorchImportError, match="example input 0 is a str"):
        kn.from_torch(MLP(), ("x",))
    with pytest.raises(KilnTorchImportError, match="torch.export could not export"):
        kn.from_torch(MLP(), (torch.randn(3, 5),))  # wrong feature size
    bn = nn.BatchNorm1d(4)  # training mode: updates running statistics
    with pytest.raises(KilnTorchImportError, match="(?s)mutates buffer .running_mean.*eval"):
        kn.from_torch(bn, (torch.randn(3, 4),))


def test_dynamic_batch_and_sequence_gpt():
    """Symbolic sizes flow through views, slices (pos[:t]) and the causal mask."""
    torch.manual_seed(1)
    model = GPT()
    b, t = torch.export.Dim("b", min=1, max=16), torch.export.Dim("t", min=2, max=8)
    prog = kn.from_torch(model, (torch.randint(0, 32, (2, 8)),), dynamic_shapes=({0: b, 1: t},))
    for n, length in ((1, 4), (3, 8), (2, 2)):
        idx = torch.randint(0, 32, (n, length))
        np.testing.assert_allclose(prog(idx.numpy()).numpy(), model(idx).detach().numpy(),
                                   rtol=1e-4, atol=1e-5)
    assert prog._compiled.stats()["compiles"] == 1


def test_training_mode_dropout_says_eval():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))  # training mode
    with pytest.raises(KilnUnsupportedTorchOpError, match=r"(?s)native_dropout.*module.eval\(\)"):
        kn.from_torch(model, (torch.randn(2, 4),))
    prog = kn.from_torch(model.eval(), (torch.randn(2, 4),))
    x = torch.randn(3, 4)
    np.testing.assert_allclose(prog(x.numpy()).numpy(), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
