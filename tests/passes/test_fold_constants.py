"""fold_constants: before/expected pairs in text IR (with the folded data), then the
pass over real graphs (outputs bit-identical)."""

import numpy as np
import pytest

from kiln.ir.parser import parse_graph
from kiln.passes.dce import dce
from kiln.passes.fold_constants import MAX_FOLD_ELEMENTS, fold_constants
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves


def fold(graph):
    return dce(fold_constants(graph))


def test_uniform_result_becomes_a_full():
    assert_rewrites(fold, """
graph @g(%x: f32[2, 3]) -> f32[2, 3]
  %0 = full() {dtype=f32, shape=(2, 3), value=1.5} : f32[2, 3]
  %1 = full() {dtype=f32, shape=(2, 3), value=2} : f32[2, 3]
  %2 = mul(%0, %1) : f32[2, 3]
  %3 = exp(%2) : f32[2, 3]
  %4 = add(%x, %3) : f32[2, 3]
  return %4
""", f"""
graph @g(%x: f32[2, 3]) -> f32[2, 3]
  %0 = full() {{dtype=f32, shape=(2, 3), value={float(np.exp(np.float32(3.0)))!r}}} : f32[2, 3]
  %1 = add(%x, %0) : f32[2, 3]
  return %1
""")


def test_a_constant_made_here_lets_an_algebraic_pattern_apply():
    """The gradient of x ** 2 is 2 * x ** (2 - 1): the exponent folds to 1, then
    canonicalize's x ** 1 -> x applies (no pow left to run per element)."""
    assert_rewrites(fold, """
graph @g(%x: f32[2, 3]) -> f32[2, 3]
  %0 = full() {dtype=f32, shape=(2, 3), value=2} : f32[2, 3]
  %1 = full() {dtype=f32, shape=(2, 3), value=1} : f32[2, 3]
  %2 = sub(%0, %1) : f32[2, 3]
  %3 = pow(%x, %2) : f32[2, 3]
  %4 = mul(%3, %0) : f32[2, 3]
  return %4
""", """
graph @g(%x: f32[2, 3]) -> f32[2, 3]
  %0 = full() {dtype=f32, shape=(2, 3), value=2} : f32[2, 3]
  %1 = mul(%x, %0) : f32[2, 3]
  return %1
""")


def test_varying_result_becomes_a_constant():
    assert_rewrites(fold, """
graph @g(%x: i32[3]) -> i32[3]
  %0 = iota() {dimension=0, dtype=i32, shape=(3,)} : i32[3]
  %1 = full() {dtype=i32, shape=(3,), value=2} : i32[3]
  %2 = mul(%0, %1) : i32[3]
  %3 = add(%x, %2) : i32[3]
  return %3
""", """
graph @g(%x: i32[3]) -> i32[3]
  %0 = constant() {dtype=i32, name="k0", shape=(3,)} : i32[3]
  %1 = add(%x, %0) : i32[3]
  return %1
""", expected_constants={"k0": np.array([0, 2, 4], np.int32)})


def test_constants_fold_with_their_data_and_unused_data_goes():
    c = {"w": np.array([[1, 2], [3, 4]], np.float32)}
    result = assert_rewrites(fold, """
graph @g(%x: f32[2]) -> f32[2]
  %0 = constant() {dtype=f32, name="w", shape=(2, 2)} : f32[2, 2]
  %1 = reduce_sum(%0) {axes=(0,)} : f32[2]
  %2 = add(%x, %1) : f32[2]
  return %2
""", """
graph @g(%x: f32[2]) -> f32[2]
  %0 = constant() {dtype=f32, name="k1", shape=(2,)} : f32[2]
  %1 = add(%x, %0) : f32[2]
  return %1
""", constants=c, expected_constants={"k1": np.array([4, 6], np.float32)})
    assert "w" not in result.constants


def test_elementwise_ops_of_fills_fold_at_any_size_and_symbolic_shape():
    assert_rewrites(fold, """
graph @g(%x: i32[B, 4]) -> (i32[B, 4], f16[100000])
  where B in [1, 64]
  %0 = full() {dtype=i32, shape=(B, 4), value=3} : i32[B, 4]
  %1 = mul(%0, %0) : i32[B, 4]
  %2 = add(%x, %1) : i32[B, 4]
  %3 = full() {dtype=f32, shape=(100000,), value=0.1} : f32[100000]
  %4 = convert(%3) {dtype=f16} : f16[100000]
  return %2, %4
""", """
graph @g(%x: i32[B, 4]) -> (i32[B, 4], f16[100000])
  where B in [1, 64]
  %0 = full() {dtype=i32, shape=(B, 4), value=9} : i32[B, 4]
  %1 = add(%x, %0) : i32[B, 4]
  %2 = full() {dtype=f16, shape=(100000,), value=0.0999755859375} : f16[100000]
  return %1, %2
""")


