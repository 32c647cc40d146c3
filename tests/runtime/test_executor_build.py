"""Building an Executable: which launch arguments a step allocates (its first write of
a slot) is decided by one pass over the program, and must match the definition (no
earlier step names the slot among what it writes; inputs are never allocated)."""

import numpy as np

import kiln as kn
from kiln.frontend.compile import compile_graph
from kiln.ir import dtypes as dt
from kiln.runtime.allocator import Allocator
from kiln.runtime.executor import Executable
from kiln.runtime.memory_plan import plan_memory
from kiln.runtime.program import BufferSpec, Constant, Extern, Launch, Program, View


def _written(step) -> tuple:
    if isinstance(step, Launch):
        return step.args
    return getattr(step, "outputs", ()) or ((step.target,) if hasattr(step, "target") else ())


def _oracle(program, slot: int, index: int) -> bool:
    """The definition, by a scan of the steps before `index`."""
    if slot in program.inputs:
        return False
    return not any(slot in _written(step) for step in program.steps[:index])


def _check_every_launch(ex: Executable) -> int:
    program, checked = ex.program, 0
    for index, step in enumerate(program.steps):
        if isinstance(step, Launch):
            for slot in step.args:
                assert ex._first_write(slot, index) == _oracle(program, slot, index), (index, slot)
                checked += 1
    for step in program.steps:  # and the bodies of control flow, built as executables
        for body in getattr(step, "bodies", ()):
            checked += _check_every_launch(Executable(body, ex.kernels, ex.allocator))
    return checked


def test_first_writes_match_the_definition_on_a_hand_built_program():
    f32 = BufferSpec(dt.float32, (4, 3))
    flat = BufferSpec(dt.float32, (12,))
    specs = {0: f32, 1: f32, 2: f32, 3: flat, 4: flat, 5: f32, 6: f32}
    # slot 1 written by an extern before a launch reads it; slot 2 by a constant; 3 by a
    # view; 4 first named by a launch; 5 read-and-written by two launches; 6 the output
    steps = [Extern("neg", {}, (0,), (1,)), Constant(2, "c"), View(1, 3), Launch("k", (3, 4)),
             Launch("k", (1, 2, 5)), Launch("k", (5, 4, 6))]
    p = plan_memory(Program("p", [0], [6], specs, steps, {}, constants={"c": np.ones((4, 3), np.float32)}))
    ex = Executable(p, {"k": lambda a, s: None}, Allocator())
    assert _check_every_launch(ex) == 8
    assert ex._first_write(4, 3) and ex._first_write(5, 4) and ex._first_write(6, 5)
    assert not ex._first_write(3, 3) and not ex._first_write(1, 4) and not ex._first_write(4, 5)


def test_first_writes_match_the_definition_on_traced_programs():
    def step(w, b, x, y):
        def loss(w, b):
            return ((kn.tanh(x @ w + b) - y) ** 2).mean()
        value, (gw, gb) = kn.value_and_grad(loss, argnums=(0, 1))(w, b)
        return w - 0.1 * gw, b - 0.1 * gb, value

    def looped(x):
        return kn.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, kn.exp(v) * 0.5), (kn.tensor(0), x))[1]

    args = (kn.randn(8, 4, seed=0), kn.randn(4, seed=1), kn.randn(16, 8, seed=2), kn.randn(16, 4, seed=3))
    checked = 0
    for fn, inputs in ((step, args), (looped, (kn.randn(5, 3, seed=4),))):
        compiled = compile_graph(kn.trace(fn, *inputs), "reference")
        ex = Executable(compiled.program, compiled.executable.kernels, Allocator())
        checked += _check_every_launch(ex)
        # and the executable runs: the reference backend against eager
        got = ex.run([np.asarray(t.numpy()) for t in inputs], {})
        want = fn(*inputs)
        want = want if isinstance(want, tuple) else (want,)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)
    assert checked > 20
