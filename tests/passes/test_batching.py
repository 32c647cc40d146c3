"""Batching (issue 21): small independent kernels of different shapes share one launch.

Before/after pass text (STYLE §3), launch counts with and without the pass, numerics
against numpy and against the unbatched program over dtypes and broadcasts, the
dependence rule (a test that fails if a batch held a kernel and one it waits on),
symbolic sizes, cond/while_loop regions, `.kir` export/load, `kiln dump`, capture, and
the batched entry run over ranges that cut through its members."""

import ctypes

import numpy as np
import pytest

import kiln as kn
import kiln.passes.batching as batching
from kiln.codegen.build_program import build_program
from kiln.codegen.kernel_ir import BatchKernel
from kiln.errors import KilnBatchError
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.passes.batching import batch_kernels
from kiln.passes.fusion import fuse
from tests.cli_helpers import kiln_cli
from tests.passes.examples import assert_rewrites

BEFORE = """
graph @g(%a: f32[8], %b: f32[4, 3], %c: f32[5]) -> (f32[8], f32[4], f32[5])
  %0 = exp(%a) : f32[8]
  %1 = reduce_sum(%b) {axes=(1,)} : f32[4]
  %2, %3 = sort(%c) {axis=0, descending=false} : f32[5], i64[5]
  %4 = neg(%2) : f32[5]
  return %0, %1, %4
"""

# exp, the row sum and neg are independent of each other. Counted from the start, neg
# comes a launch later (after the sort) than the other two; counted from the end, all
# three are last, so the pass batches all three after the sort: two launches, not four
AFTER = """
graph @g(%a: f32[8], %b: f32[4, 3], %c: f32[5]) -> (f32[8], f32[4], f32[5])
  %0, %1 = sort(%c) {axis=0, descending=false} : f32[5], i64[5]
  %2 = fused(%b) {batch=0, kind="reduction"} : f32[4]
    region(%3: f32[4, 3]):
      %4 = reduce_sum(%3) {axes=(1,)} : f32[4]
      yield %4
    end
  %5 = fused(%a) {batch=0, kind="loop"} : f32[8]
    region(%6: f32[8]):
      %7 = exp(%6) : f32[8]
      yield %7
    end
  %8 = fused(%0) {batch=0, kind="loop"} : f32[5]
    region(%9: f32[5]):
      %10 = neg(%9) : f32[5]
      yield %10
    end
  return %5, %2, %8
"""


def launches(compiled) -> int:
    return sum(type(s).__name__ == "Launch" for s in compiled.compiled_graphs()[0].program.steps)


