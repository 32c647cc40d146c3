"""fuse through control flow: a group never waits on itself through a `cond` or loop.

`kn.cond(x.sum() > 0, f, g, x).sum()` has two sums over one domain, which fusion likes
to put in one kernel; but the second reads the `cond`, which reads the first. Each case
is a before/expected pair in text IR (STYLE §3), then the reproducer of issue 21 end to
end: compiled, exported-and-loaded from a .kir, and through `kiln dump --stage kernels`."""

import numpy as np
import pytest

import kiln as kn
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.passes.fusion import fuse
from tests.cli_helpers import kiln_cli
from tests.passes.examples import assert_rewrites

CASES = {
    "a reduction feeding a cond's predicate and one reading its result: two kernels": ("""
graph @g(%x: f32[6]) -> f32[]
  %0 = reduce_sum(%x) {axes=(0,)} : f32[]
  %1 = full() {dtype=f32, shape=(), value=0} : f32[]
  %2 = gt(%0, %1) : i1[]
  %3 = cond(%2, %x) : f32[6]
    region(%4: f32[6]):
      %5 = full() {dtype=f32, shape=(6,), value=1} : f32[6]
      %6 = sub(%4, %5) : f32[6]
      yield %6
    region(%7: f32[6]):
      %8 = full() {dtype=f32, shape=(6,), value=2} : f32[6]
      %9 = mul(%7, %8) : f32[6]
      yield %9
    end
  %10 = reduce_sum(%3) {axes=(0,)} : f32[]
  return %10
""", """
graph @g(%x: f32[6]) -> f32[]
  %0 = fused(%x) {kind="reduction"} : i1[]
    region(%1: f32[6]):
      %2 = reduce_sum(%1) {axes=(0,)} : f32[]
      %3 = full() {dtype=f32, shape=(), value=0} : f32[]
      %4 = gt(%2, %3) : i1[]
      yield %4
    end
  %5 = cond(%0, %x) : f32[6]
    region(%6: f32[6]):
      %7 = fused(%6) {kind="loop"} : f32[6]
        region(%8: f32[6]):
          %9 = full() {dtype=f32, shape=(6,), value=1} : f32[6]
          %10 = sub(%8, %9) : f32[6]
          yield %10
        end
      yield %7
    region(%11: f32[6]):
      %12 = fused(%11) {kind="loop"} : f32[6]
        region(%13: f32[6]):
          %14 = full() {dtype=f32, shape=(6,), value=2} : f32[6]
          %15 = mul(%13, %14) : f32[6]
          yield %15
        end
      yield %12
    end
  %16 = fused(%5) {kind="reduction"} : f32[]
    region(%17: f32[6]):
      %18 = reduce_sum(%17) {axes=(0,)} : f32[]
      yield %18
    end
  return %16
"""),
    # a branch that was not closed reads %0 directly: the capture is a dependency of the
    # cond (and gives %0 a buffer), exactly as an operand would be
    "a value a branch captures is a dependency of the cond": ("""
graph @g(%x: f32[6], %p: i1[]) -> f32[]
  %0 = reduce_sum(%x) {axes=(0,)} : f32[]
  %1 = cond(%p) : f32[6]
    region():
      %2 = broadcast_in_dim(%0) {broadcast_dimensions=(), shape=(6,)} : f32[6]
      yield %2
    region():
      %3 = neg(%x) : f32[6]
      yield %3
    end
  %4 = reduce_sum(%1) {axes=(0,)} : f32[]
  %5 = add(%4, %0) : f32[]
  return %5
""", """
graph @g(%x: f32[6], %p: i1[]) -> f32[]
  %0 = fused(%x) {kind="reduction"} : f32[]
    region(%1: f32[6]):
      %2 = reduce_sum(%1) {axes=(0,)} : f32[]
      yield %2
    end
  %3 = cond(%p) : f32[6]
    region():
      %4 = fused(%0) {kind="loop"} : f32[6]
        region(%5: f32[]):
          %6 = broadcast_in_dim(%5) {broadcast_dimensions=(), shape=(6,)} : f32[6]
          yield %6
        end
      yield %4
    region():
      %7 = fused(%x) {kind="loop"} : f32[6]
        region(%8: f32[6]):
          %9 = neg(%8) : f32[6]
          yield %9
        end
      yield %7
    end
  %10 = fused(%3, %0) {kind="reduction"} : f32[]
    region(%11: f32[6], %12: f32[]):
      %13 = reduce_sum(%11) {axes=(0,)} : f32[]
      %14 = add(%13, %12) : f32[]
      yield %14
    end
  return %10
"""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fuse_case(name):
    before, expected = CASES[name]
    result = assert_rewrites(fuse, before, expected)
    graph = parse_graph(before)
    x = np.arange(-2, 4, dtype=np.float32)
    args = [x] if len(graph.inputs) == 1 else [x, np.array(True)]
    for flip in (1, -1):
        args[0] = x * flip
        np.testing.assert_allclose(run_graph(result, *args), run_graph(graph, *args))


def _pred_then_sum(x):
    return kn.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, x).sum()


def _rows(x, w):
    """Row sums feeding the predicate, row sums and a softmax of the cond's result, and
    a GEMM epilogue reading it: every group kind on both sides of the cond."""
    s = x.sum(dim=1)
    y = kn.cond(s.sum() > 0, lambda x: kn.exp(x), lambda x: x * 3, x)
    return y.sum(dim=1) + s, kn.softmax(y, dim=1), (x @ w).relu() * y.sum()


def _cases():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    w = rng.standard_normal((5, 5)).astype(np.float32)
    yield _pred_then_sum, (np.arange(6, dtype=np.float32),)
    yield _pred_then_sum, (-np.arange(6, dtype=np.float32),)
    yield _rows, (abs(x), w)
    yield _rows, (-abs(x), w)


def _check(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", range(4))
def test_issue_21_reproducer_compiles_exports_loads_and_dumps(case, tmp_path):
    fn, args = list(_cases())[case]
    want = fn(*[kn.tensor(a) for a in args])
    _check(kn.compile(fn)(*args), want)
    path = tmp_path / "f.kir"
    kn.export(fn, args).save(str(path))
    _check(kn.load(str(path))(*args), want)
    code, out, err = kiln_cli("dump", path, "--stage", "kernels")
    assert code == 0, err
    assert out.count("kernel ") >= 3  # predicate, branch, final reduction at least
