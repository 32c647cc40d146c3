"""LICM (STYLE §3: before and expected, as text IR): invariant nodes of while bodies move
before the loop and enter it as pass-through carried values; cheap nodes stay inline;
inner loops' invariants leave outer loops too; values a region reads from outside
become explicit operands. Every real graph keeps its results."""

import numpy as np
import pytest

from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.passes.dce import dce
from kiln.passes.licm import free_values, licm
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves, example


def test_invariant_nodes_move_before_the_loop():
    """reduce_sum and exp of the pass-through %x run once, before the loop; the
    broadcast of the hoisted sum stays inside (hoisting it would inflate a scalar into a
    buffer) and so does everything that reads the loop-carried %11."""
    before = """
graph @g(%x: f32[8], %n: i32[]) -> f32[8]
  %0 = full() {dtype=i32, shape=(), value=0} : i32[]
  %1, %2, %3, %4 = while_loop(%0, %x, %x, %n) : i32[], f32[8], f32[8], i32[]
    region(%5: i32[], %6: f32[8], %7: f32[8], %8: i32[]):
      %9 = lt(%5, %8) : i1[]
      yield %9
    region(%10: i32[], %11: f32[8], %12: f32[8], %13: i32[]):
      %14 = full() {dtype=i32, shape=(), value=1} : i32[]
      %15 = add(%10, %14) : i32[]
      %16 = reduce_sum(%12) {axes=(0,)} : f32[]
      %17 = broadcast_in_dim(%16) {broadcast_dimensions=(), shape=(8,)} : f32[8]
      %18 = exp(%12) : f32[8]
      %19 = mul(%11, %18) : f32[8]
      %20 = add(%19, %17) : f32[8]
      yield %15, %20, %12, %13
    end
  return %2
"""
    expected = """
graph @g(%x: f32[8], %n: i32[]) -> f32[8]
  %0 = full() {dtype=i32, shape=(), value=0} : i32[]
  %1 = reduce_sum(%x) {axes=(0,)} : f32[]
  %2 = exp(%x) : f32[8]
  %3, %4, %5, %6, %7, %8 = while_loop(%0, %x, %x, %n, %1, %2) : i32[], f32[8], f32[8], i32[], f32[], f32[8]
    region(%9: i32[], %10: f32[8], %11: f32[8], %12: i32[], %13: f32[], %14: f32[8]):
      %15 = lt(%9, %12) : i1[]
      yield %15
    region(%16: i32[], %17: f32[8], %18: f32[8], %19: i32[], %20: f32[], %21: f32[8]):
      %22 = full() {dtype=i32, shape=(), value=1} : i32[]
      %23 = add(%16, %22) : i32[]
      %24 = broadcast_in_dim(%20) {broadcast_dimensions=(), shape=(8,)} : f32[8]
      %25 = mul(%17, %21) : f32[8]
      %26 = add(%25, %24) : f32[8]
      yield %23, %26, %18, %19, %20, %21
    end
  return %4
"""
    result = assert_rewrites(licm, before, expected)
    x = np.linspace(-1, 1, 8).astype(np.float32)
    for n in (0, 1, 3):  # zero trips included: hoisting never changes a result
        np.testing.assert_array_equal(run_graph(result, x, np.array(n, np.int32))[0],
                                      run_graph(parse_graph(before), x, np.array(n, np.int32))[0])
    tidy = dce(result)  # DCE then drops the carried values nothing reads any more
    (loop,) = [n for n in tidy.nodes if n.op == "while_loop"]
    assert [str(v.type) for v in loop.operands] == ["i32[]", "f32[8]", "i32[]", "f32[]", "f32[8]"]