def test_pass_before_after_and_launch_count():
    result = assert_rewrites(lambda g: batch_kernels(fuse(g)), BEFORE, AFTER)
    graph = parse_graph(BEFORE)
    assert len(build_program(fuse(graph)).kernels) == 3
    program = build_program(result)
    assert [type(k).__name__ for k in program.kernels.values()] == ["BatchKernel"]
    assert [type(s).__name__ for s in program.steps] == ["Extern", "Launch"]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal([int(d) for d in v.type.shape]).astype(np.float32) for v in graph.inputs]
    for want, got in zip(run_graph(graph, *xs), run_graph(result, *xs)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def mixed(a, b, c, d):
    """Independent small kernels of four shapes, with broadcasts and reductions."""
    return (a * 2 + 1, (b + a[:3]).sum(dim=0), kn.maximum(c, c[:, :1]), d.max(dim=-1)[0],
            (b * b).sum(dim=1, keepdim=True))


def mixed_numpy(a, b, c, d):
    return (a * 2 + 1, (b + a[:3]).sum(axis=0), np.maximum(c, c[:, :1]), d.max(axis=-1),
            (b * b).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_batched_program_matches_numpy_and_the_unbatched_program(dtype, monkeypatch):
    rng = np.random.default_rng(1)
    args = [(rng.standard_normal(s) * 4).astype(dtype) for s in ((8,), (5, 3), (4, 6), (2, 7))]
    batched = kn.compile(mixed)
    got = [t.numpy() for t in batched(*args)]
    monkeypatch.setattr(batching, "ENABLED", False)
    plain = kn.compile(mixed)
    ref = [t.numpy() for t in plain(*args)]
    assert launches(batched) == 1 < launches(plain)
    tol = 1e-6 if dtype != np.float32 else 1e-5
    for g, r, n in zip(got, ref, mixed_numpy(*args)):
        assert g.dtype == n.dtype
        np.testing.assert_allclose(g, r, rtol=tol)
        np.testing.assert_allclose(g, n, rtol=tol)


def test_a_kernel_and_one_it_waits_on_never_share_a_batch():
    # y = exp(x) is small; z reads y through a sort (an extern) and is small too; w is
    # independent. Batched together, z would run before the sort wrote its input.
    def f(x, v):
        y = kn.exp(x)
        return y, kn.sort(y)[0] * 2 - 1, kn.tanh(v)

    x = np.linspace(-1, 1, 9).astype(np.float32)[::-1].copy()
    v = np.linspace(0, 1, 6).astype(np.float32).reshape(2, 3)
    compiled = kn.compile(f)
    y, z, w = compiled(x, v)
    np.testing.assert_allclose(z.numpy(), np.sort(np.exp(x)) * 2 - 1, rtol=1e-6)
    np.testing.assert_allclose(w.numpy(), np.tanh(v), rtol=1e-6)
    program = compiled.compiled_graphs()[0].program
    for kernel in program.kernels.values():
        if isinstance(kernel, BatchKernel):
            assert not ({"exp", "mul"} <= {s for m in kernel.members for s in _ops(m)})


def _ops(kernel) -> set:
    from kiln.codegen.kernel_ir import Op, walk

    return {x.op for st in kernel.stages for x in walk(st.value) if isinstance(x, Op)}


def test_a_batch_that_holds_a_dependence_is_refused_k455():
    # a hand-tagged graph whose second member reads the first one's result
    graph = parse_graph("""
graph @g(%a: f32[8]) -> (f32[8], f32[8])
  %0 = fused(%a) {batch=0, kind="loop"} : f32[8]
    region(%1: f32[8]):
      %2 = exp(%1) : f32[8]
      yield %2
    end
  %3 = fused(%0) {batch=0, kind="loop"} : f32[8]
    region(%4: f32[8]):
      %5 = neg(%4) : f32[8]
      yield %5
    end
  return %0, %3
""")
    with pytest.raises(KilnBatchError, match="K455.*batch 0: member at node 1 reads a result"):
        build_program(graph)


def test_the_cond_predicate_reduction_is_not_batched_with_the_reduction_after_the_cond():
    # issue 21's reproducer: x.sum() decides the branch, the branch's result is summed
    def f(x, y):
        out = kn.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, x).sum()
        return out, y.max(dim=0)[0]

    compiled = kn.compile(f)
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    for sign in (1, -1):
        x = sign * np.linspace(0.5, 1, 7).astype(np.float32)
        out, m = compiled(x, y)
        want = (x * 2).sum() if x.sum() > 0 else (x - 1).sum()
        np.testing.assert_allclose(float(out), want, rtol=1e-5)
        np.testing.assert_allclose(m.numpy(), y.max(0))


def test_symbolic_sizes_with_a_bound_batch_and_run_at_every_size():
    B = kn.ShapeVar("B", min=1, max=64)
    compiled = kn.compile(lambda x, y, z: (kn.exp(x).sum(dim=1), y * 3, z + z.mean()),
                          dynamic_shapes=[kn.TensorSpec([B, 3]), kn.TensorSpec([B]), kn.TensorSpec([5])])
    for n in (1, 7, 64):
        x = np.linspace(-1, 1, 3 * n).astype(np.float32).reshape(n, 3)
        y = np.arange(n, dtype=np.float32)
        z = np.arange(5, dtype=np.float32)
        a, b, c = compiled(x, y, z)
        np.testing.assert_allclose(a.numpy(), np.exp(x).sum(1), rtol=1e-5)
        np.testing.assert_allclose(b.numpy(), y * 3)
        np.testing.assert_allclose(c.numpy(), z + z.mean(), rtol=1e-6)
    assert compiled.stats()["compiles"] == 1
    program = compiled.compiled_graphs()[0].program
    assert any(isinstance(k, BatchKernel) for k in program.kernels.values())


def test_an_unbounded_size_is_not_provably_small():
    B = kn.ShapeVar("B", min=1)
    compiled = kn.compile(lambda x, y: (kn.exp(x), y.sum(dim=0)),
                          dynamic_shapes=[kn.TensorSpec([B]), kn.TensorSpec([3, 4])])
    a, b = compiled(np.ones(5, np.float32), np.ones((3, 4), np.float32))
    np.testing.assert_allclose(a.numpy(), np.full(5, np.e, np.float32), rtol=1e-6)
    assert launches(compiled) == 2


def test_large_kernels_keep_their_own_launches():
    compiled = kn.compile(lambda x, y: (kn.exp(x), kn.tanh(y)))
    x, y = np.ones(1 << 16, np.float32), np.ones(1 << 15, np.float32)
    a, b = compiled(x, y)
    np.testing.assert_allclose(b.numpy(), np.tanh(y), rtol=1e-6)
    assert launches(compiled) == 2


def test_kernels_inside_cond_branches_and_loop_bodies_are_batched():
    def f(p, a, b):
        def yes(a, b):
            return kn.exp(a), b.sum(dim=1)

        def no(a, b):
            return a * 0, b.max(dim=1)[0]

        ra, rb = kn.cond(p, yes, no, a, b)

        def body(i, u, v):
            return i + 1, u * 0.5 + 1, v - v.mean()

        _, u, v = kn.while_loop(lambda i, u, v: i < 3, body, (kn.tensor(np.int32(0)), ra, b))
        return rb, u, v

    compiled = kn.compile(f)
    a = np.linspace(0, 1, 5).astype(np.float32)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    for p in (True, False):
        rb, u, v = compiled(np.array(p), a, b)
        ra = np.exp(a) if p else a * 0
        np.testing.assert_allclose(rb.numpy(), b.sum(1) if p else b.max(1), rtol=1e-6)
        want_u, want_v = ra, b
        for _ in range(3):
            want_u, want_v = want_u * 0.5 + 1, want_v - want_v.mean()
        np.testing.assert_allclose(u.numpy(), want_u, rtol=1e-5)
        np.testing.assert_allclose(v.numpy(), want_v, rtol=1e-5, atol=1e-5)
    text = compiled.compiled_graphs()[0].program.format()
    batches = [line for line in text.splitlines() if "_batch_" in line and "launch" in line]
    assert len(batches) >= 3, text  # both branches and the loop body


def sixteen(*xs):
    return tuple(kn.exp(x) * (i + 1) for i, x in enumerate(xs))


def sixteen_inputs():
    return [np.full(8 + 5 * i, i / 16, np.float32) for i in range(16)]


def test_sixteen_shapes_one_launch_through_kir_export_load_and_dump(tmp_path):
    xs = sixteen_inputs()
    path = tmp_path / "sixteen.kir"
    kn.export(sixteen, tuple(xs)).save(str(path))
    loaded = kn.load(str(path))
    for k, (got, x) in enumerate(zip(loaded(*xs), xs)):
        np.testing.assert_allclose(got.numpy(), np.exp(x) * (k + 1), rtol=1e-6)
    code, out, err = kiln_cli("dump", path, "--stage", "kernels")
    assert code == 0, err
    assert out.count("batched kernel ") == 1 and out.count("  member (") == 16
    code, out, err = kiln_cli("dump", path, "--stage", "batch")
    assert code == 0, err
    assert out.count("batch=0") == 16


def test_capture_replays_a_batch_in_one_native_run():
    xs = sixteen_inputs()
    captured = kn.capture(sixteen, *xs)
    for k, (got, x) in enumerate(zip(captured(*xs), xs)):
        np.testing.assert_allclose(got.numpy(), np.exp(x) * (k + 1), rtol=1e-6)
    assert captured.native_runs == 1


def test_the_batched_entry_over_ranges_that_cut_through_members():
    """The switch over sub-problems: every partition of the concatenated index space
    (as the pool cuts it over threads) computes each member exactly once."""
    from kiln.codegen.backends import get_backend
    from kiln.codegen.kernel_cost import flops_expr

    args = [np.linspace(-2, 2, n).astype(np.float32) for n in (5, 1, 9)] + \
        [np.linspace(0, 1, 12).astype(np.float32).reshape(4, 3)]

    def f(a, b, c, d):
        return kn.exp(a), b + 1, c * c, d.sum(dim=1)

    program = build_program(batch_kernels(fuse(kn.trace(f, *args))))
    ((name, batch),) = program.kernels.items()
    (launch,) = program.steps
    assert isinstance(batch, BatchKernel) and int(sum(batch.points())) == 5 + 1 + 9 + 4
    assert flops_expr(batch) == sum(flops_expr(m) for m in batch.members)
    compiled = get_backend("cpu").compile(batch)
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
        compiled.address)
    want = [np.exp(args[0]), args[1] + 1, args[2] * args[2], args[3].sum(1)]
    for cuts in ([0, 19], [0, 3, 6, 14, 15, 19], list(range(20)), [0, 5, 6, 15, 19]):
        outs = [np.full_like(w, np.nan) for w in want]
        bufs = (ctypes.c_void_p * len(batch.buffers))()
        for i, slot in enumerate(launch.args):
            array = args[program.inputs.index(slot)] if slot in program.inputs \
                else outs[program.outputs.index(slot)]
            bufs[i] = array.ctypes.data
        sizes = (ctypes.c_int64 * 1)()
        for lo, hi in zip(cuts, cuts[1:]):
            fn(bufs, sizes, lo, hi)
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got, w, rtol=1e-6)


