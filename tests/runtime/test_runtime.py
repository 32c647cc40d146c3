"""The runtime: the memory plan (which buffers share storage), views, extern steps, the
allocator's accounting and limit, and the executor's arena reuse and fresh outputs."""

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.compile import compile_graph
from kiln.ir import dtypes as dt
from kiln.runtime.allocator import Allocator, KilnMemoryError
from kiln.runtime.executor import Executable
from kiln.runtime.memory_plan import plan_memory
from kiln.runtime.program import BufferSpec, Extern, Launch, Program, View

F32 = BufferSpec(dt.float32, (4, 3))


def program(steps, n_slots, inputs=(0,), outputs=None, spec=F32):
    outputs = [n_slots - 1] if outputs is None else list(outputs)
    return plan_memory(Program("p", list(inputs), outputs, {s: spec for s in range(n_slots)},
                               list(steps), {}))


def overlaps(p, a, b):
    """Do slots a and b have overlapping lifetimes in program p (by step indices)?"""
    def span(s):
        used = [i for i, st in enumerate(p.steps)
                if s in getattr(st, "args", ()) or s in getattr(st, "inputs", ())
                or s in getattr(st, "outputs", ()) or s in (getattr(st, "source", None), getattr(st, "target", None))]
        return min(used), max(used)
    (a0, a1), (b0, b1) = span(a), span(b)
    return not (a1 < b0 or b1 < a0)


# -- the memory plan ----------------------------------------------------------------------

def test_disjoint_lifetimes_share_storage_and_overlapping_never_do():
    # 0 -> 1 -> 2 -> 3 -> 4 -> 5 (output): each intermediate lives two steps
    p = program([Launch("k", (0, 1)), Launch("k", (1, 2)), Launch("k", (2, 3)),
                 Launch("k", (3, 4)), Launch("k", (4, 5))], 6)
    assert set(p.storage) == {1, 2, 3, 4}  # input 0 and output 5 own no arena storage
    assert p.storage[1] == p.storage[3] and p.storage[2] == p.storage[4]
    assert p.storage[1] != p.storage[2]
    assert len(set(p.storage.values())) == 2
    for a in p.storage:
        for b in p.storage:
            if a != b and overlaps(p, a, b):
                assert p.storage[a] != p.storage[b], (a, b)


def test_buffers_of_other_dtype_or_size_never_share():
    specs = {0: F32, 1: F32, 2: BufferSpec(dt.float64, (4, 3)), 3: BufferSpec(dt.float32, (5,)), 4: F32}
    p = plan_memory(Program("p", [0], [4], specs, [
        Launch("k", (0, 1)), Launch("k", (1, 2)), Launch("k", (2, 3)), Launch("k", (3, 4))], {}))
    assert len({p.storage[1], p.storage[2], p.storage[3]}) == 3


def test_a_view_keeps_the_memory_it_shows_alive():
    # %2 views %1; %3 is made after %1's last direct use but while the view is still read
    p = program([Launch("k", (0, 1)), View(1, 2), Launch("k", (0, 3)), Launch("k", (2, 3, 4))], 5)
    assert 2 not in p.storage  # a view owns no storage
    assert p.storage[1] != p.storage[3]


def test_inputs_and_outputs_are_never_planned_even_through_views():
    p = program([Launch("k", (0, 1)), View(1, 2), Launch("k", (0, 3))], 4, outputs=(2, 3))
    assert not set(p.storage) & {0, 1, 2, 3}


def test_compiled_program_plan_and_listing():
    # exp(x) feeds two reductions over different axes: one materialized intermediate
    graph = kn.trace(lambda x: (kn.exp(x).sum(0), (kn.exp(x) * 2).sum(1), kn.tanh(x).sum(1)),
                     kn.randn(3, 4, seed=0))
    compiled = compile_graph(graph, "reference")
    prog = compiled.program
    assert not set(prog.storage) & (set(prog.inputs) | set(prog.outputs))
    for a in prog.storage:
        for b in prog.storage:
            if a != b and prog.storage[a] == prog.storage[b]:
                assert not overlaps(prog, a, b)
    listing = prog.format()
    assert listing.startswith("program @main(%0: f32[3, 4])") and "storage:" in listing


# -- executing: views, externs, fresh outputs, arena reuse ---------------------------------

def _chain_executable(allocator):
    """x -> exp -> +1 -> *2 (as reshaped view) -> output: python kernels over a real plan."""
    p = plan_memory(Program(
        "chain", [0], [5], {0: F32, 1: F32, 2: F32, 3: BufferSpec(dt.float32, (12,)),
                           4: BufferSpec(dt.float32, (12,)), 5: BufferSpec(dt.float32, (3, 4))},
        [Launch("exp", (0, 1)), Launch("inc", (1, 2)), View(2, 3), Launch("dbl", (3, 4)), View(4, 5)], {}))
    kernels = {"exp": lambda a, s: np.exp(a[0], out=a[1]), "inc": lambda a, s: np.add(a[0], 1, out=a[1]),
               "dbl": lambda a, s: np.multiply(a[0], 2, out=a[1])}
    return Executable(p, kernels, allocator)


