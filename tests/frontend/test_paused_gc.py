"""Python's cycle collector is paused while kiln traces and compiles (graph_compile.paused_gc)
and restored to what it was after, also on errors, nested and across threads."""

import gc
import threading

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.graph_compile import paused_gc


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_off_during_a_trace_and_a_compile_and_back_on_after():
    seen = []

    def f(x):
        seen.append(gc.isenabled())  # runs while kn.compile traces
        return kn.tanh(x) * 2

    out = kn.compile(f)(np.ones(4, np.float32))
    np.testing.assert_allclose(out.numpy(), np.tanh(np.ones(4)) * 2, rtol=1e-6)
    assert seen == [False] and gc.isenabled()


def test_restored_after_an_error_and_left_off_when_the_user_turned_it_off():
    with pytest.raises(kn.KilnError):
        kn.compile(lambda x: x @ x)(np.ones((2, 3), np.float32))  # (2, 3) @ (2, 3): a shape error
    assert gc.isenabled()
    gc.disable()
    kn.compile(lambda x: x + 1)(np.ones(2, np.float32))
    assert not gc.isenabled()


def test_nested_and_threads_share_one_pause():
    inside, release = threading.Event(), threading.Event()
    states = []

    def other():
        with paused_gc():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=other)
    with paused_gc():
        with paused_gc():
            states.append(gc.isenabled())
        states.append(gc.isenabled())  # the inner exit did not turn it on
        t.start()
        assert inside.wait(30)
    states.append(gc.isenabled())  # the other thread still holds its pause
    release.set()
    t.join(30)
    assert not t.is_alive()
    assert states == [False, False, False] and gc.isenabled()


def test_a_cold_build_collects_its_garbage_while_llvm_runs(monkeypatch, tmp_path):
    """A cold compile whose LLVM modules build on threads collects the young garbage of the
    compile on the compiling thread while they run (still paused: an explicit collection),
    so the collection the collector would make right after the compile, before the first
    step, is small; a user who turned the collector off gets no collection at all."""
    from kiln.codegen.cpu import jit, stream_build
    from kiln.codegen.cpu.backend import CpuBackend

    from tests.codegen.test_cpu_parallel_build import many_kernels, oracle

    if CpuBackend().options.threads < 2:
        pytest.skip("one kiln thread on this machine: LLVM builds on no thread of its own")
    monkeypatch.setattr(stream_build, "CHUNK", 1)  # early modules: the build waits on threads
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w = rng.standard_normal((24, 32)).astype(np.float32) / 5
    seen, building = [], []
    real = jit.object_codes

    def object_codes(*a, **k):  # the build threads' start and wait, the pending tasks between
        building.append(True)
        try:
            return real(*a, **k)
        finally:
            building.pop()

    monkeypatch.setattr(jit, "object_codes", object_codes)

    def watch(phase, info):
        if phase == "stop":
            seen.append((gc.isenabled(), info["generation"], bool(building)))

    gc.callbacks.append(watch)
    try:
        for got, want in zip(kn.compile(many_kernels)(x, w), oracle(x, w)):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
        during = [s for s in seen if not s[0]]  # collections while kiln's pause was on
        assert during and during[0][1] == 0 and during[0][2]
        seen.clear()
        gc.disable()  # the user's choice: kiln collects nothing
        monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "other"))  # a cold compile again
        kn.compile(lambda a, b: many_kernels(a, b))(x, w)
        assert seen == []
    finally:
        gc.callbacks.remove(watch)