def test_a_backward_pass_batches_its_small_gradient_kernels(monkeypatch):
    # bias gradients (row sums) and the weight-gradient transposes only feed outputs:
    # counted from the end they share the last launch
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s).astype(np.float32) * 0.1
            for s in ((16, 32), (32,), (32, 4), (4,), (8, 16), (8, 4))]

    def loss(w1, b1, w2, b2, x, y):
        return (((kn.gelu(x @ w1 + b1) @ w2 + b2) - y) ** 2).mean()

    grad = kn.grad(loss, argnums=(0, 1, 2, 3))
    batched = kn.compile(grad)
    got = [g.numpy() for g in batched(*args)]
    monkeypatch.setattr(batching, "ENABLED", False)
    plain = kn.compile(grad)
    want = [g.numpy() for g in plain(*args)]
    assert launches(batched) <= launches(plain) - 3
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
def test_random_dags_of_small_kernels_and_library_calls_match_eager(seed):
    """Random programs mixing small pointwise kernels, row reductions and sorts (library
    calls between kernels) over values of several shapes: every batch the pass forms must
    keep each kernel after what it reads, or the compiled result differs from eager."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (5, 2), (6,), (2, 7)]
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    plan = [(int(rng.integers(3)), int(rng.integers(10 ** 6))) for _ in range(14)]

    def f(*xs):
        pool = list(xs)
        outs = []
        for op, pick in plan:
            x = pool[pick % len(pool)]
            if op == 0:
                y = kn.tanh(x) * 1.5 + pool[(pick // 7) % len(pool)].sum()
            elif op == 1:
                y = x.sum(dim=-1, keepdim=True) - x
            else:
                y = kn.sort(x, dim=-1)[0]
            pool.append(y)
            outs.append(y)
        return tuple(outs)

    compiled = kn.compile(f)
    got = compiled(*inputs)
    want = f(*[kn.tensor(x) for x in inputs])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)
    assert launches(compiled) < sum(op != 2 for op, _ in plan)  # something was batched
