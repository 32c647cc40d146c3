"""canonicalize: each pattern as a before/expected pair in text IR, then the pass over
real graphs (outputs bit-identical)."""

import pytest

from kiln.ir.parser import parse_graph
from kiln.ir import dtypes as dt
from kiln.passes.canonicalize import PATTERNS, canonicalize, holds_exactly
from kiln.passes.dce import dce
from tests.passes.examples import EXAMPLES, assert_rewrites, check_preserves


def simplify(graph):
    # rewrites leave the nodes they bypass behind; dce shows the net effect
    return dce(canonicalize(graph))


# graphs no pattern may change (before and expected alike)
RAMP_PAST_THE_DIM = """
graph @g(%x: f32[6, 4]) -> f32[8, 4]
  %0 = iota() {dimension=0, dtype=i64, shape=(8,)} : i64[8]
  %1 = take(%x, %0) {axis=0} : f32[8, 4]
  return %1
"""

WRAPPING_IOTA = """
graph @g(%x: f32[400, 2]) -> f32[300, 2]
  %0 = iota() {dimension=0, dtype=u8, shape=(300,)} : u8[300]
  %1 = take(%x, %0) {axis=0} : f32[300, 2]
  return %1
"""

SCATTERS_KEPT = """
graph @g(%x: f32[5, 4], %u: f32[3, 4]) -> (f32[5, 4], f32[5, 4], f32[5, 4], f32[5, 4])
  %0 = full() {dtype=f32, shape=(5, 4), value=-0.0} : f32[5, 4]
  %1 = iota() {dimension=0, dtype=i64, shape=(3, 4)} : i64[3, 4]
  %2 = scatter_along(%0, %1, %u) {axis=0, mode="add"} : f32[5, 4]
  %3 = scatter_along(%x, %1, %u) {axis=0, mode="add"} : f32[5, 4]
  %4 = full() {dtype=f32, shape=(5, 4), value=0.0} : f32[5, 4]
  %5 = scatter_along(%4, %1, %u) {axis=0, mode="set"} : f32[5, 4]
  %6 = iota() {dimension=1, dtype=i64, shape=(3, 4)} : i64[3, 4]
  %7 = scatter_along(%4, %6, %u) {axis=0, mode="add"} : f32[5, 4]
  return %2, %3, %5, %7
"""


