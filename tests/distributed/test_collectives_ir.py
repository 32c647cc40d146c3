"""Collectives in the IR: type rules and their errors, single-process reference
semantics, sharding rules, the scheduling pass (before / expected), `kiln dump
--stage scheduled`, and a kn.compile'd step on two real ranks."""

import subprocess
import sys

import numpy as np
import pytest

import kiln as kn
from kiln.distributed import CollectiveArgumentError
from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.ops.collective import Sharding
from kiln.ir.parser import parse_graph
from kiln.ir.types import TensorType
from kiln.passes.fold_constants import fold_constants
from kiln.passes.fusion import fuse
from kiln.passes.schedule_collectives import schedule_collectives

from harness import REPO, check_all_ok, run_scenario

C = kn.collectives
F32 = TensorType(dt.float32, (8, 6))
W2 = {"group": "world", "world_size": 2}


def infer(op, t, **attrs):
    opdef = registry.get(op)
    return opdef.infer([t], opdef.normalize_attrs(attrs))[0]


# -- type rules -----------------------------------------------------------------------
@pytest.mark.parametrize("op, attrs, shape", [
    ("all_reduce", {"reduce_op": "avg"}, (8, 6)),
    ("all_gather", {"axis": 1}, (8, 12)),
    ("all_gather", {"axis": -2}, (16, 6)),
    ("reduce_scatter", {"axis": 0, "reduce_op": "max"}, (4, 6)),
    ("broadcast", {"src": 1}, (8, 6)),
    ("all_to_all", {"split_axis": 0, "concat_axis": 1}, (4, 12)),
    ("all_to_all", {"split_axis": 1, "concat_axis": 1}, (8, 6)),
    ("all_reduce_start", {}, (8, 6)),
    ("all_gather_start", {"axis": 0}, (16, 6)),
])
def test_type_rules(op, attrs, shape):
    assert infer(op, F32, **attrs, **W2) == F32.with_shape(shape)


def test_wait_is_the_identity_on_types():
    assert infer("collective_wait", F32) == F32


@pytest.mark.parametrize("op, t, attrs, error, fragments", [
    ("reduce_scatter", TensorType(dt.float32, (5, 6)), {"axis": 0}, KilnShapeError,
     ["reduce_scatter", "f32[5, 6]", "group size 2 does not divide"]),
    ("all_to_all", TensorType(dt.float32, (8, 3)), {"split_axis": 1}, KilnShapeError,
     ["all_to_all", "f32[8, 3]", "does not divide"]),
    ("all_reduce", TensorType(dt.int32, (4,)), {"reduce_op": "avg"}, KilnDTypeError,
     ["all_reduce", "i32[4]", "op='avg'"]),
    ("all_reduce", TensorType(dt.complex64, (4,)), {"reduce_op": "max"}, KilnDTypeError,
     ["all_reduce", "no order"]),
    ("all_reduce", F32, {"reduce_op": "mean"}, KilnArgumentError, ["all_reduce", "'mean'"]),
    ("broadcast", F32, {"src": 2}, KilnArgumentError, ["broadcast", "src=2", "f32[8, 6]"]),
    ("all_gather", TensorType(dt.float32, ()), {}, KilnShapeError, ["all_gather", "scalar"]),
    ("all_gather", F32, {"axis": 2}, KilnArgumentError, ["all_gather", "out of range"]),
])
def test_type_errors_name_op_operand_and_rule(op, t, attrs, error, fragments):
    with pytest.raises(error) as info:
        infer(op, t, **attrs, **W2)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("attrs, fragment", [
    ({"group": "", "world_size": 2}, "group name"),
    ({"group": "world", "world_size": 0}, "positive int"),
])
def test_group_attributes_are_checked(attrs, fragment):
    with pytest.raises(KilnArgumentError, match=fragment):
        infer("all_reduce", F32, **attrs)


# -- reference semantics: rank 0 of a world whose ranks all hold this operand -----------
@pytest.mark.parametrize("op, attrs", [
    ("all_reduce", {"reduce_op": "sum"}), ("all_reduce", {"reduce_op": "prod"}),
    ("all_gather", {"axis": 1}), ("reduce_scatter", {"axis": 0}), ("broadcast", {}),
    ("all_to_all", {"split_axis": 0, "concat_axis": 1}),
])
def test_world_of_one_is_the_identity(op, attrs):
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    (out,) = EAGER.apply(op, [x], dict(attrs, group="world", world_size=1))
    np.testing.assert_array_equal(out, x)


