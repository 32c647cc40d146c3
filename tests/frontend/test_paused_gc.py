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
