"""examples/moe_layer.py: the MoE layer runs eagerly and compiled on the CPU and matches a
per-expert numpy loop; differentiates; and with --aot shows the tile choice and the
matrix instructions of the grouped GEMM compiled for sm_90 and gfx942."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from examples.moe_layer import example_inputs, main, moe_layer, numpy_loop


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_layer_matches_the_numpy_loop_eager_and_compiled(top_k):
    inputs = example_inputs(tokens=24, dim=16, hidden=32, experts=6, seed=top_k)
    expected = numpy_loop(*(a.numpy() for a in inputs), top_k=top_k)
    np.testing.assert_allclose(moe_layer(*inputs, top_k=top_k).numpy(), expected, atol=1e-5)
    compiled = kn.compile(lambda *a: moe_layer(*a, top_k=top_k))
    np.testing.assert_allclose(compiled(*inputs).numpy(), expected, atol=1e-5)


def test_layer_is_differentiable_in_its_weights():
    inputs = example_inputs(tokens=12, dim=8, hidden=16, experts=4)
    loss = lambda *a: (moe_layer(*a) ** 2).sum()  # noqa: E731
    grads = kn.grad(loss, argnums=(1, 2, 3))(*inputs)
    assert [g.shape for g in grads] == [a.shape for a in inputs[1:]]
    assert all(float(np.abs(g.numpy()).sum()) > 0 for g in grads)
    # the router learns through the gate weights; check one entry by finite differences
    eps, router = 1e-2, inputs[1].numpy().copy()
    router[3, 1] += eps
    plus = float(loss(inputs[0], kn.asarray(router), *inputs[2:]))
    router[3, 1] -= 2 * eps
    minus = float(loss(inputs[0], kn.asarray(router), *inputs[2:]))
    assert abs((plus - minus) / (2 * eps) - float(grads[0].numpy()[3, 1])) < 2e-2 * max(1.0, abs(plus))


def test_script_prints_what_it_did(capsys):
    assert main(["--tokens", "32", "--experts", "4"]) == 0
    out = capsys.readouterr().out
    assert "MoE layer: 32 tokens x 32 features, 4 experts (hidden 64), top-2 routing" in out
    assert "tokens per expert:" in out and "library calls: grouped_matmul" in out
    assert out.rstrip().endswith("ok")


def test_script_aot(capsys):
    pytest.importorskip("triton", reason="--aot compiles with triton")
    assert main(["--tokens", "16", "--experts", "4", "--aot", "--aot-shape", "256,256,512,4"]) == 0
    out = capsys.readouterr().out
    assert "tile selector: grouped_gemm m=512 n=512 k=256 num_experts=4 bfloat16 on H100" in out
    assert "sm_90: PTX" in out and "gfx942: AMDGCN" in out
    assert "v_mfma_" in out and ("wgmma.mma_async" in out or "mma.sync" in out)