def test_replicated_reference_for_larger_worlds():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    w3 = {"group": "world", "world_size": 3}

    def run(op, **attrs):
        return EAGER.apply(op, [x], dict(attrs, **w3))[0]

    np.testing.assert_array_equal(run("all_reduce", reduce_op="sum"), 3 * x)
    np.testing.assert_array_equal(run("all_reduce", reduce_op="avg"), x)
    np.testing.assert_array_equal(run("all_reduce", reduce_op="prod"), x ** 3)
    np.testing.assert_array_equal(run("all_gather", axis=1), np.tile(x, (1, 3)))
    np.testing.assert_array_equal(run("reduce_scatter", axis=1), 3 * x[:, :1])
    np.testing.assert_array_equal(run("all_to_all", split_axis=1, concat_axis=0),
                                  np.tile(x[:, :1], (3, 1)))
    bf16 = EAGER.apply("all_reduce", [x.astype(dt.bfloat16.np_dtype)], dict(w3, reduce_op="sum"))
    assert bf16[0].dtype == dt.bfloat16.np_dtype


# -- sharding rules --------------------------------------------------------------------
def test_sharding_rules():
    def rule(op, s, **attrs):
        opdef = registry.get(op)
        return opdef.sharding(op, s, **opdef.normalize_attrs(dict(attrs, **W2)))

    assert rule("all_gather", Sharding(("world", None)), axis=0) == Sharding((None, None))
    assert rule("all_reduce", Sharding((None, None), ("sum", "world"))) == Sharding((None, None))
    assert rule("reduce_scatter", Sharding((None, None), ("sum", "world")), axis=1) == \
        Sharding((None, "world"))
    assert rule("all_to_all", Sharding((None, "world")), split_axis=0, concat_axis=1) == \
        Sharding(("world", None))
    assert registry.get("collective_wait").sharding("collective_wait", Sharding(("world",))) \
        == Sharding(("world",))
    with pytest.raises(KilnArgumentError, match="partial sum"):
        rule("all_reduce", Sharding((None,), ("sum", "world")), reduce_op="max")
    with pytest.raises(KilnArgumentError, match="sharded over group 'world'"):
        rule("all_reduce", Sharding(("world", None)))


# -- eager and compiled, one process ----------------------------------------------------
def test_eager_without_a_process_group_is_a_world_of_one():
    x = kn.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert C.group_attrs() == {"group": "world", "world_size": 1}
    for out in (C.all_reduce(x, op="max"), C.all_gather(x, dim=1), C.broadcast(x),
                C.reduce_scatter(x, dim=0), C.all_to_all(x, split_dim=1, concat_dim=0)):
        np.testing.assert_array_equal(out.numpy(), x.numpy())
    with pytest.raises(KilnArgumentError, match="no live process group named 'tp'"):
        C.all_reduce(x, group="tp")
    with pytest.raises(KilnDTypeError, match="op='avg'"):
        C.all_reduce(kn.tensor([1, 2]), op="avg")


def test_compiled_program_runs_collective_steps():
    def f(x, w):
        return C.all_reduce(x * 2.0) + kn.tanh(x @ w)

    x = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    compiled = kn.compile(f)
    np.testing.assert_allclose(compiled(x, x).numpy(), 2 * x + np.tanh(x @ x), rtol=1e-5,
                               atol=1e-6)
    listing = compiled.compiled_graphs()[0].program.format()
    assert "collective all_reduce_start" in listing and "collective collective_wait" in listing


