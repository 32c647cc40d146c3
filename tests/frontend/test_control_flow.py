"""kn.cond / kn.switch / kn.while_loop: eager, traced (interpreted), compiled (cpu and
reference backends) and exported-and-loaded all agree; regions are self-contained;
errors name the branch, the output and both types."""

import runpy

import numpy as np
import pytest

import kiln as kn
from kiln.errors import (KilnArgumentError, KilnConcretizationError, KilnDTypeError, KilnShapeError,
                         KilnTraceError)
from kiln.frontend.stages import render_stage
from kiln.ir.interpret import run_graph
from kiln.ir.verifier import verify
from kiln.passes.fusion import fuse
from kiln.passes import unroll_loops
from kiln.passes.licm import free_values
from kiln.passes.pipeline import optimize
from kiln.runtime.program import Control, Extern


def leaves(x):
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in leaves(x[k])]
    if isinstance(x, (tuple, list)):
        return [v for item in x for v in leaves(item)]
    return [np.asarray(x.numpy() if isinstance(x, kn.Tensor) else x)]


class Everywhere:
    """One function run eagerly, interpreted, compiled for cpu and reference, and
    exported, saved, loaded and run; `check(*args)` compares every mode with eager."""

    def __init__(self, fn, example, tmp_path):
        self.fn = fn
        self.graph = kn.trace(fn, *example)
        verify(self.graph)
        self.cpu = kn.compile(fn)
        self.ref = kn.compile(fn, backend="reference")
        path = tmp_path / f"{getattr(fn, '__name__', 'f')}.kir"
        kn.export(fn, tuple(example)).save(path)
        self.loaded = kn.load(path)

    def check(self, *args, rtol=1e-6):
        expected = leaves(self.fn(*[kn.tensor(a) for a in args]))
        runs = {"interpreted": run_graph(self.graph, *args), "cpu": self.cpu(*args),
                "reference": self.ref(*args), "loaded": self.loaded(*args)}
        for mode, got in runs.items():
            got = leaves(got)
            assert len(got) == len(expected), mode
            for g, e in zip(got, expected):
                assert g.dtype == e.dtype and g.shape == e.shape, (mode, g, e)
                np.testing.assert_allclose(g, e, rtol=rtol, err_msg=mode)
        return expected

    def compiles(self) -> int:
        return self.cpu.stats()["compiles"]


def f32(*values):
    return np.array(values, np.float32)


def i32(value):
    return np.array(value, np.int32)


# -- cond ---------------------------------------------------------------------------------------


def test_cond_everywhere(tmp_path):
    def f(x):
        return kn.cond(x.sum() > 0, lambda v: v * 2 + 1, lambda v: kn.exp(-v), x)

    run = Everywhere(f, [f32(1, 2, 3)], tmp_path)
    assert [n.op for n in run.graph.nodes][-1] == "cond"
    np.testing.assert_allclose(run.check(f32(1, 2, 3))[0], f32(3, 5, 7))
    np.testing.assert_allclose(run.check(f32(-1, -2, 0))[0], np.exp(f32(1, 2, 0)))
    assert run.compiles() == 1


def test_cond_eager_with_python_bool_or_tensor():
    x = kn.tensor([1.0, 2.0])
    assert kn.cond(True, lambda v: v + 1, lambda v: v - 1, x).tolist() == [2.0, 3.0]
    assert kn.cond(kn.tensor(False), lambda v: v + 1, lambda v: v - 1, x).tolist() == [0.0, 1.0]
    assert kn.cond(np.bool_(True), lambda: kn.ones(1), lambda: kn.zeros(1)).tolist() == [1.0]
    # a predicate known in Python picks the branch at trace time: no region at all
    g = kn.trace(lambda v: kn.cond(False, lambda a: a + 1, lambda a: a * 3, v), f32(1))
    assert [n.op for n in g.nodes] == ["full", "mul"]


def test_cond_pytrees_several_outputs_and_static_operands(tmp_path):
    def f(x, y):
        def yes(p, scale):
            return {"a": p[0] * scale, "b": (p[1].sum(), p[0] + 1)}

        def no(p, scale):
            return {"a": p[0] - scale, "b": (p[1].max(), p[0] * 0)}

        return kn.cond(y.sum() > x.sum(), yes, no, (x, y), 3.0)

    run = Everywhere(f, [f32(1, 2), f32(5, 6, 7)], tmp_path)
    run.check(f32(1, 2), f32(5, 6, 7))
    run.check(f32(10, 20), f32(5, 6, 7))


# -- switch -------------------------------------------------------------------------------------


def three_way(i, x):
    return kn.switch(i, [lambda v: v + 100, lambda v: v * 2, lambda v: -v], x)