CASES = {
    "int add zero": ("""
graph @g(%x: i32[4]) -> i32[4]
  %0 = full() {dtype=i32, shape=(4,), value=0} : i32[4]
  %1 = add(%0, %x) : i32[4]
  return %1
""", """
graph @g(%x: i32[4]) -> i32[4]
  return %x
"""),
    "float add +0.0 stays (-0.0 + 0.0 is +0.0)": ("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=0.0} : f32[4]
  %1 = add(%x, %0) : f32[4]
  return %1
""", """
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=0.0} : f32[4]
  %1 = add(%x, %0) : f32[4]
  return %1
"""),
    "float add -0.0": ("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=-0.0} : f32[4]
  %1 = add(%x, %0) : f32[4]
  return %1
""", """
graph @g(%x: f32[4]) -> f32[4]
  return %x
"""),
    "sub +0.0 and div 1": ("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=0} : f32[4]
  %1 = sub(%x, %0) : f32[4]
  %2 = full() {dtype=f32, shape=(4,), value=1.0} : f32[4]
  %3 = div(%1, %2) : f32[4]
  return %3
""", """
graph @g(%x: f32[4]) -> f32[4]
  return %x
"""),
    "mul one, commuted first": ("""
graph @g(%x: bf16[2, 3]) -> bf16[2, 3]
  %0 = full() {dtype=bf16, shape=(2, 3), value=1} : bf16[2, 3]
  %1 = mul(%0, %x) : bf16[2, 3]
  return %1
""", """
graph @g(%x: bf16[2, 3]) -> bf16[2, 3]
  return %x
"""),
    "int mul zero": ("""
graph @g(%x: i64[3]) -> i64[3]
  %0 = full() {dtype=i64, shape=(3,), value=0} : i64[3]
  %1 = mul(%x, %0) : i64[3]
  return %1
""", """
graph @g(%x: i64[3]) -> i64[3]
  %0 = full() {dtype=i64, shape=(3,), value=0} : i64[3]
  return %0
"""),
    "float mul zero stays (NaN * 0 is NaN)": ("""
graph @g(%x: f32[3]) -> f32[3]
  %0 = full() {dtype=f32, shape=(3,), value=0.0} : f32[3]
  %1 = mul(%x, %0) : f32[3]
  return %1
""", """
graph @g(%x: f32[3]) -> f32[3]
  %0 = full() {dtype=f32, shape=(3,), value=0.0} : f32[3]
  %1 = mul(%x, %0) : f32[3]
  return %1
"""),
    "wrapped int fill is zero": ("""
graph @g(%x: u8[3]) -> u8[3]
  %0 = full() {dtype=u8, shape=(3,), value=256} : u8[3]
  %1 = add(%x, %0) : u8[3]
  return %1
""", """
graph @g(%x: u8[3]) -> u8[3]
  return %x
"""),
    "constants move right (float max/min stay: +0.0 vs -0.0)": ("""
graph @g(%x: f32[3], %p: i1[3], %i: i32[3]) -> (f32[3], i1[3], f32[3], i32[3], f32[3])
  %0 = iota() {dimension=0, dtype=f32, shape=(3,)} : f32[3]
  %1 = mul(%0, %x) : f32[3]
  %2 = full() {dtype=i1, shape=(3,), value=true} : i1[3]
  %3 = xor(%2, %p) : i1[3]
  %4 = sub(%0, %x) : f32[3]
  %5 = iota() {dimension=0, dtype=i32, shape=(3,)} : i32[3]
  %6 = max(%5, %i) : i32[3]
  %7 = max(%0, %x) : f32[3]
  return %1, %3, %4, %6, %7
""", """
graph @g(%x: f32[3], %p: i1[3], %i: i32[3]) -> (f32[3], i1[3], f32[3], i32[3], f32[3])
  %0 = iota() {dimension=0, dtype=f32, shape=(3,)} : f32[3]
  %1 = mul(%x, %0) : f32[3]
  %2 = full() {dtype=i1, shape=(3,), value=true} : i1[3]
  %3 = xor(%p, %2) : i1[3]
  %4 = sub(%0, %x) : f32[3]
  %5 = iota() {dimension=0, dtype=i32, shape=(3,)} : i32[3]
  %6 = max(%i, %5) : i32[3]
  %7 = max(%0, %x) : f32[3]
  return %1, %3, %4, %6, %7
"""),
    "neg neg": ("""
graph @g(%x: i8[3]) -> i8[3]
  %0 = neg(%x) : i8[3]
  %1 = neg(%0) : i8[3]
  return %1
""", """
graph @g(%x: i8[3]) -> i8[3]
  return %x
"""),
    "convert to the same dtype": ("""
graph @g(%x: f16[3]) -> f16[3]
  %0 = convert(%x) {dtype=f16} : f16[3]
  return %0
""", """
graph @g(%x: f16[3]) -> f16[3]
  return %x
"""),
    "convert through a wider exact dtype": ("""
graph @g(%x: f16[3], %i: i8[3]) -> (f64[3], i8[3], f16[3])
  %0 = convert(%x) {dtype=f32} : f32[3]
  %1 = convert(%0) {dtype=f64} : f64[3]
  %2 = convert(%i) {dtype=f32} : f32[3]
  %3 = convert(%2) {dtype=i8} : i8[3]
  %4 = convert(%x) {dtype=bf16} : bf16[3]
  %5 = convert(%4) {dtype=f16} : f16[3]
  return %1, %3, %5
""", """
graph @g(%x: f16[3], %i: i8[3]) -> (f64[3], i8[3], f16[3])
  %0 = convert(%x) {dtype=f64} : f64[3]
  %1 = convert(%x) {dtype=bf16} : bf16[3]
  %2 = convert(%1) {dtype=f16} : f16[3]
  return %0, %i, %2
"""),
    "reshape chains and identity": ("""
graph @g(%x: f32[2, 6]) -> (f32[3, 4], f32[2, 6])
  %0 = reshape(%x) {shape=(12,)} : f32[12]
  %1 = reshape(%0) {shape=(3, 4)} : f32[3, 4]
  %2 = reshape(%x) {shape=(2, 6)} : f32[2, 6]
  return %1, %2
""", """
graph @g(%x: f32[2, 6]) -> (f32[3, 4], f32[2, 6])
  %0 = reshape(%x) {shape=(3, 4)} : f32[3, 4]
  return %0, %x
"""),
    "transposes compose, then vanish": ("""
graph @g(%x: f32[2, 3, 4]) -> (f32[4, 2, 3], f32[2, 3, 4])
  %0 = transpose(%x) {permutation=(1, 2, 0)} : f32[3, 4, 2]
  %1 = transpose(%0) {permutation=(1, 2, 0)} : f32[4, 2, 3]
  %2 = transpose(%1) {permutation=(1, 2, 0)} : f32[2, 3, 4]
  return %1, %2
""", """
graph @g(%x: f32[2, 3, 4]) -> (f32[4, 2, 3], f32[2, 3, 4])
  %0 = transpose(%x) {permutation=(2, 0, 1)} : f32[4, 2, 3]
  return %0, %x
"""),
    "broadcasts compose; same shape vanishes": ("""
graph @g(%x: f32[3]) -> (f32[2, 4, 3], f32[3])
  %0 = broadcast_in_dim(%x) {broadcast_dimensions=(1,), shape=(4, 3)} : f32[4, 3]
  %1 = broadcast_in_dim(%0) {broadcast_dimensions=(1, 2), shape=(2, 4, 3)} : f32[2, 4, 3]
  %2 = broadcast_in_dim(%x) {broadcast_dimensions=(0,), shape=(3,)} : f32[3]
  return %1, %2
""", """
graph @g(%x: f32[3]) -> (f32[2, 4, 3], f32[3])
  %0 = broadcast_in_dim(%x) {broadcast_dimensions=(2,), shape=(2, 4, 3)} : f32[2, 4, 3]
  return %0, %x
"""),
    "scalar full broadcast is a full": ("""
graph @g(%x: f32[2, 3]) -> f32[2, 3]
  %0 = full() {dtype=f32, shape=(), value=2.5} : f32[]
  %1 = broadcast_in_dim(%0) {broadcast_dimensions=(), shape=(2, 3)} : f32[2, 3]
  %2 = mul(%x, %1) : f32[2, 3]
  return %2
""", """
graph @g(%x: f32[2, 3]) -> f32[2, 3]
  %0 = full() {dtype=f32, shape=(2, 3), value=2.5} : f32[2, 3]
  %1 = mul(%x, %0) : f32[2, 3]
  return %1
"""),
    "select of one value, and on a constant predicate": ("""
graph @g(%p: i1[3], %x: f32[3], %y: f32[3]) -> (f32[3], f32[3])
  %0 = select(%p, %x, %x) : f32[3]
  %1 = full() {dtype=i1, shape=(3,), value=false} : i1[3]
  %2 = select(%1, %x, %y) : f32[3]
  return %0, %2
""", """
graph @g(%p: i1[3], %x: f32[3], %y: f32[3]) -> (f32[3], f32[3])
  return %x, %y
"""),
    "whole slice vanishes, a real slice stays": ("""
graph @g(%x: f32[4, 5]) -> (f32[4, 5], f32[2, 5])
  %0 = slice(%x) {limit=(4, 5), start=(0, 0), stride=(1, 1)} : f32[4, 5]
  %1 = slice(%0) {limit=(4, 5), start=(2, 0)} : f32[2, 5]
  return %0, %1
""", """
graph @g(%x: f32[4, 5]) -> (f32[4, 5], f32[2, 5])
  %0 = slice(%x) {limit=(4, 5), start=(2, 0)} : f32[2, 5]
  return %x, %0
"""),
    "reverses cancel dim by dim": ("""
graph @g(%x: f32[2, 3]) -> (f32[2, 3], f32[2, 3])
  %0 = reverse(%x) {dims=(0, 1)} : f32[2, 3]
  %1 = reverse(%0) {dims=(1,)} : f32[2, 3]
  %2 = reverse(%1) {dims=(0,)} : f32[2, 3]
  return %1, %2
""", """
graph @g(%x: f32[2, 3]) -> (f32[2, 3], f32[2, 3])
  %0 = reverse(%x) {dims=(0,)} : f32[2, 3]
  return %0, %x
"""),
    "symbolic shapes": ("""
graph @g(%x: f32[B, 4]) -> (f32[B, 4], f32[B, 4])
  where B in [1, 64]
  %0 = reshape(%x) {shape=(4*B,)} : f32[4*B]
  %1 = reshape(%0) {shape=(B, 4)} : f32[B, 4]
  %2 = slice(%x) {limit=(B, 4), start=(0, 0)} : f32[B, 4]
  return %1, %2
""", """
graph @g(%x: f32[B, 4]) -> (f32[B, 4], f32[B, 4])
  where B in [1, 64]
  return %x, %x
"""),
    "take of a ramp is a slice": ("""
graph @g(%x: f32[6, 4]) -> f32[3, 4]
  %0 = iota() {dimension=0, dtype=i64, shape=(3,)} : i64[3]
  %1 = take(%x, %0) {axis=0} : f32[3, 4]
  return %1
""", """
graph @g(%x: f32[6, 4]) -> f32[3, 4]
  %0 = slice(%x) {limit=(3, 4), start=(0, 0)} : f32[3, 4]
  return %0
"""),
    "take of a ramp past the dim stays (K104 when it runs)": (RAMP_PAST_THE_DIM, RAMP_PAST_THE_DIM),
    "a uint8 iota past 256 wraps: no ramp, the take stays": (WRAPPING_IOTA, WRAPPING_IOTA),
    "scatter-add of a ramp into +0.0 is an add of the padded updates": ("""
graph @g(%u: f32[3, 4]) -> f32[5, 4]
  %0 = full() {dtype=f32, shape=(5, 4), value=0.0} : f32[5, 4]
  %1 = iota() {dimension=0, dtype=i64, shape=(3,)} : i64[3]
  %2 = broadcast_in_dim(%1) {broadcast_dimensions=(0,), shape=(3, 4)} : i64[3, 4]
  %3 = scatter_along(%0, %2, %u) {axis=0, mode="add"} : f32[5, 4]
  return %3
""", """
graph @g(%u: f32[3, 4]) -> f32[5, 4]
  %0 = full() {dtype=f32, shape=(5, 4), value=0.0} : f32[5, 4]
  %1 = full() {dtype=f32, shape=(), value=0} : f32[]
  %2 = pad(%u, %1) {high=(2, 0), interior=(0, 0), low=(0, 0)} : f32[5, 4]
  %3 = add(%2, %0) : f32[5, 4]
  return %3
"""),
    "int scatter-add of a ramp along dim 1 is the updates": ("""
graph @g(%u: i32[4, 3]) -> i32[4, 3]
  %0 = full() {dtype=i32, shape=(4, 3), value=0} : i32[4, 3]
  %1 = iota() {dimension=1, dtype=i32, shape=(4, 3)} : i32[4, 3]
  %2 = scatter_along(%0, %1, %u) {axis=1, mode="add"} : i32[4, 3]
  return %2
""", """
graph @g(%u: i32[4, 3]) -> i32[4, 3]
  return %u
"""),
    "scatters that are not a ramp into +0.0 stay": (SCATTERS_KEPT, SCATTERS_KEPT),
    "float pow one": ("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=1} : f32[4]
  %1 = pow(%x, %0) : f32[4]
  return %1
""", """
graph @g(%x: f32[4]) -> f32[4]
  return %x
"""),
    "pow two stays": ("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=2} : f32[4]
  %1 = pow(%x, %0) : f32[4]
  return %1
""", """
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=2} : f32[4]
  %1 = pow(%x, %0) : f32[4]
  return %1
