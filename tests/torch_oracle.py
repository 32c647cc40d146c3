"""A shared torch-oracle check: values and input gradients of a kiln function against
the same function in torch (kiln's gradients through the tape, i.e. the vjp rules)."""

import numpy as np

import kiln as kn


def check_against_torch(kfn, tfn, *arrays, rtol=1e-4, atol=1e-5, seed=0):
    """Assert kfn(*arrays) == tfn(*arrays) and that the gradients of sum(f * r), r a fixed
    random tensor, agree for every input; returns kiln's output."""
    import torch

    ks = [kn.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    kout, tout = kfn(*ks), tfn(*ts)
    np.testing.assert_allclose(kout.numpy(), tout.detach().numpy(), rtol=rtol, atol=atol)
    r = np.random.default_rng(seed).standard_normal(tuple(tout.shape)).astype(np.float32)
    (kout * kn.tensor(r)).sum().backward()
    (tout * torch.tensor(r)).sum().backward()
    for i, (k, t) in enumerate(zip(ks, ts)):
        np.testing.assert_allclose(k.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {i}")
    return kout
