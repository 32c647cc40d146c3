"""kiln.nn.functional losses against torch.nn.functional: values and gradients."""

import numpy as np
import pytest

import kiln as kn
from kiln.nn import functional as F

torch = pytest.importorskip("torch", reason="torch (CPU) is a test extra: pip install -e .[test]")
TF = torch.nn.functional

rng = np.random.default_rng(0)
LOGITS = rng.standard_normal((6, 5)).astype(np.float32) * 2
TARGET = np.array([0, 4, 2, -100, 1, 4])
WEIGHT = rng.uniform(0.5, 2.0, 5).astype(np.float32)
LOGITS_3D = rng.standard_normal((2, 5, 3)).astype(np.float32)
TARGET_3D = np.array([[0, 1, 4], [3, 3, -100]])
PROBS = rng.dirichlet(np.ones(5), size=6).astype(np.float32)


def value_and_grad_both(kiln_loss, torch_loss, logits, *rest):
    """(kiln value, kiln grad) and (torch value, torch grad) w.r.t. the logits."""
    kv, kg = kn.value_and_grad(lambda z: kiln_loss(z, *[kn.tensor(r) for r in rest]))(
        kn.tensor(logits))
    tz = torch.tensor(logits, requires_grad=True)
    tv = torch_loss(tz, *[torch.tensor(r) for r in rest])
    tv.sum().backward()
    return (kv, kg), (tv, tz.grad)


def check(kiln_loss, torch_loss, logits, *rest, tol=1e-5):
    (kv, kg), (tv, tg) = value_and_grad_both(lambda *a: kiln_loss(*a).sum(), torch_loss, logits,
                                             *rest)
    np.testing.assert_allclose(kv.numpy(), tv.detach().sum().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(kg.numpy(), tg.numpy(), rtol=tol, atol=tol)
    # and the unreduced value itself
    out = kiln_loss(kn.tensor(logits), *[kn.tensor(r) for r in rest])
    ref = torch_loss(torch.tensor(logits), *[torch.tensor(r) for r in rest])
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_with_class_indices(reduction, smoothing, weighted):
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    w = WEIGHT if weighted else None
    check(lambda z, t: F.cross_entropy(z, t, weight=None if w is None else kn.tensor(w), **kw),
          lambda z, t: TF.cross_entropy(z, t, weight=None if w is None else torch.tensor(w), **kw),
          LOGITS, TARGET)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_over_extra_dims_and_unbatched(reduction):
    check(lambda z, t: F.cross_entropy(z, t, reduction=reduction, label_smoothing=0.1),
          lambda z, t: TF.cross_entropy(z, t, reduction=reduction, label_smoothing=0.1),
          LOGITS_3D, TARGET_3D)
    check(lambda z, t: F.cross_entropy(z, t), lambda z, t: TF.cross_entropy(z, t),
          LOGITS[0], np.array(3))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_with_class_probabilities(reduction, smoothing):
    check(lambda z, t, w: F.cross_entropy(z, t, weight=w, reduction=reduction,
                                          label_smoothing=smoothing),
          lambda z, t, w: TF.cross_entropy(z, t, weight=w, reduction=reduction,
                                           label_smoothing=smoothing),
          LOGITS, PROBS, WEIGHT)


def test_nll_mse_l1_and_bce_with_logits():
    logp = torch.log_softmax(torch.tensor(LOGITS), 1).numpy()
    check(lambda z, t: F.nll_loss(z, t, ignore_index=-100), lambda z, t: TF.nll_loss(z, t),
          logp, TARGET)
    y = rng.standard_normal(LOGITS.shape).astype(np.float32)
    for reduction in ("mean", "sum", "none"):
        check(lambda z, t: F.mse_loss(z, t, reduction=reduction),
              lambda z, t: TF.mse_loss(z, t, reduction=reduction), LOGITS, y)
        check(lambda z, t: F.l1_loss(z, t, reduction=reduction),
              lambda z, t: TF.l1_loss(z, t, reduction=reduction), LOGITS, y)
    big = LOGITS * 30  # stable for large |x|
    bits = (rng.uniform(size=LOGITS.shape) > 0.5).astype(np.float32)
    check(lambda z, t: F.binary_cross_entropy_with_logits(z, t),
          lambda z, t: TF.binary_cross_entropy_with_logits(z, t), big, bits)
    pw = np.linspace(0.5, 3, 5).astype(np.float32)
    check(lambda z, t, w, p: F.binary_cross_entropy_with_logits(z, t, weight=w, pos_weight=p,
                                                                reduction="none"),
          lambda z, t, w, p: TF.binary_cross_entropy_with_logits(z, t, weight=w, pos_weight=p,
                                                                 reduction="none"),
          LOGITS, bits, WEIGHT, pw)


def test_cross_entropy_compiles_with_its_gradient():
    f = kn.compile(kn.value_and_grad(lambda z, t: F.cross_entropy(z, t, label_smoothing=0.1)))
    (kv, kg), (tv, tg) = value_and_grad_both(
        lambda z, t: F.cross_entropy(z, t, label_smoothing=0.1),
        lambda z, t: TF.cross_entropy(z, t, label_smoothing=0.1), LOGITS, TARGET)
    v, g = f(kn.tensor(LOGITS), kn.tensor(TARGET))
    np.testing.assert_allclose(v.numpy(), tv.detach().numpy(), rtol=1e-5)
    np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=1e-5, atol=1e-6)


def test_loss_argument_errors():
    with pytest.raises(kn.KilnShapeError, match=r"target i64\[5\] must have shape \[6\]"):
        F.cross_entropy(kn.tensor(LOGITS), kn.tensor(TARGET[:5]))
    with pytest.raises(kn.KilnArgumentError, match="reduction"):
        F.cross_entropy(kn.tensor(LOGITS), kn.tensor(TARGET), reduction="avg")
    with pytest.raises(kn.KilnShapeError, match="same shape"):
        F.mse_loss(kn.ones(3), kn.ones(4))
    with pytest.raises(kn.KilnDTypeError, match="integer tensor"):
        F.nll_loss(kn.tensor(LOGITS), kn.tensor(PROBS[:, 0]))