"""),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pattern(name):
    before, expected = CASES[name]
    assert_rewrites(simplify, before, expected)


def test_rewrites_inside_regions_and_keeps_bypassed_nodes_for_dce():
    before = """
graph @g(%x: f32[3], %n: i32[]) -> f32[3]
  %0, %1 = while_loop(%x, %n) : f32[3], i32[]
    region(%2: f32[3], %3: i32[]):
      %4 = full() {dtype=i32, shape=(), value=0} : i32[]
      %5 = gt(%3, %4) : i1[]
      yield %5
    region(%6: f32[3], %7: i32[]):
      %8 = full() {dtype=f32, shape=(3,), value=1.0} : f32[3]
      %9 = mul(%8, %6) : f32[3]
      %10 = neg(%9) : f32[3]
      %11 = neg(%10) : f32[3]
      %12 = full() {dtype=i32, shape=(), value=1} : i32[]
      %13 = sub(%7, %12) : i32[]
      yield %11, %13
    end
  return %0
"""
    expected = """
graph @g(%x: f32[3], %n: i32[]) -> f32[3]
  %0, %1 = while_loop(%x, %n) : f32[3], i32[]
    region(%2: f32[3], %3: i32[]):
      %4 = full() {dtype=i32, shape=(), value=0} : i32[]
      %5 = gt(%3, %4) : i1[]
      yield %5
    region(%6: f32[3], %7: i32[]):
      %8 = full() {dtype=f32, shape=(3,), value=1.0} : f32[3]
      %9 = neg(%6) : f32[3]
      %10 = full() {dtype=i32, shape=(), value=1} : i32[]
      %11 = sub(%7, %10) : i32[]
      yield %6, %11
    end
  return %0