def test_switch_clamps_index_everywhere(tmp_path):
    run = Everywhere(three_way, [i32(1), f32(1, 2)], tmp_path)
    for index, expected in [(-5, [101, 102]), (-1, [101, 102]), (0, [101, 102]), (1, [2, 4]),
                            (2, [-1, -2]), (3, [-1, -2]), (99, [-1, -2])]:
        np.testing.assert_allclose(run.check(i32(index), f32(1, 2))[0], expected)
    assert run.compiles() == 1


def test_switch_is_one_cond_node_with_an_int32_index():
    g = kn.trace(three_way, np.array(1, np.int64), f32(1, 2))
    (node,) = [n for n in g.nodes if n.op == "cond"]
    assert len(node.regions) == 3 and str(node.operands[0].type) == "i32[]"
    # an int64 index is clamped before it narrows: 2**40 must not wrap around to 0
    for index, expected in [(2 ** 40, [-1, -2]), (-(2 ** 40), [101, 102]), (2 ** 32, [-1, -2])]:
        (out,) = run_graph(g, np.array(index, np.int64), f32(1, 2))
        np.testing.assert_allclose(out, expected)
        np.testing.assert_allclose(three_way(kn.tensor(index), kn.tensor(f32(1, 2))).numpy(), expected)


def test_switch_with_a_python_index_traces_one_branch():
    g = kn.trace(lambda x: three_way(7, x), f32(1, 2))
    assert "cond" not in g.op_counts() and g.op_counts()["neg"] == 1
    assert three_way(-3, kn.tensor(f32(1))).tolist() == [101.0]


# -- while_loop ---------------------------------------------------------------------------------


def count_to(n, x):
    return kn.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * 2 + 1),
                         (kn.tensor(0, dtype=kn.int32), x))


def test_while_loop_zero_and_many_trips(tmp_path):
    run = Everywhere(count_to, [i32(3), f32(0, 1)], tmp_path)
    i, v = run.check(i32(0), f32(0, 1))  # zero trips: the initial values come back
    assert i == 0 and v.tolist() == [0, 1]
    i, v = run.check(i32(-4), f32(0, 1))
    assert i == 0 and v.tolist() == [0, 1]
    i, v = run.check(i32(5), f32(0, 1))
    assert i == 5 and v.tolist() == [31, 63]
    assert run.compiles() == 1


def test_while_loop_trip_count_depends_on_data(tmp_path):
    def doublings(x, limit):
        def body(k, v):
            return k + 1, v * 2

        return kn.while_loop(lambda k, v: v.sum() < limit, body, (kn.tensor(0, dtype=kn.int32), x))

    run = Everywhere(doublings, [f32(1, 1), np.array(100, np.float32)], tmp_path)
    for x, limit, trips in [(f32(1, 1), 100.0, 6), (f32(1, 2), 3.5, 1), (f32(50, 60), 10.0, 0),
                            (f32(0.001, 0), 1e6, 30)]:
        k, v = run.check(x, np.array(limit, np.float32))
        assert k == trips
    assert run.compiles() == 1


def test_while_loop_eager_only_python():
    calls = []

    def body(i):
        calls.append(int(i))  # eagerly the body is ordinary Python
        return (i + 1,)

    (out,) = kn.while_loop(lambda i: i < 3, body, (kn.tensor(0),))
    assert out.item() == 3 and calls == [0, 1, 2]
    (out,) = kn.while_loop(lambda i: i < 3, lambda i: i + 1, kn.tensor(5))
    assert out.item() == 5


# -- nesting and closures -----------------------------------------------------------------------

W = np.array([3.0, -1.0], np.float32)


def nested(x, n):
    s = x.sum()

    def body(i, y):  # a switch inside a while body inside a cond
        branch = kn.switch(i % 3, [lambda a: a + s, lambda a: a * W, lambda a: a - 1.0], y)
        return i + 1, branch

    def loop(y):
        return kn.while_loop(lambda i, y: i < n, body, (kn.tensor(0, dtype=kn.int32), y))[1]

    return kn.cond(s > 0, loop, lambda y: y * 0.5, x)


def test_nested_switch_in_while_in_cond(tmp_path):
    run = Everywhere(nested, [f32(1, 2), i32(5)], tmp_path)
    assert str(run.graph).count("region(") == 2 + 2 + 3  # cond, while_loop, switch
    for x, n in [(f32(1, 2), 5), (f32(1, 2), 0), (f32(-1, -2), 5), (f32(0.5, 0.25), 7)]:
        run.check(x, i32(n))
    assert run.compiles() == 1