def test_executor_runs_views_and_returns_fresh_outputs():
    allocator = Allocator()
    ex = _chain_executable(allocator)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    want = ((np.exp(x) + 1) * 2).reshape(3, 4)
    (first,) = ex.run([x], {})
    np.testing.assert_allclose(first, want, rtol=1e-6)
    snapshot = first.copy()
    (second,) = ex.run([x * 2], {})
    np.testing.assert_allclose(first, snapshot)  # a later call never writes into an earlier output
    assert not np.shares_memory(first, second)
    first[...] = -1
    (third,) = ex.run([x], {})
    np.testing.assert_allclose(third, want, rtol=1e-6)


def test_executor_reuses_its_arena_across_calls():
    allocator = Allocator()
    ex = _chain_executable(allocator)
    x = np.ones((4, 3), np.float32)
    ex.run([x], {})
    after_first = allocator.stats()["allocations"]
    for _ in range(3):
        ex.run([x], {})
    per_call = (allocator.stats()["allocations"] - after_first) / 3
    # later calls allocate only what they hand back (the output); the first also the arena
    assert per_call <= 2 and after_first > per_call
    assert allocator.stats()["arena_bytes"] > 0


def test_extern_steps_run_the_reference_op():
    graph = kn.trace(lambda x, i: (kn.sort(x, dim=-1)[0] * 2, kn.gather(x, 1, i) + 1),
                     kn.randn(3, 4, seed=1), kn.tensor(np.array([[0, 3], [1, 1], [2, 0]])))
    compiled = compile_graph(graph, "reference")
    assert {s.op for s in compiled.program.steps if isinstance(s, Extern)} >= {"sort"}
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    i = np.array([[0, 3], [1, 1], [2, 0]])
    got = compiled.run([x, i])
    np.testing.assert_allclose(got[0], np.sort(x, axis=-1) * 2)
    np.testing.assert_allclose(got[1], np.take_along_axis(x, i, 1) + 1)


def test_outputs_never_alias_inputs_or_constants():
    graph = kn.trace(lambda x: (x, x.reshape(-1), kn.tensor([1.0, 2.0]) + 0), kn.randn(2, 3, seed=2))
    compiled = compile_graph(graph, "reference")
    x = np.ones((2, 3), np.float32)
    a, b, c = compiled.run([x])
    assert not np.shares_memory(a, x) and not np.shares_memory(b, x)
    c2 = compiled.run([x])[2]
    assert not np.shares_memory(c, c2)
    c[...] = 0
    np.testing.assert_array_equal(compiled.run([x])[2], [1.0, 2.0])


# -- the allocator ------------------------------------------------------------------------

def test_allocator_tracks_current_and_peak_bytes():
    a = Allocator()
    arena = a.empty((100,), np.float32, persistent=True)
    assert a.stats()["current_bytes"] == 400 and a.stats()["peak_bytes"] == 400
    out = a.empty((50,), np.float64)  # both held: two fresh buffers (a dropped one is reused)
    assert a.stats()["current_bytes"] == 800 and a.stats()["peak_bytes"] == 800
    a.end_call(400)  # the call's outputs are now the caller's
    assert a.stats()["current_bytes"] == 400 and a.stats()["peak_bytes"] == 800
    a.reset_peak()
    assert a.stats()["peak_bytes"] == 400
    a.release_persistent(400)
    assert a.stats()["current_bytes"] == 0
    assert a.stats()["allocations"] == 2
    del arena, out
    a.empty((100,), np.float32)  # served by memory a dropped buffer gave back: not counted
    assert a.stats()["allocations"] == 2


def test_memory_fraction_limit_raises_K170():
    a = Allocator(memory_fraction=1e-9)  # a few bytes of physical memory
    with pytest.raises(KilnMemoryError) as info:
        a.empty((1 << 20,), np.float32)
    assert str(info.value).startswith("[K170]") and "set_memory_fraction" in str(info.value)
    assert a.stats()["current_bytes"] == 0  # a refused allocation is not counted


def test_compiled_call_peak_memory_counts_its_buffers():
    allocator = Allocator()
    ex = _chain_executable(allocator)
    ex.run([np.ones((4, 3), np.float32)], {})
    # at least one arena storage (48 bytes) and the output (48 bytes) were held at once
    assert allocator.stats()["peak_bytes"] >= 96
    from kiln.runtime.allocator import memory_stats

    assert set(memory_stats()) >= {"current_bytes", "peak_bytes", "allocations", "limit_bytes"}
