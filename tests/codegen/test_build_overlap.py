"""Python work run while LLVM's build threads compile (kiln/codegen/build_overlap.py): a
pending task runs once, on the compiling thread, while the build threads are alive; its
error reaches its owner, never the build; a build's own error surfaces as before; the
whole-program cache entry made that way is the one a later compile loads; a program
the entry format cannot hold has its machine code found by the next compile."""

import threading

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import build_overlap, program_codec
from kiln.codegen.build_overlap import Deferred, meanwhile
from kiln.codegen.cpu import jit, parallel_build
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.frontend import program_cache
from kiln.frontend.graph_compile import compile_graph

GOOD = "define i32 @f(i32 %x) {\n  %y = add i32 %x, 1\n  ret i32 %y\n}\n"


def build_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kiln-llvm")]


def test_a_deferred_runs_once_and_keeps_its_error_for_result():
    calls = []
    task = Deferred(lambda: calls.append(1) or len(calls))
    task.run()
    task.run()
    assert task.result() == 1 and calls == [1] and task.done
    failing = Deferred(lambda: 1 / 0)
    failing.run()  # the error is kept, not raised here
    with pytest.raises(ZeroDivisionError):
        failing.result()
    assert Deferred(lambda: 7).result() == 7  # never run by a build: run by result()


def test_a_pending_task_runs_while_the_modules_compile(monkeypatch):
    # the builds wait (bounded) for the task before compiling: two tiny modules would
    # otherwise be done before a loaded machine schedules the waiting thread again
    compile_alone, released = jit._compile_alone, threading.Event()

    def held(text, opt_level):
        released.wait(30)
        return compile_alone(text, opt_level)

    monkeypatch.setattr(jit, "_compile_alone", held)
    seen = []
    task = Deferred(lambda: seen.append(build_threads()) or released.set() or "entry")
    with meanwhile(task):
        objects = jit.object_codes([GOOD, GOOD.replace("@f", "@g")], 3)
    assert len(objects) == 2 and all(o[:4] == b"\x7fELF" for o in objects)
    assert task.done and task.result() == "entry"
    assert seen and seen[0]  # the build threads were there when it ran
    outside = Deferred(lambda: "later")
    jit.object_codes([GOOD, GOOD.replace("@f", "@g")], 3)  # nothing pending: nothing run
    assert not outside.done and outside.result() == "later"


def test_a_task_error_stays_with_its_owner_and_a_build_error_surfaces():
    bad = Deferred(lambda: {}["missing"])
    with meanwhile(bad):
        objects = jit.object_codes([GOOD, GOOD.replace("@f", "@g")], 3)
    assert len(objects) == 2 and bad.done
    with pytest.raises(KeyError):
        bad.result()
    task = Deferred(lambda: "ran")
    with meanwhile(task), pytest.raises(RuntimeError, match="parsing error"):
        jit.object_codes([GOOD, "define void @h() {\n  ret i32 0\n}\n"], 3)
    assert task.done and task.result() == "ran"


def test_a_task_that_builds_finds_nothing_pending():
    inner = []

    def nested():  # a build inside a task: no recursion into the pending tasks
        inner.append(jit.object_codes([GOOD, GOOD.replace("@f", "@g")], 3))
        return build_overlap._local.tasks

    task = Deferred(nested)
    with meanwhile(task):
        jit.object_codes([GOOD.replace("@f", "@p"), GOOD.replace("@f", "@q")], 3)
    assert task.result() == () and len(inner[0]) == 2
    assert getattr(build_overlap._local, "tasks", ()) == ()


def chain(x, w):
    h = kn.gelu(x @ w, approximate="tanh")
    return kn.softmax(h, dim=-1), (kn.exp(h) * kn.sin(h)).sum(dim=0)


def chain_oracle(x, w):
    z = x @ w
    h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True), (np.exp(h) * np.sin(h)).sum(0)


