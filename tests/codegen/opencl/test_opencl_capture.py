"""kn.capture of OpenCL programs: the launch list recorded once and replayed as one
enqueue loop (the whole program one native run, loops and branches included), results
equal to numpy's on new inputs, and K390 for a replay of another shape."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.opencl.launcher import OpenCLLauncher
from kiln.errors import KilnError
from kiln.runtime.capture import NativeLaunch
from tests.codegen.opencl.conftest import needs_device

pytestmark = needs_device
rng = np.random.default_rng(3)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_replay_is_one_enqueue_loop_and_matches_numpy_on_new_inputs():
    x, w = rng.standard_normal((48, 40)).astype(np.float32), rng.standard_normal((40, 24)).astype(np.float32)
    g = kn.capture(lambda a, b: kn.softmax(kn.relu(a @ b), dim=-1).sum(0), x, w, backend="opencl")
    assert isinstance(g.plan.launcher, OpenCLLauncher) and g.native_runs == 1
    assert sum(isinstance(op, NativeLaunch) for op in g.plan.ops) >= 2  # GEMM, then the reductions
    for _ in range(3):
        x = rng.standard_normal((48, 40)).astype(np.float32)
        np.testing.assert_allclose(g(x, w).numpy(), _softmax(np.maximum(x @ w, 0)).sum(0), rtol=1e-4, atol=1e-5)


def test_loops_replay_natively_with_their_condition_read_between_trips():
    def f(a):
        return kn.while_loop(lambda v, i: i < 4, lambda v, i: (v * 1.5 + 1, i + 1), (a, kn.tensor(0)))[0]

    x = rng.standard_normal(300).astype(np.float32)
    g = kn.capture(f, x, backend="opencl")
    assert g.native_runs == 1
    want = x.copy()
    for _ in range(4):
        want = want * np.float32(1.5) + np.float32(1)
    np.testing.assert_allclose(g(x).numpy(), want, rtol=1e-6)


def test_a_replay_of_another_shape_is_k390():
    x = rng.standard_normal((8, 5)).astype(np.float32)
    g = kn.capture(lambda a: a.sum(-1) * 2, x, backend="opencl")
    np.testing.assert_allclose(g(x).numpy(), x.sum(-1) * 2, rtol=1e-6)
    with pytest.raises(KilnError, match="K390"):
        g(np.zeros((9, 5), np.float32))
