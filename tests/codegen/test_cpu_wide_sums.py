"""Long float32 sums run in 512-bit lanes on AVX-512 hosts (llvm_emit.wide_attrs): the
kernel bodies carry the attributes only where a sum may be long, and the values stay
those of the float64 reference at float32 accuracy, for every length, static or not."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import llvm_emit
from kiln.codegen.cpu.microkernel import vector_bits
from kiln.frontend.stages import render_stage

WIDE = '"prefer-vector-width"="512"'


def _bodies(fn, *args) -> list[str]:
    text = render_stage(kn.trace(fn, *args), "source", "cpu")
    return [line for line in text.splitlines() if line.startswith("define internal") and ".body(" in line]


def test_only_long_sums_ask_for_wide_vectors():
    ssq = lambda x: (x * x).sum()  # noqa: E731
    long_ = _bodies(ssq, np.ones(1 << 16, np.float32))
    short = _bodies(ssq, np.ones(llvm_emit.LONG_SUM - 1, np.float32))
    rows = _bodies(lambda x: x.sum(dim=-1), np.ones((64, 256), np.float32))
    expect = WIDE in llvm_emit.wide_attrs()
    assert any(WIDE in line for line in long_) == expect
    assert not any(WIDE in line for line in short)
    assert not any(WIDE in line for line in rows)
    if vector_bits() < 512:
        assert llvm_emit.wide_attrs() == ""


@pytest.mark.parametrize("n", [llvm_emit.LONG_SUM - 1, llvm_emit.LONG_SUM, 3 * llvm_emit.SUM_BLOCK + 17,
                               (1 << 20) + 5])
def test_wide_sums_match_float64(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got = kn.compile(lambda x: (x * x).sum())(x).numpy()
    ref = np.dot(x.astype(np.float64), x.astype(np.float64))
    assert abs(float(got) - ref) <= 1e-6 * ref


def test_row_sums_of_unknown_length_match_numpy():
    n = kn.ShapeVar("n", min=1, max=1 << 16)
    f = kn.compile(lambda x: kn.softmax(x, dim=-1).sum(dim=-1) + x.sum(dim=-1),
                   dynamic_shapes={"x": kn.TensorSpec([3, n])})
    for length in (5, 4096, 9000):
        x = np.random.default_rng(length).standard_normal((3, length)).astype(np.float32)
        e = np.exp(x - x.max(-1, keepdims=True))
        ref = (e / e.sum(-1, keepdims=True)).sum(-1) + x.astype(np.float64).sum(-1)
        np.testing.assert_allclose(f(x).numpy(), ref, rtol=1e-5, atol=1e-4)
