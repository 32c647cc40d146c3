"""The fused attention MSL kernel under the threadgroup simulator, against numpy:
plain, causal, boolean-masked (with a fully masked row: NaN, as torch), odd lengths."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.metal.attention import attention
from kiln.errors import KilnError
from tests.codegen.metal.conftest import needs_clang
from tests.codegen.metal.simulator import check_msl, simulate_emitted

RNG = np.random.default_rng(4)


def _reference(q, k, v, causal, mask):
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    allowed = np.ones(s.shape[1:], bool)
    if causal:
        allowed &= np.tril(np.ones_like(allowed))
    if mask is not None:
        allowed &= mask
    s = np.where(allowed, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v


@needs_clang
@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True), (True, True)])
def test_fused_attention_matches_numpy(tmp_path, causal, masked):
    bh, lq, lk, d = 3, 9, 37, 40  # keys past one block of 32, head dim past one lane slice
    q, k, v = (RNG.standard_normal((bh, n, d)).astype(np.float32) for n in (lq, lk, lk))
    mask = RNG.random((lq, lk)) < 0.7 if masked else None
    if masked:
        mask[4] = False  # a row with every key masked
        mask[:, 0] = True
        mask[4, :] = False
    kernel = attention(d, causal=causal, masked=masked)
    check_msl(kernel.source)
    out = np.zeros((bh, lq, d), np.float32)
    arrays = [q, k, v] + ([mask] if masked else []) + [out]
    _, arrays = simulate_emitted(kernel, arrays, {"BH": bh, "Lq": lq, "Lk": lk}, str(tmp_path))
    want = _reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal, mask)
    np.testing.assert_allclose(arrays[-1], want, rtol=1e-4, atol=1e-5)
    if masked:
        assert np.isnan(arrays[-1][:, 4]).all()


def test_head_dim_must_be_static():
    with pytest.raises(KilnError, match="K412"):
        attention(0)
