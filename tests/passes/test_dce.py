"""dce: before/expected pairs in text IR (regions and constants included), then the
pass over real graphs (outputs bit-identical)."""

import numpy as np
import pytest

from kiln.ir.parser import parse_graph
from kiln.passes.dce import dce, live_nodes
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves


def test_unused_chains_go():
    assert_rewrites(dce, """
graph @g(%x: f32[4]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1 = log(%0) : f32[4]
  %2 = neg(%x) : f32[4]
  %3, %4 = sort(%x) {axis=0, descending=false} : f32[4], i64[4]
  return %2
""", """
graph @g(%x: f32[4]) -> f32[4]
  %0 = neg(%x) : f32[4]
  return %0
""")


def test_a_node_stays_when_any_of_its_results_is_used():
    text = """
graph @g(%x: f32[4]) -> i64[4]
  %0, %1 = sort(%x) {axis=0, descending=false} : f32[4], i64[4]
  return %1
"""
    g = parse_graph(text)
    assert dce(g) is g


def test_inside_regions_and_through_outer_values():
    assert_rewrites(dce, """
graph @g(%x: f32[3], %n: i32[]) -> f32[3]
  %0 = exp(%x) : f32[3]
  %1 = log(%x) : f32[3]
  %2, %3 = while_loop(%x, %n) : f32[3], i32[]
    region(%4: f32[3], %5: i32[]):
      %6 = full() {dtype=i32, shape=(), value=0} : i32[]
      %7 = gt(%5, %6) : i1[]
      %8 = neg(%4) : f32[3]
      yield %7
    region(%9: f32[3], %10: i32[]):
      %11 = add(%9, %0) : f32[3]
      %12 = mul(%9, %1) : f32[3]
      %13 = full() {dtype=i32, shape=(), value=1} : i32[]
      %14 = sub(%10, %13) : i32[]
      yield %11, %14
    end
  return %2
""", """
graph @g(%x: f32[3], %n: i32[]) -> f32[3]
  %0 = exp(%x) : f32[3]
  %1, %2 = while_loop(%x, %n) : f32[3], i32[]
    region(%3: f32[3], %4: i32[]):
      %5 = full() {dtype=i32, shape=(), value=0} : i32[]
      %6 = gt(%4, %5) : i1[]
      yield %6
    region(%7: f32[3], %8: i32[]):
      %9 = add(%7, %0) : f32[3]
      %10 = full() {dtype=i32, shape=(), value=1} : i32[]
      %11 = sub(%8, %10) : i32[]
      yield %9, %11
    end
  return %1
""")


def test_an_unused_loop_goes_whole():
    assert_rewrites(dce, """
graph @g(%x: f32[3], %n: i32[]) -> f32[3]
  %0, %1 = while_loop(%x, %n) : f32[3], i32[]
    region(%2: f32[3], %3: i32[]):
      %4 = full() {dtype=i32, shape=(), value=0} : i32[]
      %5 = gt(%3, %4) : i1[]
      yield %5
    region(%6: f32[3], %7: i32[]):
      yield %6, %7
    end
  return %x
""", """
graph @g(%x: f32[3], %n: i32[]) -> f32[3]
  return %x
""")


def test_unused_cond_results_and_operands_are_trimmed():
    assert_rewrites(dce, """
graph @g(%p: i1[], %x: f32[3], %y: f32[3]) -> f32[3]
  %0, %1 = cond(%p, %x, %y) : f32[3], f32[3]
    region(%2: f32[3], %3: f32[3]):
      %4 = exp(%3) : f32[3]
      yield %2, %4
    region(%5: f32[3], %6: f32[3]):
      %7 = neg(%5) : f32[3]
      yield %7, %6
    end
  return %0
""", """
graph @g(%p: i1[], %x: f32[3], %y: f32[3]) -> f32[3]
  %0 = cond(%p, %x) : f32[3]
    region(%1: f32[3]):
      yield %1
    region(%2: f32[3]):
      %3 = neg(%2) : f32[3]
      yield %3
    end
  return %0
""")


def test_loop_carried_values_nothing_needs_are_dropped():
    # %acc (index 2) is only read to update itself and its result is unused; %x (0) is
    # unused outside too but feeds %y (1), which is returned; %n (3) drives the condition
    assert_rewrites(dce, """
graph @g(%x: f32[3], %y: f32[3], %acc: f32[3], %n: i32[]) -> f32[3]
  %0, %1, %2, %3 = while_loop(%x, %y, %acc, %n) : f32[3], f32[3], f32[3], i32[]
    region(%4: f32[3], %5: f32[3], %6: f32[3], %7: i32[]):
      %8 = full() {dtype=i32, shape=(), value=0} : i32[]
      %9 = gt(%7, %8) : i1[]
      yield %9
    region(%10: f32[3], %11: f32[3], %12: f32[3], %13: i32[]):
      %14 = add(%11, %10) : f32[3]
      %15 = mul(%12, %12) : f32[3]
      %16 = full() {dtype=i32, shape=(), value=1} : i32[]
      %17 = sub(%13, %16) : i32[]
      yield %10, %14, %15, %17
    end
  return %1
""", """
graph @g(%x: f32[3], %y: f32[3], %acc: f32[3], %n: i32[]) -> f32[3]
  %0, %1, %2 = while_loop(%x, %y, %n) : f32[3], f32[3], i32[]
    region(%3: f32[3], %4: f32[3], %5: i32[]):
      %6 = full() {dtype=i32, shape=(), value=0} : i32[]
      %7 = gt(%5, %6) : i1[]
      yield %7
    region(%8: f32[3], %9: f32[3], %10: i32[]):
      %11 = add(%9, %8) : f32[3]
      %12 = full() {dtype=i32, shape=(), value=1} : i32[]
      %13 = sub(%10, %12) : i32[]
      yield %8, %11, %13
    end
  return %1
""")


def test_unused_constants_are_dropped_from_the_graph():
    data = {"used": np.ones(2, np.float32), "dead": np.zeros(2, np.float32),
            "orphan": np.zeros(5, np.int8)}
    result = assert_rewrites(dce, """
graph @g(%x: f32[2]) -> f32[2]
  %0 = constant() {dtype=f32, name="used", shape=(2,)} : f32[2]
  %1 = constant() {dtype=f32, name="dead", shape=(2,)} : f32[2]
  %2 = add(%x, %0) : f32[2]
  return %2
""", """
graph @g(%x: f32[2]) -> f32[2]
  %0 = constant() {dtype=f32, name="used", shape=(2,)} : f32[2]
  %1 = add(%x, %0) : f32[2]
  return %1
""", constants=data, expected_constants={"used": data["used"]})
    assert set(result.constants) == {"used"}


def test_live_nodes_reach_through_regions():
    g = parse_graph("""
graph @g(%p: i1[], %x: f32[2]) -> f32[2]
  %0 = exp(%x) : f32[2]
  %1 = cond(%p, %x) : f32[2]
    region(%2: f32[2]):
      yield %0
    region(%3: f32[2]):
      yield %3
    end
  return %1
""")
    assert {n.op for n in live_nodes(g)} == {"exp", "cond"}
    assert dce(g) is g


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_keep_their_results(name):
    check_preserves(dce, name)
