"""cse: before/expected pairs in text IR (scoping in regions included), then the pass
over real graphs (outputs bit-identical)."""

import numpy as np
import pytest

from kiln.ir.parser import parse_graph
from kiln.passes.cse import cse
from kiln.passes.dce import dce
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves


def merge(graph):
    return dce(cse(graph))


def test_repeats_merge_transitively():
    assert_rewrites(merge, """
graph @g(%x: f32[4], %y: f32[4]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1 = exp(%x) : f32[4]
  %2 = add(%0, %y) : f32[4]
  %3 = add(%1, %y) : f32[4]
  %4 = mul(%2, %3) : f32[4]
  return %4
""", """
graph @g(%x: f32[4], %y: f32[4]) -> f32[4]
  %0 = exp(%x) : f32[4]
  %1 = add(%0, %y) : f32[4]
  %2 = mul(%1, %1) : f32[4]
  return %2
""")


def test_commutative_ops_merge_in_either_order():
    assert_rewrites(merge, """
graph @g(%x: f32[4], %y: f32[4], %i: i32[4], %j: i32[4]) -> (f32[4], f32[4], i32[4], i32[4], f32[4], f32[4])
  %0 = mul(%x, %y) : f32[4]
  %1 = mul(%y, %x) : f32[4]
  %2 = max(%i, %j) : i32[4]
  %3 = max(%j, %i) : i32[4]
  %4 = max(%x, %y) : f32[4]
  %5 = max(%y, %x) : f32[4]
  return %0, %1, %2, %3, %4, %5
""", """
graph @g(%x: f32[4], %y: f32[4], %i: i32[4], %j: i32[4]) -> (f32[4], f32[4], i32[4], i32[4], f32[4], f32[4])
  %0 = mul(%x, %y) : f32[4]
  %1 = max(%i, %j) : i32[4]
  %2 = max(%x, %y) : f32[4]
  %3 = max(%y, %x) : f32[4]
  return %0, %0, %1, %1, %2, %3
""")


def test_attributes_types_and_operand_order_distinguish():
    text = """
graph @g(%x: f32[4], %y: f32[4]) -> (f32[4], f32[4], f32[4], f32[4], f32[4], f32[4])
  %0 = full() {dtype=f32, shape=(4,), value=1} : f32[4]
  %1 = full() {dtype=f32, shape=(4,), value=1.0} : f32[4]
  %2 = sub(%x, %y) : f32[4]
  %3 = sub(%y, %x) : f32[4]
  %4 = reverse(%x) {dims=(0,)} : f32[4]
  %5 = reverse(%x) {dims=()} : f32[4]
  return %0, %1, %2, %3, %4, %5
"""
    assert_rewrites(cse, text, text)


def test_equal_constant_data_merges_whatever_the_name():
    data = {"a": np.arange(3, dtype=np.float32), "b": np.arange(3, dtype=np.float32),
            "c": np.arange(3, dtype=np.int32)}
    result = assert_rewrites(merge, """
graph @g(%x: f32[3]) -> (f32[3], i32[3])
  %0 = constant() {dtype=f32, name="a", shape=(3,)} : f32[3]
  %1 = constant() {dtype=f32, name="b", shape=(3,)} : f32[3]
  %2 = constant() {dtype=i32, name="c", shape=(3,)} : i32[3]
  %3 = add(%x, %0) : f32[3]
  %4 = add(%3, %1) : f32[3]
  return %4, %2
""", """
graph @g(%x: f32[3]) -> (f32[3], i32[3])
  %0 = constant() {dtype=f32, name="a", shape=(3,)} : f32[3]
  %1 = constant() {dtype=i32, name="c", shape=(3,)} : i32[3]
  %2 = add(%x, %0) : f32[3]
  %3 = add(%2, %0) : f32[3]
  return %3, %1
""", constants=data)
    assert set(result.constants) == {"a", "c"}


def test_random_bits_merge_only_with_the_same_key():
    assert_rewrites(merge, """
graph @g(%k1: u32[2], %k2: u32[2]) -> (u32[3], u32[3], u32[3])
  %0 = random_bits(%k1) {shape=(3,)} : u32[3]
  %1 = random_bits(%k1) {shape=(3,)} : u32[3]
  %2 = random_bits(%k2) {shape=(3,)} : u32[3]
  return %0, %1, %2
""", """
graph @g(%k1: u32[2], %k2: u32[2]) -> (u32[3], u32[3], u32[3])
  %0 = random_bits(%k1) {shape=(3,)} : u32[3]
  %1 = random_bits(%k2) {shape=(3,)} : u32[3]
  return %0, %0, %1
""")


REGIONS_BEFORE = """
graph @g(%p: i1[], %x: f32[4]) -> (f32[4], f32[4])
  %0 = exp(%x) : f32[4]
  %1 = cond(%p, %x) : f32[4]
    region(%2: f32[4]):
      %3 = exp(%x) : f32[4]
      %4 = neg(%x) : f32[4]
      %5 = add(%3, %4) : f32[4]
      yield %5
    region(%6: f32[4]):
      %7 = neg(%x) : f32[4]
      %8 = neg(%x) : f32[4]
      %9 = add(%7, %8) : f32[4]
      yield %9
    end
  %10 = neg(%x) : f32[4]
  %11 = add(%1, %10) : f32[4]
  return %11, %0
"""

REGIONS_EXPECTED = """
graph @g(%p: i1[], %x: f32[4]) -> (f32[4], f32[4])
  %0 = exp(%x) : f32[4]
  %1 = cond(%p) : f32[4]
    region():
      %2 = neg(%x) : f32[4]
      %3 = add(%0, %2) : f32[4]
      yield %3
    region():
      %4 = neg(%x) : f32[4]
      %5 = add(%4, %4) : f32[4]
      yield %5
    end
  %6 = neg(%x) : f32[4]
  %7 = add(%1, %6) : f32[4]
  return %7, %0
"""


def test_regions_see_enclosing_values_but_not_siblings_or_the_reverse():
    # the outer exp reaches into the branch; the branch's neg reaches neither its
    # sibling branch nor the outer neg that follows the cond (dce then drops the
    # operand %x that no branch reads through its parameter)
    assert_rewrites(merge, REGIONS_BEFORE, REGIONS_EXPECTED)


def test_nodes_with_regions_never_merge():
    text = """
graph @g(%p: i1[], %x: f32[4]) -> (f32[4], f32[4])
  %0 = cond(%p, %x) : f32[4]
    region(%1: f32[4]):
      yield %1
    region(%2: f32[4]):
      yield %2
    end
  %3 = cond(%p, %x) : f32[4]
    region(%4: f32[4]):
      yield %4
    region(%5: f32[4]):
      yield %5
    end
  return %0, %3
"""
    g = parse_graph(text)
    assert cse(g) is g


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_keep_their_results(name):
    check_preserves(cse, name)
