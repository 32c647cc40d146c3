"""GEMMs with size-1 dims reach BLAS with leading dimensions it accepts.

A [B, 1] @ [1, N] product (the backward of a matmul with one output column) has a
leading stride of 1 along a size-1 dim; BLAS rejects ld < row length even there, and
a rejected call leaves the output unwritten. Checked through the gradients that
produce such layouts, compiled against eager."""

import numpy as np
import pytest

import kiln as kn


@pytest.mark.parametrize("m,k,n", [(64, 32, 1), (1, 32, 64), (64, 1, 48), (1, 1, 1), (7, 3, 1)])
def test_matmul_gradients_with_size_one_dims(m, k, n):
    h, w = kn.randn(m, k, seed=1), kn.randn(k, n, seed=2)

    def loss(h, w):
        return ((h @ w) ** 2).mean()

    compiled = kn.compile(kn.grad(loss, argnums=(0, 1)))(h, w)
    eager = kn.grad(loss, argnums=(0, 1))(h, w)
    for got, want in zip(compiled, eager):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    hn, wn = h.numpy().astype(np.float64), w.numpy().astype(np.float64)
    np.testing.assert_allclose(eager[1].numpy(), 2 * hn.T @ (hn @ wn) / (m * n), rtol=1e-4,
                               atol=1e-5)
