"""Kernels identical but for their name (a model's repeated layers) compile once and run
under their own names; object code round-trips the same way."""

import dataclasses

import numpy as np

import kiln as kn
from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.cpu.backend import _distinct

from tests.codegen.cpu_helpers import make_arrays
from tests.codegen.test_cpu_kernels import broadcast_chain
from tests.codegen.test_cpu_gemm import gemm


def test_twins_share_code_under_their_own_names():
    be = CpuBackend(CpuOptions())
    a = broadcast_chain()
    b = dataclasses.replace(a, name="chain_twin")
    g1 = gemm(1, 9, 7, 5, epilogue="bias_relu")
    g2 = dataclasses.replace(g1, name="g_twin")
    kernels = [be.legalize(k) for k in (a, g1, b, g2)]
    unique, index = _distinct(kernels)
    assert len(unique) == 2 and index == [0, 1, 0, 1]
    for compiled in (be.build(kernels), be.load_built_object_code(kernels, be.build_object_code(kernels))):
        assert [c.name for c in compiled] == ["chain", "g", "chain_twin", "g_twin"]
        assert compiled[0].address == compiled[2].address
        for k, c in zip(kernels, compiled):
            sizes = {"B": 4} if k.sizes else {}
            arrays = make_arrays(k, sizes, np.random.default_rng(0))
            twin = [x.copy() for x in arrays]
            c(arrays, sizes)
            compiled[kernels.index(k) % 2](twin, sizes)
            np.testing.assert_array_equal(arrays[-1], twin[-1])


def test_two_identical_layers_compile_their_kernels_once():
    def layer(x, w):
        return kn.tanh(x @ w) * 2 + 1

    f = kn.compile(lambda x, w1, w2: layer(layer(x, w1), w2))
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 8), (8, 8), (8, 8)))
    out = f(*(kn.tensor(v) for v in (x, w1, w2)))
    want = np.tanh((np.tanh(x @ w1) * 2 + 1) @ w2) * 2 + 1
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    kernels = list(f.compiled_graphs()[0].program.kernels.values())
    assert len(_distinct(kernels)[0]) < len(kernels)
