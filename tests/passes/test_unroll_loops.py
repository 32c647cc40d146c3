"""unroll_loops: while_loops with a compile-time trip count and a pointwise body become
straight-line code that fuses into one kernel; every other loop is left alone."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.passes import unroll_loops as unroll_module
from kiln.passes.unroll_loops import unroll_loops
from kiln.runtime.program import Control, Launch
from tests.passes.examples import assert_rewrites


def _loop(bound: str, body: str, cond_extra: str = "") -> str:
    return f"""
graph @g(%x: f32[8]) -> f32[8]
  %0 = full() {{dtype=i32, shape=(), value=0}} : i32[]
  %1, %2 = while_loop(%0, %x) : i32[], f32[8]
    region(%3: i32[], %4: f32[8]):
      %5 = full() {{dtype=i32, shape=(), value={bound}}} : i32[]
      %6 = lt(%3, %5) : i1[]{cond_extra}
      yield %6
    region(%7: i32[], %8: f32[8]):
      %9 = full() {{dtype=i32, shape=(), value=1}} : i32[]
      %10 = add(%7, %9) : i32[]
{body}
      yield %10, %12
    end
  %13 = neg(%2) : f32[8]
  return %13
"""


POINTWISE = """      %11 = exp(%8) : f32[8]
      %12 = mul(%8, %11) : f32[8]"""


def test_two_trips_become_two_copies_of_the_body():
    expected = """
graph @g(%x: f32[8]) -> f32[8]
  %0 = full() {dtype=i32, shape=(), value=0} : i32[]
  %1 = full() {dtype=i32, shape=(), value=1} : i32[]
  %2 = add(%0, %1) : i32[]
  %3 = exp(%x) : f32[8]
  %4 = mul(%x, %3) : f32[8]
  %5 = full() {dtype=i32, shape=(), value=1} : i32[]
  %6 = add(%2, %5) : i32[]
  %7 = exp(%4) : f32[8]
  %8 = mul(%4, %7) : f32[8]
  %9 = neg(%8) : f32[8]
  return %9
"""
    before = _loop(2, POINTWISE)
    result = assert_rewrites(unroll_loops, before, expected)
    x = np.linspace(-1, 1, 8).astype(np.float32)
    np.testing.assert_array_equal(run_graph(result, x)[0], run_graph(parse_graph(before), x)[0])


def test_zero_trips_leave_the_initial_values():
    before = _loop(0, POINTWISE)
    result = unroll_loops(parse_graph(before))
    assert "while_loop" not in str(result) and "neg(%x)" in str(result)
    x = np.linspace(-1, 1, 8).astype(np.float32)
    np.testing.assert_array_equal(run_graph(result, x)[0], -x)


@pytest.mark.parametrize("before", [
    _loop(1000, POINTWISE),  # more than MAX_TRIPS
    _loop(3, """      %11 = reduce_sum(%8) {axes=(0,)} : f32[]
      %14 = broadcast_in_dim(%11) {broadcast_dimensions=(), shape=(8,)} : f32[8]
      %12 = add(%8, %14) : f32[8]"""),  # a reduction in the body: not one loop nest
    # the condition reads the tensor: a data-dependent trip count
    _loop(3, POINTWISE, """
      %20 = reduce_max(%4) {axes=(0,)} : f32[]
      %21 = full() {dtype=f32, shape=(), value=100} : f32[]
      %22 = lt(%20, %21) : i1[]
      %23 = and(%6, %22) : i1[]""").replace("yield %6\n    region(%7", "yield %23\n    region(%7"),
], ids=["too-many-trips", "reduction-in-body", "data-dependent"])
def test_loops_that_stay_loops(before):
    graph = parse_graph(before)
    assert unroll_loops(graph) is graph


def newton(a):
    def body(i, y):
        return i + 1, 0.5 * (y + a / y)

    return kn.while_loop(lambda i, y: i < 20, body, (kn.tensor(0, dtype=kn.int32), kn.ones_like(a)))[1]


def test_compiled_newton_is_one_kernel_with_the_loops_exact_result():
    a = np.random.default_rng(0).uniform(0.5, 100.0, 4099).astype(np.float32)
    f = kn.compile(newton)
    got = f(a).numpy()
    np.testing.assert_array_equal(got, newton(kn.tensor(a)).numpy())  # eager: the loop, run
    np.testing.assert_allclose(got, np.sqrt(a), rtol=1e-6)
    (compiled,) = f.compiled_graphs()
    steps = compiled.program.steps
    assert not any(isinstance(s, Control) for s in steps)
    assert sum(isinstance(s, Launch) for s in steps) == 1


def test_float_state_and_a_nested_loop_match_eager(monkeypatch):
    def f(x, n):
        def outer_body(j, y):  # the outer loop's count is an input: it stays a loop
            def inner(t, z):
                return t + 0.25, z * 0.5 + kn.sin(z) * t
            return j + 1, kn.while_loop(lambda t, z: t < 1.0, inner, (kn.tensor(0.0), y))[1]
        return kn.while_loop(lambda j, y: j < n, outer_body, (kn.tensor(0, dtype=kn.int32), x))[1]

    x = np.linspace(-2, 2, 33).astype(np.float32)
    n = np.array(3, np.int32)
    compiled = kn.compile(f)
    np.testing.assert_array_equal(compiled(x, n).numpy(), f(kn.tensor(x), kn.tensor(n)).numpy())
    (graph,) = compiled.compiled_graphs()
    loops = [node for node in graph.optimized.walk() if node.op == "while_loop"]
    assert len(loops) == 1  # the inner loop (4 trips of a float counter) was unrolled
    monkeypatch.setattr(unroll_module, "MAX_TRIPS", 3)  # 4 trips: now over the limit
    kept = kn.compile(f)
    np.testing.assert_array_equal(kept(x, n).numpy(), compiled(x, n).numpy())
    (graph,) = kept.compiled_graphs()
    assert len([node for node in graph.optimized.walk() if node.op == "while_loop"]) == 2


def test_a_long_division_chain_runs_four_vectors_side_by_side():
    from kiln.frontend.stages import render_stage

    a = np.ones(1 << 12, np.float32)
    newton_source = render_stage(kn.trace(newton, a), "source")
    assert newton_source.count("fdiv float") >= 20
    assert '!"llvm.loop.interleave.count", i32 4' in newton_source
    plain_source = render_stage(kn.trace(lambda x: x * 2.0 + 1.0, a), "source")
    assert "interleave" not in plain_source  # LLVM's own choice for everything else