def test_closures_become_explicit_operands(tmp_path):
    bias = kn.tensor([10.0, 20.0])  # eager tensors and arrays a branch uses become constants

    def f(x, y):
        total = y.sum()  # an outer traced value the branches close over

        def pos(v):
            return v * total + bias + W

        def neg(v):
            return v - total

        return kn.cond(x.sum() > 0, pos, neg, x)

    run = Everywhere(f, [f32(1, 2), f32(3, 4)], tmp_path)
    (node,) = [n for n in run.graph.nodes if n.op == "cond"]
    assert all(free_values(r) == [] for r in node.regions)
    assert len(node.operands) == 1 + 1 + 1  # index, x, and the captured sum
    assert len(node.regions[0].params) == len(node.regions[1].params) == 2
    run.check(f32(1, 2), f32(3, 4))
    run.check(f32(-1, -2), f32(3, 4))


def test_loop_closures_pass_through_the_body():
    def f(x, step):
        return kn.while_loop(lambda v: v.sum() < 100, lambda v: (v + step,), (x,))[0]

    g = kn.trace(f, f32(1, 2), f32(5, 5))
    (node,) = [n for n in g.nodes if n.op == "while_loop"]
    body = node.regions[1]
    assert len(node.operands) == 2 and body.results[1] is body.params[1]
    np.testing.assert_allclose(run_graph(g, f32(1, 2), f32(5, 5))[0], f32(51, 52))


def test_a_constant_made_inside_a_branch_is_not_reused_outside():
    def f(x):
        y = kn.cond(x.sum() > 0, lambda v: v + W, lambda v: v, x)
        return y * W  # W's constant node in the branch is out of scope here

    g = kn.trace(f, f32(1, 1))
    verify(g)
    np.testing.assert_allclose(run_graph(g, f32(1, 1))[0], (f32(1, 1) + W) * W)


# -- compiled programs and dumps -----------------------------------------------------------------


def newton(a):
    def body(i, y):
        return i + 1, 0.5 * (y + a / y)

    return kn.while_loop(lambda i, y: i < 20, body, (kn.tensor(0, dtype=kn.int32), kn.ones_like(a)))[1]


def test_branches_and_bodies_run_as_compiled_kernels(monkeypatch):
    monkeypatch.setattr(unroll_loops, "MAX_TRIPS", 0)  # keep the 20-trip loop a loop
    f = kn.compile(newton)
    a = np.linspace(0.5, 100, 1000).astype(np.float32)
    np.testing.assert_allclose(f(a).numpy(), np.sqrt(a), rtol=1e-6)
    (compiled,) = f.compiled_graphs()
    (loop,) = [s for s in compiled.program.steps if isinstance(s, Control)]
    for body in loop.bodies:  # no step of the loop falls back to a numpy reference
        assert body.steps and not any(isinstance(s, Extern) for s in body.steps)


def test_fusion_recurses_into_regions():
    g = kn.trace(nested, f32(1, 2), i32(3))
    fused = fuse(optimize(g))
    verify(fused)
    loops = [n for n in fused.walk() if n.op == "while_loop"]
    assert loops and any(n.op == "fused" for r in loops[0].regions for n in r.nodes)
    elementwise = {"add", "mul", "sub", "lt", "remainder"}
    assert not [n.op for n in fused.walk() if n.op in elementwise and n.op != "fused"
                and not _inside_fused(fused, n)]
    np.testing.assert_allclose(run_graph(fused, f32(1, 2), i32(4))[0],
                               run_graph(g, f32(1, 2), i32(4))[0])


def _inside_fused(graph, target) -> bool:
    return any(target in list(r.walk()) for n in graph.walk() if n.op == "fused" for r in n.regions)


def test_dump_shows_regions_and_symbolic_shapes_at_every_stage(monkeypatch):
    monkeypatch.setattr(unroll_loops, "MAX_TRIPS", 0)  # keep the 20-trip loop a loop
    spec = [kn.TensorSpec([kn.ShapeVar("N", min=0, max=1 << 20)])]
    g = kn.trace(newton, f32(1, 4, 9), dynamic_shapes=spec)
    optimized = render_stage(g, "optimized")
    assert "where N in [0, 1048576]" in optimized and "while_loop(" in optimized
    assert "      %" in optimized and 'fused(' in optimized.split("while_loop(")[1]
    kernels = render_stage(g, "kernels")
    assert "sizes(N)" in kernels and "parallel i0 in [0, N)" in kernels
    program = render_stage(g, "program")
    assert "    cond:" in program and "    body:" in program and "f32[N]" in program
    assert program.count("program @") == 3 and "where N in [0, 1048576]" in program


# -- data-dependent shapes ----------------------------------------------------------------------