def test_negative_zero_and_nan_survive_exactly():
    g = parse_graph("""
graph @g() -> (f32[2], f32[2])
  %0 = full() {dtype=f32, shape=(2,), value=0.0} : f32[2]
  %1 = neg(%0) : f32[2]
  %2 = full() {dtype=f32, shape=(2,), value=inf} : f32[2]
  %3 = sub(%2, %2) : f32[2]
  return %1, %3
""")
    text = str(fold(g))
    assert "value=-0.0" in text and "value=nan" in text
    neg_zero = fold(g).nodes[0]
    assert neg_zero.op == "full" and np.signbit(neg_zero.attrs["value"])


def test_what_does_not_fold():
    before = f"""
graph @g(%x: f32[4], %key: u32[2], %n: i32[]) -> (u32[4], f32[{MAX_FOLD_ELEMENTS + 1}], f32[4], f32[B], f32[2])
  where B in [1, 8]
  %0 = random_bits(%key) {{shape=(4,)}} : u32[4]
  %1 = iota() {{dimension=0, dtype=f32, shape=({MAX_FOLD_ELEMENTS + 1},)}} : f32[{MAX_FOLD_ELEMENTS + 1}]
  %2 = exp(%1) : f32[{MAX_FOLD_ELEMENTS + 1}]
  %3 = full() {{dtype=f32, shape=(4,), value=1.0}} : f32[4]
  %4 = add(%x, %3) : f32[4]
  %5 = iota() {{dimension=0, dtype=f32, shape=(B,)}} : f32[B]
  %6 = exp(%5) : f32[B]
  %7 = iota() {{dimension=0, dtype=i64, shape=(1,)}} : i64[1]
  %8 = full() {{dtype=i64, shape=(1,), value=7}} : i64[1]
  %9 = add(%7, %8) : i64[1]
  %10 = full() {{dtype=f32, shape=(3,), value=2.0}} : f32[3]
  %11 = take(%10, %9) {{axis=0}} : f32[1]
  %12 = concatenate(%11, %11) {{dimension=0}} : f32[2]
  return %0, %2, %4, %6, %12
"""
    g = parse_graph(before)
    out = fold_constants(g)
    ops = out.op_counts()
    # random bits of an input key, too many elements, a non-constant operand, a
    # symbolic shape (not a fill) and an out-of-range index (an error at run time) stay
    assert ops["random_bits"] == 1 and ops["exp"] == 2 and ops["add"] == 1
    assert ops["take"] == 1 and "constant" not in ops


def test_random_bits_with_a_constant_key_fold_exactly():
    key = {"key": np.array([1, 2], np.uint32)}
    g = parse_graph("""
graph @g() -> u32[5]
  %0 = constant() {dtype=u32, name="key", shape=(2,)} : u32[2]
  %1 = random_bits(%0) {shape=(5,)} : u32[5]
  return %1
""", constants=key)
    out = fold(g)
    assert out.op_counts() == {"constant": 1} and "key" not in out.constants
    from kiln.ir.interpret import run_graph
    np.testing.assert_array_equal(run_graph(out)[0], run_graph(g)[0])


def test_folds_inside_regions_but_never_control_flow():
    before = """
graph @g(%x: f32[2]) -> f32[2]
  %0 = full() {dtype=i1, shape=(), value=true} : i1[]
  %1 = full() {dtype=f32, shape=(2,), value=3.0} : f32[2]
  %2 = cond(%0, %1) : f32[2]
    region(%3: f32[2]):
      yield %3
    region(%4: f32[2]):
      %5 = full() {dtype=f32, shape=(2,), value=4.0} : f32[2]
      %6 = sqrt(%5) : f32[2]
      %7 = add(%4, %6) : f32[2]
      yield %7
    end
  %8 = add(%x, %2) : f32[2]
  return %8
"""
    expected = """
graph @g(%x: f32[2]) -> f32[2]
  %0 = full() {dtype=i1, shape=(), value=true} : i1[]
  %1 = full() {dtype=f32, shape=(2,), value=3.0} : f32[2]
  %2 = cond(%0, %1) : f32[2]
    region(%3: f32[2]):
      yield %3
    region(%4: f32[2]):
      %5 = full() {dtype=f32, shape=(2,), value=2.0} : f32[2]
      %6 = add(%4, %5) : f32[2]
      yield %6
    end
  %7 = add(%x, %2) : f32[2]
  return %7
"""
    assert_rewrites(fold, before, expected)


def test_nothing_to_fold_returns_the_same_graph():
    g = parse_graph("graph @g(%x: f32[3]) -> f32[3]\n  %0 = exp(%x) : f32[3]\n  return %0\n")
    assert fold_constants(g) is g


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_keep_their_results(name):
    check_preserves(fold_constants, name)


def test_a_reduction_folded_to_a_scalar_keeps_rank_zero():
    # np.ascontiguousarray turns a 0-d result into shape (1,): the folded value must not
    import kiln as kn
    from kiln.passes.fold_constants import fold_constants

    graph = kn.trace(lambda x: kn.full((3,), 1.0).sum() + x, kn.ones(()))
    folded = fold_constants(graph)
    assert "reduce_sum" not in str(folded)
    assert [str(v.type) for v in folded.outputs] == ["f32[]"]
