"""A cold compile's LLVM build started while the program is being lowered
(cpu/stream_build.py): early modules start on build threads before `build_program`
returns, the payload holds them and the rest, and the compiled program answers like
numpy, cold and from the whole-program cache; a stream fed other kernels than the
program's builds the plain way."""

import threading

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import build_program as bp
from kiln.codegen import cache_elf
from kiln.codegen.cpu import jit, parallel_build, stream_build
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.frontend import program_cache
from kiln.frontend.graph_compile import compile_graph

from tests.codegen.test_cpu_parallel_build import many_kernels, oracle


@pytest.fixture
def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w = rng.standard_normal((24, 32)).astype(np.float32) / 5
    return x, w


@pytest.fixture
def stats(monkeypatch):
    for k in program_cache.STATS:
        monkeypatch.setitem(program_cache.STATS, k, 0)
    return program_cache.STATS


def test_llvm_starts_while_lowering_and_the_program_runs(data, stats, monkeypatch):
    x, w = data
    if CpuBackend().options.threads < 2:
        pytest.skip("one kiln thread on this machine: no build threads to start early")
    monkeypatch.setattr(stream_build, "CHUNK", 1)  # every kernel is a chunk's worth
    lowering = threading.Event()
    real_build_program = bp.build_program

    def watched(*a, **k):
        lowering.set()
        try:
            return real_build_program(*a, **k)
        finally:
            lowering.clear()

    import kiln.codegen.build_program as module

    monkeypatch.setattr(module, "build_program", watched)
    started, payloads = [], []
    real_init = jit.Build.__init__

    def spy(self, *a, **k):
        started.append(lowering.is_set())
        real_init(self, *a, **k)

    monkeypatch.setattr(jit.Build, "__init__", spy)
    real_store = program_cache.store
    monkeypatch.setattr(program_cache, "store",
                        lambda key, text, names, blob, *a: payloads.append(blob) or real_store(key, text, names, blob, *a))
    for got, want in zip(kn.compile(many_kernels)(x, w), oracle(x, w)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    assert stats["stores"] == 1 and started[0] and sum(started) >= 1
    parts = cache_elf.unpack_objects(payloads[0])
    assert len(parts) == len(started) >= 2  # the early modules and the rest, one object each
    for got, want in zip(kn.compile(many_kernels)(x, w), oracle(x, w)):  # a new compile: the entry
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    assert stats["hits"] == 1


def test_a_small_program_is_built_as_before(data, monkeypatch):
    """Under one chunk nothing starts early: the payload is the plain build's, byte for byte."""
    x, w = data
    monkeypatch.setattr(stream_build, "CHUNK", 10**9)
    backend = CpuBackend(CpuOptions(threads=2))
    stream = stream_build.StreamingBuild(backend)
    program = bp.build_program(compile_graph(kn.trace(many_kernels, x, w), "cpu", build=False).optimized,
                               sink=stream.add)
    kernels = [backend.legalize(k) for k in program.kernels.values()]
    assert stream.builds == [] and len(stream.unique) <= len(kernels)
    assert stream.finish(kernels) == backend.build_object_code(kernels)


def test_a_stream_fed_other_kernels_builds_the_plain_way(data, monkeypatch):
    x, w = data
    monkeypatch.setattr(stream_build, "CHUNK", 1)
    backend = CpuBackend(CpuOptions(threads=2))
    program = compile_graph(kn.trace(many_kernels, x, w), "cpu", build=False).program
    kernels = [backend.legalize(k) for k in program.kernels.values()]
    stream = stream_build.StreamingBuild(backend)
    for k in kernels[:2]:  # fed only some of them: an early module starts
        stream.add(k)
    assert stream.builds and not stream.matches(kernels)
    blob = stream.finish(kernels)
    assert blob == backend.build_object_code(kernels)
    from kiln.runtime.executor import Executable

    compiled = dict(zip(program.kernels, backend.load_object_code(kernels, blob)))
    for got, want in zip(Executable(program, compiled).run([x, w], {}), oracle(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_glue_is_readied_on_its_own_thread_before_the_build(data, monkeypatch):
    """For a large graph the stream starts the backend's native glue (native_pool.prepare)
    on a thread when it is made (a compile makes it before the graph passes); finish()
    waits for it while LLVM runs. A failing prepare leaves the build and its answers as
    they are. A small graph's stream starts no thread: the glue is built, as by the plain
    build, only while a build of several modules runs."""
    x, w = data
    backend = CpuBackend(CpuOptions(threads=2))
    program = compile_graph(kn.trace(many_kernels, x, w), "cpu", build=False).program
    kernels = [backend.legalize(k) for k in program.kernels.values()]
    from kiln.runtime.executor import Executable

    for fails in (False, True):
        seen, gate = [], threading.Event()

        def prepare():
            seen.append(threading.current_thread().name)
            gate.wait(30)  # held until the kernels are fed: the thread runs beside the caller
            if fails:
                raise RuntimeError("no glue here")

        stream = stream_build.StreamingBuild(backend, prepare, graph_nodes=stream_build.GLUE_NODES)
        for k in kernels:
            stream.add(k)
        assert stream.glue.is_alive()
        gate.set()
        blob = stream.finish(kernels)
        assert not stream.glue.is_alive() and seen == ["kiln-glue"]
        compiled = dict(zip(program.kernels, backend.load_object_code(kernels, blob)))
        for got, want in zip(Executable(program, compiled).run([x, w], {}), oracle(x, w)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(stream_build, "CHUNK", 10**9)  # no early module: the plain build
    for parts in (1, 2):
        monkeypatch.setattr(parallel_build, "MIN_PART_CHARS", 10**9 if parts == 1 else 1)
        ran = []
        small = stream_build.StreamingBuild(backend, lambda: ran.append(1), graph_nodes=stream_build.GLUE_NODES - 1)
        assert small.glue is None
        for k in kernels:
            small.add(k)
        blob = small.finish(kernels)
        assert len(cache_elf.unpack_objects(blob)) == parts and ran == ([1] if parts > 1 else [])


def test_the_first_early_module_is_a_third_of_a_chunk(data, monkeypatch):
    """LLVM starts once the emitted kernels reach CHUNK // FIRST_SHARE (the other core is
    idle until then), later modules at CHUNK; the payload answers like numpy."""
    x, w = data
    backend = CpuBackend(CpuOptions(threads=2))
    program = compile_graph(kn.trace(many_kernels, x, w), "cpu", build=False).program
    kernels = [backend.legalize(k) for k in program.kernels.values()]
    probe = stream_build.StreamingBuild(backend)
    probe.add(kernels[0])
    first = probe.costs[0]
    probe.finish(kernels[:1])
    monkeypatch.setattr(stream_build, "CHUNK", first * stream_build.FIRST_SHARE)  # one kernel: a first module
    stream = stream_build.StreamingBuild(backend)
    stream.add(kernels[0])
    assert len(stream.builds) == 1 and stream.sent == 1
    for k in kernels[1:]:
        stream.add(k)
    blob = stream.finish(kernels)
    from kiln.runtime.executor import Executable

    compiled = dict(zip(program.kernels, backend.load_object_code(kernels, blob)))
    for got, want in zip(Executable(program, compiled).run([x, w], {}), oracle(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