RNG = np.random.default_rng(5)
X = RNG.standard_normal((12, 16)).astype(np.float32)
W = (RNG.standard_normal((16, 24)) / 4).astype(np.float32)


def test_the_backends_parallel_build_runs_pending_work(monkeypatch):
    monkeypatch.setattr(parallel_build, "MIN_PART_CHARS", 1)  # split even a small program
    program = compile_graph(kn.trace(chain, X, W), "cpu", build=False).program
    backend = CpuBackend(CpuOptions(threads=2))
    kernels = list(program.kernels.values())
    seen = []
    task = Deferred(lambda: seen.append(build_threads()))
    with meanwhile(task):
        blob = backend.object_code(kernels)
    assert seen and seen[0]
    from kiln.runtime.executor import Executable

    compiled = dict(zip(program.kernels, backend.load_object_code(kernels, blob)))
    for got, want in zip(Executable(program, compiled).run([X, W], {}), chain_oracle(X, W)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_multithreaded_build_readies_the_openmp_glue_meanwhile(monkeypatch):
    from kiln.codegen.cpu import native_pool

    monkeypatch.setattr(parallel_build, "MIN_PART_CHARS", 1)  # split even a small program
    program = compile_graph(kn.trace(chain, X, W), "cpu", build=False).program
    kernels = list(program.kernels.values())
    seen = []
    real = native_pool.prepare
    monkeypatch.setattr(native_pool, "prepare", lambda: seen.append(build_threads()) or real())
    CpuBackend(CpuOptions(threads=2)).object_code(kernels)
    assert len(seen) == 1 and seen[0]  # once, while the build threads ran
    if native_pool.openmp_runtime() is not None:
        assert native_pool.usable()  # ready: the first split launch builds nothing
    CpuBackend(CpuOptions(threads=1)).object_code(kernels)  # never splits: no glue wanted
    assert len(seen) == 1


@pytest.fixture
def stats(monkeypatch):
    for k in program_cache.STATS:
        monkeypatch.setitem(program_cache.STATS, k, 0)
    return program_cache.STATS


def test_entry_made_during_the_build_is_loaded_by_the_next_compile(stats, monkeypatch):
    from kiln.codegen.backends import get_backend

    monkeypatch.setattr(parallel_build, "MIN_PART_CHARS", 1)  # split even a small program
    llvm, during = [], []
    for name in ("optimize", "_compile_alone"):
        real = getattr(jit, name)
        monkeypatch.setattr(jit, name, lambda *a, _real=real: llvm.append(1) or _real(*a))
    encode = program_cache.encode
    monkeypatch.setattr(program_cache, "encode", lambda p: during.append(build_threads()) or encode(p))
    for got, want in zip(kn.compile(chain)(X, W), chain_oracle(X, W)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    assert stats["stores"] == 1 and llvm and len(during) == 1
    if get_backend("cpu").options.threads > 1:  # several modules: encoded while they compile
        assert during[0]
    llvm.clear()
    for got, want in zip(kn.compile(chain)(X, W), chain_oracle(X, W)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    assert stats["hits"] == 1 and llvm == [] and len(during) == 1


def test_an_uncacheable_program_finds_its_machine_code_next_time(stats, monkeypatch):
    def refuse(program):
        raise program_codec.CodecError("program codec: cannot store a value of type test")

    monkeypatch.setattr(program_codec, "encode_program", refuse)
    llvm = []
    for name in ("optimize", "_compile_alone"):
        real = getattr(jit, name)
        monkeypatch.setattr(jit, name, lambda *a, _real=real: llvm.append(1) or _real(*a))
    for got, want in zip(kn.compile(chain)(X, W), chain_oracle(X, W)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    assert stats["uncacheable"] == 1 and stats["stores"] == 0 and llvm
    llvm.clear()
    for got, want in zip(kn.compile(chain)(X, W), chain_oracle(X, W)):  # lowered, not built
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    assert llvm == [] and stats["misses"] == 2