def test_a_chain_leaves_with_the_cheap_values_it_reads():
    """A chain of scalar work on a pass-through value leaves the loop, with the
    `full` it reads copied out (the body's own copy is dead, for DCE to remove)."""
    before = """
graph @g(%x: f32[8], %s: f32[]) -> f32[8]
  %0, %1 = while_loop(%x, %s) : f32[8], f32[]
    region(%2: f32[8], %3: f32[]):
      %4 = reduce_sum(%2) {axes=(0,)} : f32[]
      %5 = lt(%4, %3) : i1[]
      yield %5
    region(%6: f32[8], %7: f32[]):
      %8 = full() {dtype=f32, shape=(), value=2.0} : f32[]
      %9 = mul(%7, %8) : f32[]
      %10 = sqrt(%9) : f32[]
      %11 = broadcast_in_dim(%10) {broadcast_dimensions=(), shape=(8,)} : f32[8]
      %12 = add(%6, %11) : f32[8]
      yield %12, %7
    end
  return %0
"""
    expected = """
graph @g(%x: f32[8], %s: f32[]) -> f32[8]
  %0 = full() {dtype=f32, shape=(), value=2.0} : f32[]
  %1 = mul(%s, %0) : f32[]
  %2 = sqrt(%1) : f32[]
  %3, %4, %5 = while_loop(%x, %s, %2) : f32[8], f32[], f32[]
    region(%6: f32[8], %7: f32[], %8: f32[]):
      %9 = reduce_sum(%6) {axes=(0,)} : f32[]
      %10 = lt(%9, %7) : i1[]
      yield %10
    region(%11: f32[8], %12: f32[], %13: f32[]):
      %14 = full() {dtype=f32, shape=(), value=2.0} : f32[]
      %15 = broadcast_in_dim(%13) {broadcast_dimensions=(), shape=(8,)} : f32[8]
      %16 = add(%11, %15) : f32[8]
      yield %16, %12, %13
    end
  return %3
"""
    result = assert_rewrites(licm, before, expected)


def test_inner_invariants_leave_the_outer_loop_too():
    """tanh of the inner loop's pass-through %20 leaves the inner loop, and since
    it is invariant in the outer loop as well (%9 passes through it), leaves that too."""
    before = """
graph @g(%x: f32[4], %w: f32[4], %n: i32[]) -> f32[4]
  %0, %1, %2 = while_loop(%x, %w, %n) : f32[4], f32[4], i32[]
    region(%3: f32[4], %4: f32[4], %5: i32[]):
      %6 = full() {dtype=i32, shape=(), value=0} : i32[]
      %7 = gt(%5, %6) : i1[]
      yield %7
    region(%8: f32[4], %9: f32[4], %10: i32[]):
      %11, %12, %13 = while_loop(%8, %9, %10) : f32[4], f32[4], i32[]
        region(%14: f32[4], %15: f32[4], %16: i32[]):
          %17 = full() {dtype=i32, shape=(), value=0} : i32[]
          %18 = gt(%16, %17) : i1[]
          yield %18
        region(%19: f32[4], %20: f32[4], %21: i32[]):
          %22 = tanh(%20) : f32[4]
          %23 = add(%19, %22) : f32[4]
          %24 = full() {dtype=i32, shape=(), value=1} : i32[]
          %25 = sub(%21, %24) : i32[]
          yield %23, %20, %25
        end
      %26 = full() {dtype=i32, shape=(), value=1} : i32[]
      %27 = sub(%10, %26) : i32[]
      yield %11, %9, %27
    end
  return %0
"""
    expected = """
graph @g(%x: f32[4], %w: f32[4], %n: i32[]) -> f32[4]
  %0 = tanh(%w) : f32[4]
  %1, %2, %3, %4 = while_loop(%x, %w, %n, %0) : f32[4], f32[4], i32[], f32[4]
    region(%5: f32[4], %6: f32[4], %7: i32[], %8: f32[4]):
      %9 = full() {dtype=i32, shape=(), value=0} : i32[]
      %10 = gt(%7, %9) : i1[]
      yield %10
    region(%11: f32[4], %12: f32[4], %13: i32[], %14: f32[4]):
      %15, %16, %17, %18 = while_loop(%11, %12, %13, %14) : f32[4], f32[4], i32[], f32[4]
        region(%19: f32[4], %20: f32[4], %21: i32[], %22: f32[4]):
          %23 = full() {dtype=i32, shape=(), value=0} : i32[]
          %24 = gt(%21, %23) : i1[]
          yield %24
        region(%25: f32[4], %26: f32[4], %27: i32[], %28: f32[4]):
          %29 = add(%25, %28) : f32[4]
          %30 = full() {dtype=i32, shape=(), value=1} : i32[]
          %31 = sub(%27, %30) : i32[]
          yield %29, %26, %31, %28
        end
      %32 = full() {dtype=i32, shape=(), value=1} : i32[]
      %33 = sub(%13, %32) : i32[]
      yield %15, %12, %33, %14
    end
  return %1
"""
    result = assert_rewrites(licm, before, expected)