def test_a_program_for_two_ranks_needs_a_process_group():
    graph = parse_graph("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = all_reduce(%x) {group="world", reduce_op="sum", world_size=2} : f32[4]
  return %0
""")
    from kiln.frontend.compile import compile_graph

    compiled = compile_graph(graph)
    with pytest.raises(CollectiveArgumentError, match="no process group is initialized"):
        compiled.run([np.ones(4, np.float32)])


def test_collectives_are_not_folded_and_not_fused():
    graph = parse_graph("""
graph @g(%x: f32[4]) -> f32[4]
  %0 = full() {dtype=f32, shape=(4,), value=1} : f32[4]
  %1 = all_reduce(%0) {group="world", reduce_op="sum", world_size=2} : f32[4]
  %2 = exp(%x) : f32[4]
  %3 = add(%1, %2) : f32[4]
  return %3
""")
    assert fold_constants(graph) is graph  # the value depends on the other ranks
    fused = fuse(graph)
    assert [n.op for n in fused.nodes] == ["fused", "all_reduce", "fused"]  # a boundary


# -- the scheduling pass -----------------------------------------------------------------
def assert_schedules(before: str, expected: str):
    graph = parse_graph(before)
    text = str(graph)
    result = schedule_collectives(graph)
    assert str(graph) == text, "the pass changed its input"
    assert str(result) == str(parse_graph(expected))


def test_starts_early_waits_late():
    # the all_gather's producer (neg) runs first; exp and tanh overlap both collectives
    assert_schedules("""
graph @g(%x: f32[8], %w: f32[8]) -> (f32[8], f32[16], f32[8])
  %0 = exp(%w) : f32[8]
  %1 = all_reduce(%x) {group="world", reduce_op="sum", world_size=2} : f32[8]
  %2 = neg(%w) : f32[8]
  %3 = add(%1, %0) : f32[8]
  %4 = all_gather(%2) {axis=0, group="world", world_size=2} : f32[16]
  %5 = tanh(%0) : f32[8]
  return %3, %4, %5
""", """
graph @g(%x: f32[8], %w: f32[8]) -> (f32[8], f32[16], f32[8])
  %0 = all_reduce_start(%x) {group="world", reduce_op="sum", world_size=2} : f32[8]
  %1 = neg(%w) : f32[8]
  %2 = all_gather_start(%1) {axis=0, group="world", world_size=2} : f32[16]
  %3 = exp(%w) : f32[8]
  %4 = tanh(%3) : f32[8]
  %5 = collective_wait(%0) : f32[8]
  %6 = add(%5, %3) : f32[8]
  %7 = collective_wait(%2) : f32[16]
  return %6, %7, %4
""")


def test_dependent_collectives_keep_their_order():
    # the max all_reduce could go first, but starts keep program order on every rank
    assert_schedules("""
graph @g(%x: f32[4], %y: f32[4]) -> (f32[4], f32[4], f32[4])
  %0 = all_reduce(%x) {group="world", reduce_op="sum", world_size=2} : f32[4]
  %1 = broadcast(%0) {group="world", src=0, world_size=2} : f32[4]
  %2 = exp(%y) : f32[4]
  %3 = all_reduce(%y) {group="world", reduce_op="max", world_size=2} : f32[4]
  return %1, %2, %3
""", """
graph @g(%x: f32[4], %y: f32[4]) -> (f32[4], f32[4], f32[4])
  %0 = all_reduce_start(%x) {group="world", reduce_op="sum", world_size=2} : f32[4]
  %1 = exp(%y) : f32[4]
  %2 = collective_wait(%0) : f32[4]
  %3 = broadcast_start(%2) {group="world", src=0, world_size=2} : f32[4]
  %4 = all_reduce_start(%y) {group="world", reduce_op="max", world_size=2} : f32[4]
  %5 = collective_wait(%3) : f32[4]
  %6 = collective_wait(%4) : f32[4]
  return %5, %1, %6
""")


def test_graph_without_collectives_is_returned_as_is():
    graph = parse_graph("graph @g(%x: f32[4]) -> f32[4]\n  %0 = exp(%x) : f32[4]\n  return %0\n")
    assert schedule_collectives(graph) is graph


def test_kiln_dump_stage_scheduled(tmp_path):
    def f(x, w):
        return C.all_reduce(x * 2.0) + kn.tanh(x @ w)

    x = np.ones((4, 4), np.float32)
    path = tmp_path / "step.kir"
    kn.export(f, (x, x)).save(path)
    out = subprocess.run([sys.executable, "-m", "kiln", "dump", str(path), "--stage", "scheduled"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    start = next(i for i, line in enumerate(lines) if "all_reduce_start(" in line)
    wait = next(i for i, line in enumerate(lines) if "collective_wait(" in line)
    assert start < wait and 'group="world"' in lines[start]


# -- two ranks ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_compiled_step_on_two_ranks(tmp_path):
    data = check_all_ok(run_scenario("compiled_collectives", 2, tmp_path, timeout=55))
    for rank_data in data:
        assert "collective all_reduce_start" in rank_data["program"]
        ops = rank_data["collectives"]
        # compiled twice and eager once: five collectives each, in program order
        assert ops[:5] == ["all_reduce", "all_gather", "reduce_scatter", "broadcast",
                           "all_to_all"] and ops[:15] == ops[:5] * 3
