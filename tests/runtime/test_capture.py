"""Capture and replay (kn.capture, kiln/runtime/capture.py, the CPU launch list): a replay
gives exactly what the compiled function gives — every example program, control flow,
aliasing at loop back-edges, inputs changed in place — and refuses other shapes."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu.launch_list import CpuLauncher, openmp_runtime
from kiln.frontend.compile import compile_graph
from kiln.runtime.capture import CapturedPlan, KilnCaptureError, Loop, PyStep, Swap
from kiln.passes import unroll_loops
from tests.passes.examples import EXAMPLES, example


def plan_for(graph, arrays, launcher="cpu", parallel=None):
    compiled = compile_graph(graph, "cpu")
    if launcher == "cpu":
        launcher = CpuLauncher()
        if parallel is not None:
            launcher.parallel = parallel and launcher.parallel
    executable = compiled.executable
    plan = CapturedPlan(compiled.program, executable.kernels, executable.externs,
                        compiled.binder(arrays), arrays, launcher)
    return compiled, plan


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("launcher", ["cpu", None], ids=["native", "python"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_replays_like_the_compiled_call(name, launcher):
    graph, arrays = example(name)
    compiled, plan = plan_for(graph, arrays, launcher)
    want = compiled.run(arrays)
    assert_same(plan.run(arrays), want)
    assert_same(plan.run(arrays), want)  # a second replay: the same buffers, the same answer


def newton(a):
    def body(i, y):
        return i + 1, 0.5 * (y + a / y)

    return kn.while_loop(lambda i, y: i < 20, body, (kn.tensor(0, dtype=kn.int32), kn.ones_like(a)))[1]


def dispatch(i, x):
    return kn.switch(i, [lambda v: v * 2.0 + 1.0, lambda v: kn.exp(-v * v),
                         lambda v: kn.sqrt(kn.abs(v)), lambda v: kn.tanh(v) * 3.0], x)


def chain(x, a, b):
    return kn.gelu(x * a + b) * kn.sigmoid(x)


def test_chain_is_one_native_call_and_exact():
    x, a, b = (kn.randn(4096, seed=s) for s in range(3))
    g = kn.capture(chain, x, a, b)
    assert g.native_runs == 1
    assert g.plan._bind is not None  # inputs bound natively: one store per input
    np.testing.assert_array_equal(g(x, a, b).numpy(), kn.compile(chain)(x, a, b).numpy())


@pytest.mark.parametrize("n", [1 << 10, 1 << 18], ids=["serial", "parallel"])
@pytest.mark.parametrize("parallel", [True, False], ids=["openmp", "pool"])
def test_while_loop_replays_natively(n, parallel, monkeypatch):
    monkeypatch.setattr(unroll_loops, "MAX_TRIPS", 0)  # keep the 20-trip loop a loop
    a = kn.rand(n, seed=3) + 0.5
    graph = kn.trace(newton, a)
    compiled, plan = plan_for(graph, [a.numpy()], parallel=parallel)
    loops = [op for op in plan.ops if isinstance(op, Loop)]
    assert loops and any(isinstance(op, Swap) for op in loops[0].back)  # y handed back, not copied
    assert_same(plan.run([a.numpy()]), compiled.run([a.numpy()]))
    if n < 1 << 12 or (parallel and openmp_runtime()):
        assert plan.native_runs == 1 and len(plan._block.parts) == 1


@pytest.mark.parametrize("k", [-3, 0, 1, 2, 3, 9])
def test_switch_takes_the_clamped_branch(k):
    x = kn.randn(257, seed=1)
    g = kn.capture(dispatch, kn.tensor(0, dtype=kn.int32), x)
    assert g.native_runs == 1
    i = kn.tensor(k, dtype=kn.int32)
    np.testing.assert_array_equal(g(i, x).numpy(), kn.compile(dispatch)(i, x).numpy())


def test_cond_on_a_reduction():
    f = lambda x: kn.cond(x.sum() > 0, lambda v: v * 2, lambda v: -v, x).sum()  # noqa: E731
    g = kn.capture(f, kn.ones(16))
    for x in (kn.ones(16), -kn.ones(16) * 3, kn.randn(16, seed=4)):
        np.testing.assert_allclose(g(x).numpy(), kn.compile(f)(x).numpy(), rtol=0, atol=0)


def test_loop_whose_body_permutes_its_carried_values():
    """Each output is another carried value: copies go through scratch buffers."""
    def f(x, y):
        return kn.while_loop(lambda i, a, b: i < 5,
                             lambda i, a, b: (i + 1, b, a + b), (kn.tensor(0, dtype=kn.int32), x, y))

    x, y = kn.tensor(np.arange(6, dtype=np.float32)), kn.ones(6)
    g = kn.capture(f, x, y)
    for got, want in zip(g(x, y), kn.compile(f)(x, y)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_nested_loops():
    def f(x):
        def outer(i, v):
            inner = kn.while_loop(lambda j, w: j < 3, lambda j, w: (j + 1, w * 1.5 + 1), (kn.tensor(0), v))[1]
            return i + 1, inner - v.mean()

        return kn.while_loop(lambda i, v: i < 4, outer, (kn.tensor(0), x))[1]

    x = kn.randn(33, seed=2)
    g = kn.capture(f, x)
    np.testing.assert_array_equal(g(x).numpy(), kn.compile(f)(x).numpy())


def test_outputs_that_alias_inputs_views_and_constants():
    f = lambda x: (x, x.reshape(2, 3), kn.tensor([1.0, 2.0]), x * 2)  # noqa: E731
    x = kn.tensor(np.arange(6, dtype=np.float32))
    g = kn.capture(f, x)
    out = g(x)
    np.testing.assert_array_equal(out[0].numpy(), x.numpy())
    np.testing.assert_array_equal(out[1].numpy(), x.numpy().reshape(2, 3))
    np.testing.assert_array_equal(out[2].numpy(), [1.0, 2.0])
    x2 = kn.tensor(np.arange(6, dtype=np.float32) + 10)
    np.testing.assert_array_equal(g(x2)[1].numpy(), x2.numpy().reshape(2, 3))
    assert not np.shares_memory(g(x2)[0].numpy(), x2.numpy())  # outputs are the caller's own


def test_externs_run_between_native_runs():
    f = lambda x: kn.sort(x * 2, dim=-1)[0] + 1  # noqa: E731
    x = kn.randn(4, 9, seed=5)
    g = kn.capture(f, x)
    assert any(isinstance(op, PyStep) for op in g.plan.ops)
    np.testing.assert_array_equal(g(x).numpy(), kn.compile(f)(x).numpy())


def test_replay_sees_inputs_changed_in_place():
    data = np.linspace(-1, 1, 64, dtype=np.float32)
    g = kn.capture(lambda x: kn.exp(x) * 2, data)
    first = g(data).numpy()
    data *= 3  # the caller's buffer changes between replays
    np.testing.assert_allclose(g(data).numpy(), np.exp(data) * 2, rtol=1e-6)
    assert not np.allclose(first, g(data).numpy())


def test_outputs_of_one_replay_survive_the_next():
    g = kn.capture(lambda x: x + 1, kn.zeros(8))
    a = g(kn.zeros(8))
    g(kn.ones(8))
    np.testing.assert_array_equal(a.numpy(), np.ones(8, np.float32))


@pytest.mark.parametrize("bad, message", [
    (lambda: (kn.zeros(9),), "input 0 is float32\\[9\\], but the program was captured for float32\\[8\\]"),
    (lambda: (kn.zeros(8, dtype=kn.float64),), "input 0 is float64\\[8\\]"),
])
def test_other_shapes_and_dtypes_are_refused(bad, message):
    g = kn.capture(lambda x: x * 2, kn.zeros(8))
    with pytest.raises(KilnCaptureError, match=message) as info:
        g(*bad())
    assert str(info.value).startswith("[K390]")


def test_symbolic_sizes_are_fixed_at_capture():
    B = kn.ShapeVar("B", min=1, max=64)

    @kn.dynamic_spec({"x": kn.TensorSpec([B, 4])})
    def f(x):
        return (x * 2).sum(dim=0)

    g = kn.capture(f, kn.ones(5, 4))
    np.testing.assert_array_equal(g(kn.ones(5, 4)).numpy(), np.full(4, 10, np.float32))
    with pytest.raises(KilnCaptureError):
        g(kn.ones(6, 4))


def test_pytree_arguments_and_results():
    f = lambda d: {"s": d["x"] + d["y"], "p": (d["x"] * d["y"],)}  # noqa: E731
    args = {"x": kn.ones(3), "y": kn.full((3,), 2.0)}
    out = kn.capture(f, args)(args)
    np.testing.assert_array_equal(out["s"].numpy(), [3, 3, 3])
    np.testing.assert_array_equal(out["p"][0].numpy(), [2, 2, 2])


def test_captured_buffers_are_counted_by_kn_memory():
    import gc

    x = kn.zeros(1 << 16)
    gc.collect()  # earlier tests' garbage must not be freed inside the measured window
    before = kn.memory.memory_allocated()
    g = kn.capture(lambda x: (x * 2 + 1).exp(), x)
    held = kn.memory.memory_allocated() - before
    assert held >= 4 << 16  # at least the output buffer of 2^16 float32
    np.testing.assert_allclose(g(kn.ones(1 << 16)).numpy(), np.exp(np.full(1 << 16, 3.0, np.float32)), rtol=1e-6)
    del g
    gc.collect()
    assert kn.memory.memory_allocated() - before < held  # released with the capture