def test_values_read_from_outside_become_operands():
    """CSE can make a branch read a value of the enclosing region: LICM makes it an
    explicit operand again, and recomputes an operand-free `full` inside instead."""
    before = """
graph @g(%x: f32[4], %p: i1[]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1 = full() {dtype=f32, shape=(4,), value=3.0} : f32[4]
  %2 = cond(%p, %x) : f32[4]
    region(%3: f32[4]):
      %4 = mul(%3, %0) : f32[4]
      yield %4
    region(%5: f32[4]):
      %6 = add(%5, %1) : f32[4]
      yield %6
    end
  return %2
"""
    expected = """
graph @g(%x: f32[4], %p: i1[]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1 = full() {dtype=f32, shape=(4,), value=3.0} : f32[4]
  %2 = cond(%p, %x, %0) : f32[4]
    region(%3: f32[4], %4: f32[4]):
      %5 = mul(%3, %4) : f32[4]
      yield %5
    region(%6: f32[4], %7: f32[4]):
      %8 = full() {dtype=f32, shape=(4,), value=3.0} : f32[4]
      %9 = add(%6, %8) : f32[4]
      yield %9
    end
  return %2
"""
    result = assert_rewrites(licm, before, expected)
    assert all(free_values(r) == [] for n in result.walk() for r in n.regions)


def test_a_captured_value_makes_its_users_invariant():
    """A loop body that reads %0 from outside gets it as a pass-through carried
    value, which makes log(%0) invariant, so it is hoisted as well."""
    before = """
graph @g(%x: f32[4], %n: i32[]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1, %2 = while_loop(%x, %n) : f32[4], i32[]
    region(%3: f32[4], %4: i32[]):
      %5 = full() {dtype=i32, shape=(), value=0} : i32[]
      %6 = gt(%4, %5) : i1[]
      yield %6
    region(%7: f32[4], %8: i32[]):
      %9 = log(%0) : f32[4]
      %10 = add(%7, %9) : f32[4]
      %11 = full() {dtype=i32, shape=(), value=1} : i32[]
      %12 = sub(%8, %11) : i32[]
      yield %10, %12
    end
  return %1
"""
    expected = """
graph @g(%x: f32[4], %n: i32[]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1 = log(%0) : f32[4]
  %2, %3, %4, %5 = while_loop(%x, %n, %0, %1) : f32[4], i32[], f32[4], f32[4]
    region(%6: f32[4], %7: i32[], %8: f32[4], %9: f32[4]):
      %10 = full() {dtype=i32, shape=(), value=0} : i32[]
      %11 = gt(%7, %10) : i1[]
      yield %11
    region(%12: f32[4], %13: i32[], %14: f32[4], %15: f32[4]):
      %16 = add(%12, %15) : f32[4]
      %17 = full() {dtype=i32, shape=(), value=1} : i32[]
      %18 = sub(%13, %17) : i32[]
      yield %16, %18, %14, %15
    end
  return %2
"""
    result = assert_rewrites(licm, before, expected)


def test_nothing_to_do_returns_the_graph_itself():
    graph, _ = example("mlp")
    assert licm(graph) is graph
    once = licm(example("while_loop")[0])
    assert licm(once) is once  # closed, and what is left inside varies or is cheap


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_keep_their_results(name):
    result = check_preserves(licm, name)
    assert all(free_values(r) == [] for n in result.walk() for r in n.regions)


def test_while_example_hoists_what_reads_the_outer_value():
    result = check_preserves(licm, "while_loop")
    (loop,) = [n for n in result.nodes if n.op == "while_loop"]
    # both exp(w) leave the loop; only the dead exp(p), for DCE, stays
    assert [n.op for n in loop.regions[1].nodes].count("exp") == 1
    assert [n.op for n in result.nodes].count("exp") == 1 + 2 + 1  # exp(neg x), the two, the last