def test_nonzero_is_eager_only():
    x = kn.tensor([[0, 3], [4, 0]])
    assert kn.nonzero(x).tolist() == [[0, 1], [1, 0]] and kn.nonzero(x).dtype == kn.int64
    rows, cols = kn.nonzero(x, as_tuple=True)
    assert rows.tolist() == [0, 1] and cols.tolist() == [1, 0]
    assert kn.nonzero(np.zeros(3)).shape == (0, 1)
    with pytest.raises(KilnTraceError, match="nonzero has a data-dependent") as info:
        kn.compile(lambda v: kn.nonzero(v))(f32(1, 0))
    assert "kn.where" in str(info.value) and "test_control_flow.py" in str(info.value)
    with pytest.raises(KilnTraceError, match="boolean-mask"):
        kn.trace(lambda v: v[v > 0], f32(1, -1))


# -- errors -------------------------------------------------------------------------------------


def test_branch_type_mismatch_names_branch_output_and_types():
    def shape_mismatch(x):
        return kn.cond(x.sum() > 0, lambda v: (v, v * 2), lambda v: (v, v.sum()), x)

    with pytest.raises(KilnShapeError) as info:
        kn.trace(shape_mismatch, f32(1, 2))
    message = str(info.value)
    assert "false_fn '<lambda>' output 1 is f32[]" in message and "true_fn" in message
    assert "f32[2]" in message and "test_control_flow.py" in message

    def dtype_mismatch(i, x):
        def second(v):
            return v.to(kn.float64)

        return kn.switch(i, [lambda v: v, second], x)

    with pytest.raises(KilnDTypeError, match="branch 1 'second' output 0 is f64\\[2\\] but branch 0"):
        kn.compile(dtype_mismatch)(i32(0), f32(1, 2))
    with pytest.raises(KilnShapeError, match="structure"):
        kn.trace(lambda x: kn.cond(x.sum() > 0, lambda v: v, lambda v: (v, v), x), f32(1))


def test_while_loop_errors():
    def bad_body(x):
        return kn.while_loop(lambda v: v.sum() < 10, lambda v: (v.sum(),), (x,))

    with pytest.raises(KilnShapeError, match="body_fn '<lambda>' output 0 is f32\\[\\] but carried value 0 is f32\\[2\\]"):
        kn.trace(bad_body, f32(1, 2))
    with pytest.raises(KilnShapeError, match="output 0 is f32\\[\\]"):
        bad_body(kn.tensor(f32(1, 2)))  # eagerly too
    with pytest.raises(KilnDTypeError, match="output 0 is i64"):
        kn.while_loop(lambda v: v < 3, lambda v: (v.to(kn.int64) + 1,), (kn.tensor(0, dtype=kn.int32),))
    with pytest.raises(KilnDTypeError, match="cond_fn 'c' must return one bool scalar"):
        def c(v):
            return v > 0

        kn.trace(lambda x: kn.while_loop(c, lambda v: (v,), (x,)), f32(1, 2))
    with pytest.raises(KilnShapeError, match="returns 1 value\\(s\\) but 2 are carried"):
        kn.while_loop(lambda a, b: a < 1, lambda a, b: (a + 1,), (kn.tensor(0), kn.tensor(0)))
    with pytest.raises(KilnArgumentError, match="non-empty tuple"):
        kn.while_loop(lambda: True, lambda: (), ())


def test_predicate_and_index_errors():
    x = kn.tensor(f32(1, 2))
    with pytest.raises(KilnDTypeError, match="pred must be a bool scalar tensor, got f32\\[2\\]"):
        kn.cond(x, lambda v: v, lambda v: v, x)
    with pytest.raises(KilnDTypeError, match="pred must be a bool scalar"):
        kn.trace(lambda v: kn.cond(v > 0, lambda a: a, lambda a: a, v), f32(1, 2))
    with pytest.raises(KilnDTypeError, match="index must be an integer scalar"):
        kn.switch(kn.tensor(1.0), [lambda v: v], x)
    with pytest.raises(KilnArgumentError, match="non-empty sequence"):
        kn.switch(0, [], x)


@pytest.mark.parametrize("body,what", [
    ("if x.sum() > 0:\n        x = x + 1", "bool(tensor)"),
    ("while x.sum() < 10:\n        x = x * 2", "bool(tensor)"),
    ("x = x * x.sum().item()", "Tensor.item()"),
    ("x = x * float(x.sum())", "float(tensor)"),
    ("x = x * x.numpy()", "Tensor.numpy()"),
])
def test_python_control_flow_on_values_points_at_the_line(body, what, tmp_path):
    source = f"import kiln as kn\n\ndef user_fn(x):\n    {body}\n    return x\n"
    path = tmp_path / "user_code.py"
    path.write_text(source)
    namespace = runpy.run_path(str(path))  # a user module, so the error names its file
    with pytest.raises(KilnConcretizationError) as info:
        kn.compile(namespace["user_fn"])(f32(1, 2))
    message = str(info.value)
    assert what in message and "[K141]" in message and "user_code.py:4" in message
    assert "kn.cond" in message and "kn.while_loop" in message and "kn.switch" in message
