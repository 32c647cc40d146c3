"""The layers a PyTorch model expects, against torch: values and gradients (through the
tape, i.e. the registry's vjp rules), eager and compiled."""

import numpy as np
import pytest

import kiln as kn
from kiln import nn
from kiln.nn import functional as F
from tests.torch_oracle import check_against_torch

torch = pytest.importorskip("torch")
TF = torch.nn.functional
RNG = np.random.default_rng(7)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _check(kfn, tfn, *arrays, rtol=1e-4, atol=1e-5, compiled=False):
    """Values and input gradients against torch; optionally the compiled values too."""
    want = check_against_torch(kfn, tfn, *arrays, rtol=rtol, atol=atol).numpy()
    if compiled:
        fast = kn.compile(lambda *a: kfn(*a))
        np.testing.assert_allclose(fast(*[kn.tensor(a) for a in arrays]).numpy(), want,
                                   rtol=rtol, atol=atol)


@pytest.mark.parametrize("n,kw", [(1, dict(stride=2, padding=1)), (1, dict(dilation=2, groups=2)),
                                  (3, dict(stride=(1, 2, 1), padding=1))])
def test_conv1d_conv3d(n, kw):
    x, w, b = _x(2, 4, *([7] * n)), _x(6, 4 // kw.get("groups", 1), *([3] * n)), _x(6)
    kf, tf = (F.conv1d, TF.conv1d) if n == 1 else (F.conv3d, TF.conv3d)
    _check(lambda x, w, b: kf(x, w, b, **kw), lambda x, w, b: tf(x, w, b, **kw), x, w, b,
           compiled=n == 1)


def test_conv_modules_load_torch_weights():
    for k_cls, t_cls, shape in ((nn.Conv1d, torch.nn.Conv1d, (2, 3, 9)),
                                (nn.Conv2d, torch.nn.Conv2d, (2, 3, 6, 6)),
                                (nn.Conv3d, torch.nn.Conv3d, (1, 3, 4, 5, 5))):
        t = t_cls(3, 4, 3, padding=1, stride=2)
        k = k_cls(3, 4, 3, padding=1, stride=2)
        k.load_state_dict({n: v.detach().numpy() for n, v in t.state_dict().items()})
        x = _x(*shape)
        np.testing.assert_allclose(k(kn.tensor(x)).numpy(), t(torch.tensor(x)).detach().numpy(),
                                   rtol=1e-4, atol=1e-5)
    same = nn.Conv1d(2, 2, 4, padding="same")
    assert same(kn.ones(1, 2, 9)).shape == (1, 2, 9)


@pytest.mark.parametrize("kind,n,kw", [
    ("max", 1, dict(kernel_size=3, stride=2, padding=1)), ("max", 2, dict(kernel_size=2)),
    ("max", 3, dict(kernel_size=2, stride=1)), ("avg", 1, dict(kernel_size=3, padding=1)),
    ("avg", 2, dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    ("avg", 3, dict(kernel_size=2))])
def test_pooling(kind, n, kw):
    x = _x(2, 3, *([6] * n))
    name = f"{kind}_pool{n}d"
    _check(lambda x: getattr(F, name)(x, **kw), lambda x: getattr(TF, name)(x, **kw), x,
           compiled=n == 2)


# unequal bins (7 into 3), and equal bins on every axis (one reduction: a global pool,
# 8 into 4, an axis kept by None or by its own size)
@pytest.mark.parametrize("n,size", [(1, 3), (2, (3, 2)), (2, 4), (3, 2), (1, 1), (2, 1), (2, (1, 4)),
                                    (2, (None, 2)), (3, (7, 2, 3)), (3, 1)])
def test_adaptive_pooling(n, size):
    x = _x(2, 3, *([7, 8, 6][:n]))
    for kind in ("avg", "max"):
        name = f"adaptive_{kind}_pool{n}d"
        _check(lambda x: getattr(F, name)(x, size), lambda x: getattr(TF, name)(x, size), x,
               compiled=n == 2 and size in ((3, 2), 1, (1, 4)))


def test_pool_modules():
    x = _x(1, 2, 8, 8)
    for k, t in ((nn.MaxPool2d(2), torch.nn.MaxPool2d(2)), (nn.AvgPool2d(3, 1, 1), torch.nn.AvgPool2d(3, 1, 1)),
                 (nn.AdaptiveAvgPool2d((1, 1)), torch.nn.AdaptiveAvgPool2d((1, 1)))):
        np.testing.assert_allclose(k(kn.tensor(x)).numpy(), t(torch.tensor(x)).numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_glu_and_interpolate():
    _check(lambda x: F.glu(x, 1), lambda x: TF.glu(x, 1), _x(2, 6, 3), compiled=True)
    x = _x(1, 2, 5, 4)
    for kw in (dict(scale_factor=2, mode="nearest"), dict(size=(7, 3), mode="nearest"),
               dict(scale_factor=2, mode="bilinear", align_corners=False),
               dict(size=(3, 9), mode="bilinear", align_corners=True),
               dict(scale_factor=1.5, mode="bilinear")):
        _check(lambda x: F.interpolate(x, **kw), lambda x: TF.interpolate(x, **kw), x,
               compiled=kw.get("mode") == "bilinear" and "size" in kw)
    _check(lambda x: F.interpolate(x, size=7, mode="linear"),
           lambda x: TF.interpolate(x, size=7, mode="linear"), _x(2, 3, 4))
    assert nn.GLU()(kn.ones(2, 4)).shape == (2, 2) and nn.Upsample(scale_factor=2)(
        kn.ones(1, 1, 2, 2)).shape == (1, 1, 4, 4)


@pytest.mark.parametrize("cls,shape", [("BatchNorm1d", (6, 3)), ("BatchNorm1d", (4, 3, 5)),
                                       ("BatchNorm2d", (4, 3, 5, 2)), ("BatchNorm3d", (2, 3, 2, 2, 3))])
def test_batch_norm_training_running_stats_and_eval(cls, shape):
    k, t = getattr(nn, cls)(3), getattr(torch.nn, cls)(3)
    k.weight = kn.tensor(_x(3))
    t.weight.data = torch.tensor(k.weight.numpy())
    for step in range(3):
        x = _x(*shape)
        kx, tx = kn.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
        ky, ty = k(kx), t(tx)
        np.testing.assert_allclose(ky.numpy(), ty.detach().numpy(), rtol=1e-4, atol=1e-5)
        (ky * ky).sum().backward()
        (ty * ty).sum().backward()
        np.testing.assert_allclose(kx.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(k.running_mean.numpy(), t.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k.running_var.numpy(), t.running_var.numpy(), rtol=1e-5, atol=1e-6)
    assert int(k.num_batches_tracked.item()) == 3
    np.testing.assert_allclose(k.weight.grad.numpy(), t.weight.grad.numpy(), rtol=1e-3, atol=1e-4)
    k.eval(), t.eval()
    x = _x(*shape)
    np.testing.assert_allclose(k(kn.tensor(x)).numpy(), t(torch.tensor(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_batch_norm_compiled_writes_running_stats_back():
    k, t = nn.BatchNorm2d(3, momentum=None), torch.nn.BatchNorm2d(3, momentum=None)
    fast = kn.compile(k)
    for step in range(3):
        x = _x(4, 3, 2, 2)
        np.testing.assert_allclose(fast(kn.tensor(x)).numpy(), t(torch.tensor(x)).detach().numpy(),
                                   rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(k.running_var.numpy(), t.running_var.numpy(), rtol=1e-5)
    assert int(k.num_batches_tracked.item()) == 3 and fast.stats()["compiles"] == 1


def test_group_and_instance_norm():
    x = _x(2, 6, 5)
    _check(lambda x: F.group_norm(x, 3), lambda x: TF.group_norm(x, 3), x, compiled=True)
    _check(lambda x: F.instance_norm(x), lambda x: TF.instance_norm(x), x)
    k, t = nn.GroupNorm(2, 6), torch.nn.GroupNorm(2, 6)
    np.testing.assert_allclose(k(kn.tensor(x)).numpy(), t(torch.tensor(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)
    k, t = nn.InstanceNorm2d(6, affine=True, track_running_stats=True), \
        torch.nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
    x4 = _x(2, 6, 3, 4)
    np.testing.assert_allclose(k(kn.tensor(x4)).numpy(), t(torch.tensor(x4)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(k.running_mean.numpy(), t.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    k.eval(), t.eval()
    np.testing.assert_allclose(k(kn.tensor(x4)).numpy(), t(torch.tensor(x4)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_layers_batch_first(norm_first):
    torch.manual_seed(0)
    kw = dict(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True,
              norm_first=norm_first)
    tenc, tdec = torch.nn.TransformerEncoderLayer(**kw), torch.nn.TransformerDecoderLayer(**kw)
    kenc, kdec = nn.TransformerEncoderLayer(**kw), nn.TransformerDecoderLayer(**kw)
    for k, t in ((kenc, tenc), (kdec, tdec)):
        k.load_state_dict({n: v.detach().numpy() for n, v in t.state_dict().items()})
    src, tgt = _x(2, 5, 8), _x(2, 4, 8)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    _check(lambda s: kenc(s), lambda s: tenc(s), src, rtol=1e-4, atol=1e-5, compiled=norm_first)
    _check(lambda t, m: kdec(t, m, tgt_mask=kn.tensor(mask.numpy()), tgt_is_causal=True),
           lambda t, m: tdec(t, m, tgt_mask=mask, tgt_is_causal=True), tgt, src,
           rtol=1e-4, atol=1e-5)
    stack = nn.TransformerEncoder(kenc, num_layers=2)
    assert len(list(stack.parameters())) == 2 * len(list(kenc.parameters()))
