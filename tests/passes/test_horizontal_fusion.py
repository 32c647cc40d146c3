"""Horizontal fusion (issue 21): loop kernels over one iteration space share one kernel
when neither waits on the other through a third kernel or an unfused node; a loop that
reads another loop's value directly joins it (a multi-output kernel). Before/expected
pairs in text IR (STYLE §3), numerics through the reference interpreter and the CPU
backend, and `kiln dump --stage kernels` showing the merged kernel."""

import numpy as np
import pytest

import kiln as kn
import kiln.passes.fusion as fusion
from kiln.codegen.kernel_ir import format_kernel
from kiln.ir.parser import parse_graph
from kiln.passes.fusion import fuse
from tests.cli_helpers import kiln_cli
from tests.passes.test_fusion import check_fuse_case

CASES = {
    "four independent pointwise ops on different inputs: one kernel (was four)": ("""
graph @g(%a: f32[8], %b: f32[8], %c: f32[8], %d: f32[8]) -> (f32[8], f32[8], f32[8], f32[8])
  %0 = exp(%a) : f32[8]
  %1 = neg(%b) : f32[8]
  %2 = sqrt(%c) : f32[8]
  %3 = tanh(%d) : f32[8]
  return %0, %1, %2, %3
""", """
graph @g(%a: f32[8], %b: f32[8], %c: f32[8], %d: f32[8]) -> (f32[8], f32[8], f32[8], f32[8])
  %0, %1, %2, %3 = fused(%a, %b, %c, %d) {kind="loop"} : f32[8], f32[8], f32[8], f32[8]
    region(%4: f32[8], %5: f32[8], %6: f32[8], %7: f32[8]):
      %8 = exp(%4) : f32[8]
      %9 = neg(%5) : f32[8]
      %10 = sqrt(%6) : f32[8]
      %11 = tanh(%7) : f32[8]
      yield %8, %9, %10, %11
    end
  return %0, %1, %2, %3
"""),
    # exp and the products have several readers, so each used to get a buffer and a kernel
    # of its own; in one kernel they are registers and only the outputs are stored
    "values read by several loops of one shape: one multi-output kernel": ("""
graph @g(%x: f32[8], %y: f32[8]) -> (f32[8], f32[8])
  %0 = exp(%x) : f32[8]
  %1 = mul(%0, %y) : f32[8]
  %2 = add(%0, %1) : f32[8]
  %3 = mul(%1, %2) : f32[8]
  %4 = sub(%3, %0) : f32[8]
  return %2, %4
""", """
graph @g(%x: f32[8], %y: f32[8]) -> (f32[8], f32[8])
  %0, %1 = fused(%x, %y) {kind="loop"} : f32[8], f32[8]
    region(%2: f32[8], %3: f32[8]):
      %4 = exp(%2) : f32[8]
      %5 = mul(%4, %3) : f32[8]
      %6 = add(%4, %5) : f32[8]
      %7 = mul(%5, %6) : f32[8]
      %8 = sub(%7, %4) : f32[8]
      yield %6, %8
    end
  return %0, %1
"""),
    # the add waits on exp through the sort: merged, the kernel would wait on itself;
    # the f32[4] loop is another iteration space
    "no merge through an unfused node, none across shapes": ("""
graph @g(%x: f32[8], %y: f32[4]) -> (f32[8], f32[4], f32[8], f32[8])
  %0 = exp(%x) : f32[8]
  %1 = neg(%y) : f32[4]
  %2, %3 = sort(%0) {axis=0, descending=false} : f32[8], i64[8]
  %4 = add(%2, %0) : f32[8]
  %5 = mul(%x, %x) : f32[8]
  return %0, %1, %4, %5
""", """
graph @g(%x: f32[8], %y: f32[4]) -> (f32[8], f32[4], f32[8], f32[8])
  %0, %1 = fused(%x) {kind="loop"} : f32[8], f32[8]
    region(%2: f32[8]):
      %3 = exp(%2) : f32[8]
      %4 = mul(%2, %2) : f32[8]
      yield %3, %4
    end
  %5 = fused(%y) {kind="loop"} : f32[4]
    region(%6: f32[4]):
      %7 = neg(%6) : f32[4]
      yield %7
    end
  %8, %9 = sort(%0) {axis=0, descending=false} : f32[8], i64[8]
  %10 = fused(%8, %0) {kind="loop"} : f32[8]
    region(%11: f32[8], %12: f32[8]):
      %13 = add(%11, %12) : f32[8]
      yield %13
    end
  return %0, %5, %10, %1
"""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_horizontal_case(name):
    check_fuse_case(*CASES[name])


def test_the_earlier_rule_kept_independent_loops_apart(monkeypatch):
    monkeypatch.setattr(fusion, "MERGE_INDEPENDENT", False)
    before, _ = CASES["four independent pointwise ops on different inputs: one kernel (was four)"]
    assert sum(n.op == "fused" for n in fuse(parse_graph(before)).nodes) == 4


def sixteen(*xs):
    return tuple(kn.exp(x) * (i + 1) for i, x in enumerate(xs))


def test_sixteen_small_independent_ops_compile_to_one_kernel_shown_by_kiln_dump(tmp_path):
    xs = [np.full(32, i / 16, np.float32) for i in range(16)]
    compiled = kn.compile(sixteen)
    for k, (got, x) in enumerate(zip(compiled(*xs), xs)):
        np.testing.assert_allclose(got.numpy(), np.exp(x) * (k + 1), rtol=1e-6)
    assert len(compiled.compiled_graphs()[0].program.kernels) == 1
    path = tmp_path / "sixteen.kir"
    kn.export(sixteen, tuple(xs)).save(str(path))
    code, out, err = kiln_cli("dump", path, "--stage", "kernels")
    assert code == 0, err
    assert out.count("kernel ") == 1 and out.count("store ") == 16


def _residual_gelu_blocks(w1, w2, x):
    import kiln.nn.functional as F

    for _ in range(2):  # pre-norm residual blocks, as a transformer's MLP
        x = x + F.gelu(F.layer_norm(x, (x.shape[-1],)) @ w1) @ w2
    return (x * x).sum()


def _gelu_step(w1, w2, x):
    return kn.value_and_grad(_residual_gelu_blocks, argnums=(0, 1))(w1, w2, x)


def test_training_step_gelu_is_one_kernel_per_layer(monkeypatch):
    """The forward layer_norm statistics group with the backward's reductions of the same
    domain until `_order` splits that cycle; splitting it before loops merge lets exact
    GELU's four loops (scale, erf, +1, product) share one kernel per layer (was four)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((32, 128), (128, 32)))
    plans = {}
    for split in (False, True):
        monkeypatch.setattr(fusion, "SPLIT_BEFORE_MERGE", split)
        compiled = kn.compile(_gelu_step)
        loss, (g1, g2) = compiled(w1, w2, x)
        tw1, tw2 = (torch.tensor(w, requires_grad=True) for w in (w1, w2))
        tx = torch.tensor(x)
        for _ in range(2):
            h = torch.nn.functional.layer_norm(tx, (32,))
            tx = tx + torch.nn.functional.gelu(h @ tw1) @ tw2
        want = (tx * tx).sum()
        want.backward()
        np.testing.assert_allclose(float(loss.numpy()), want.item(), rtol=1e-5)
        np.testing.assert_allclose(g1.numpy(), tw1.grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g2.numpy(), tw2.grad.numpy(), rtol=1e-4, atol=1e-4)
        kernels = [format_kernel(k) for k in compiled.compiled_graphs()[0].program.kernels.values()]
        plans[split] = (len(kernels), [t for t in kernels if "erf(" in t])
    (before, erf_before), (after, erf_after) = plans[False], plans[True]
    assert after < before
    assert len(erf_after) == 2 and all("erf(mul(load" in t for t in erf_after)  # scale inline
    assert all("erf(load" in t for t in erf_before)  # erf read the scaled value's buffer