"""
    assert_rewrites(canonicalize, before, expected)


def test_nothing_to_do_returns_the_same_graph():
    g = parse_graph("graph @g(%x: f32[3]) -> f32[3]\n  %0 = exp(%x) : f32[3]\n  return %0\n")
    assert canonicalize(g) is g


def test_exact_conversions():
    assert holds_exactly(dt.int16, dt.float32) and not holds_exactly(dt.int32, dt.float32)
    assert holds_exactly(dt.bool_, dt.float8_e5m2) and holds_exactly(dt.uint8, dt.int16)
    assert not holds_exactly(dt.int8, dt.uint32) and not holds_exactly(dt.float32, dt.int64)
    assert holds_exactly(dt.bfloat16, dt.float32) and not holds_exactly(dt.float16, dt.bfloat16)
    assert holds_exactly(dt.float8_e4m3fn, dt.float16) and holds_exactly(dt.float32, dt.complex64)


def test_every_pattern_has_a_docstring():
    for op, patterns in PATTERNS.items():
        for pattern in patterns:
            assert pattern.__doc__, f"{op}: {pattern.__name__}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_graphs_keep_their_results(name):
    check_preserves(canonicalize, name)


def test_ramp_rewrites_keep_every_bit():
    """take/scatter of a ramp rewritten, run against the graph as written: the same bits,
    -0.0, NaN and infinities in the operands included."""
    import numpy as np

    from kiln.ir.interpret import run_graph

    graph = parse_graph("""
graph @g(%x: f32[6, 4], %u: f32[5, 4]) -> (f32[3, 4], f32[6, 4])
  %0 = iota() {dimension=0, dtype=i64, shape=(3,)} : i64[3]
  %1 = take(%x, %0) {axis=0} : f32[3, 4]
  %2 = full() {dtype=f32, shape=(6, 4), value=0.0} : f32[6, 4]
  %3 = broadcast_in_dim(%0) {broadcast_dimensions=(0,), shape=(3, 4)} : i64[3, 4]
  %4 = scatter_along(%2, %3, %u) {axis=0, mode="add"} : f32[6, 4]
  return %1, %4
""")
    result = simplify(graph)
    assert "take" not in str(result) and "scatter_along" not in str(result)
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    u = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    x[0, :3] = u[0, :3] = [-0.0, np.nan, np.inf]
    u[1, :2] = [-np.inf, 1e-45]
    for want, got in zip(run_graph(graph, x, u), run_graph(result, x, u)):
        assert want.tobytes() == got.tobytes()
