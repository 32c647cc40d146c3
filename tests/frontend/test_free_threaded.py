"""The free-threaded guard (issue 21): on a Python built without the GIL and running
with it off, `kn.compile`, `kn.export` and `kn.load` raise K320 at the call, and eager
mode works. The build is simulated: `Py_GIL_DISABLED` in sysconfig and
`sys._is_gil_enabled()`, the two things a real free-threaded CPython reports."""

import sys
import sysconfig

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.gil_guard import KilnFreeThreadedError, gil_disabled_build, gil_enabled_now

X = np.arange(6, dtype=np.float32)


def f(x):
    return kn.exp(x) * 2


def _simulate(monkeypatch, gil_on: bool):
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: 1 if name == "Py_GIL_DISABLED" else real(name))
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: gil_on, raising=False)


def test_this_interpreter_is_reported_as_it_is():
    assert gil_disabled_build() == bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    if not gil_disabled_build():
        assert gil_enabled_now()


def test_compile_export_and_load_refuse_a_free_threaded_build_at_the_call(monkeypatch, tmp_path):
    path = tmp_path / "f.kir"
    kn.export(f, (X,)).save(str(path))  # written before the build is simulated
    _simulate(monkeypatch, gil_on=False)
    calls = [
        ("kn.compile", lambda: kn.compile(f)),  # the call itself, before any run
        ("kn.compile", lambda: kn.compile(backend="cpu")),  # the decorator form too
        ("kn.export", lambda: kn.export(f, (X,))),
        ("kn.load", lambda: kn.load(str(path))),
    ]
    for what, call in calls:
        with pytest.raises(KilnFreeThreadedError) as info:
            call()
        err = info.value
        assert err.code == "K320" and isinstance(err, kn.KilnError)
        assert what in str(err) and "free-threaded" in str(err)
        assert "PYTHON_GIL=1" in str(err) and "eager mode" in str(err)
    # eager mode keeps working, with the same answer as numpy
    np.testing.assert_allclose(f(kn.tensor(X)).numpy(), np.exp(X) * 2, rtol=1e-6)


def test_a_module_is_refused_too(monkeypatch):
    _simulate(monkeypatch, gil_on=False)
    with pytest.raises(KilnFreeThreadedError):
        kn.compile(kn.nn.Linear(3, 2, seed=0))


def test_a_free_threaded_build_with_the_gil_turned_back_on_compiles(monkeypatch):
    _simulate(monkeypatch, gil_on=True)
    np.testing.assert_allclose(kn.compile(f)(X).numpy(), np.exp(X) * 2, rtol=1e-6)
