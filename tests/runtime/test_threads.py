"""The runtime owns threading (issue 22): the pool follows the affinity mask and the cgroup
quota, kn.set_num_threads changes how launches split, BLAS is one thread inside kiln's
parallel regions and for batched products."""

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import compiled as cc
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.codegen.cpu.jit import find_openblas
from kiln.codegen.kernel_ir import IN, OUT, BufferParam, Kernel, Load, Loop, Store, loop_var
from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol
from tests.codegen.ir_builders import op

B = symbol("B")
from kiln.runtime import threads


def _blas_getter():
    """numpy's OpenBLAS thread count, read with ctypes independently of kiln."""
    path = find_openblas()
    if path is None:
        pytest.skip("numpy is not built with its bundled OpenBLAS")
    lib = ctypes.CDLL(path)
    getter = getattr(lib, "scipy_openblas_get_num_threads64_", None) \
        or getattr(lib, "openblas_get_num_threads", None)
    getter.restype = ctypes.c_int
    return getter


@pytest.fixture
def restore_threads():
    before = kn.get_num_threads()
    blas = threads.blas_num_threads()
    yield
    kn.set_num_threads(before)
    if blas is not None:
        threads.set_blas_num_threads(blas)


def test_cpu_max_text_is_parsed():
    assert threads.parse_cpu_max("max 100000\n") is None
    assert threads.parse_cpu_max("150000 100000\n") == 1.5
    assert threads.parse_cpu_max("50000 100000") == 0.5
    assert threads.parse_cpu_max("garbage") is None
    assert threads.parse_cpu_max("0 100000") is None


def test_available_cpus_is_the_affinity_capped_by_the_quota():
    assert threads.available_cpus(quota=1.5, affinity=8) == 2
    assert threads.available_cpus(quota=0.5, affinity=8) == 1
    assert threads.available_cpus(quota=16.0, affinity=3) == 3
    assert threads.available_cpus(quota=threads.parse_cpu_max("300000 100000"), affinity=64) == 3


_CHILD = """
import os, sys
os.sched_setaffinity(0, {cpu})
import kiln as kn
from kiln.codegen.cpu.compiled import default_threads
print(kn.get_num_threads(), default_threads())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_pool_size_follows_the_affinity_mask():
    cpu = sorted(os.sched_getaffinity(0))[0]
    out = subprocess.run([sys.executable, "-c", _CHILD.format(cpu={cpu})], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def _tanh_kernel():
    i0, i1 = loop_var("i0"), loop_var("i1")
    y = op("tanh", Load("x", 64 * i0 + i1, dt.float32))
    return Kernel("tanh64", (BufferParam("x", dt.float32, (B, 64), IN),
                             BufferParam("y", dt.float32, (B, 64), OUT)),
                  ("B",), (Loop("i0", B), Loop("i1", 64)), (Store("y", 64 * i0 + i1, y),))


@pytest.fixture
def pool_runs(monkeypatch):
    """The range lists of every parallel launch, in order: on kiln's pool, or over OpenMP
    threads from native code (the same cut, `compiled.split`). Every launch the model
    calls large splits (policy "always"; test_cpu_split_rule.py tests the measured one)."""
    monkeypatch.setattr(threads, "_split_policy", "always")
    seen = []
    original = cc.WorkerPool.run
    native = cc.parallel_for()

    def run(self, fn, bufs, sizes, ranges):
        seen.append(list(ranges))
        return original(self, fn, bufs, sizes, ranges)

    def native_run(entry, bufs, sizes, total, align, threads):
        seen.append(cc.split(total, threads, align))
        return native(entry, bufs, sizes, total, align, threads)

    monkeypatch.setattr(cc.WorkerPool, "run", run)
    if native is not None:
        monkeypatch.setattr(cc, "parallel_for", lambda: native_run)
    return seen


def test_set_num_threads_changes_how_a_launch_splits(pool_runs, restore_threads):
    kn.set_num_threads(2)
    kernel = CpuBackend(CpuOptions(threads=2, parallel_threshold=1)).compile(_tanh_kernel())
    x = np.random.default_rng(0).standard_normal((512, 64)).astype(np.float32)
    want = np.tanh(x.astype(np.float64)).astype(np.float32)
    for n, splits in ((2, [2]), (1, [])):
        kn.set_num_threads(n)
        pool_runs.clear()
        y = np.empty_like(x)
        kernel([x, y], {"B": 512})
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
        assert [len(r) for r in pool_runs] == splits, (n, pool_runs)
    assert CpuOptions().threads == 1  # options made now default to the set count


def test_set_num_threads_rejects_bad_counts():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(KilnArgumentError, match="set_num_threads"):
            kn.set_num_threads(bad)


def test_set_num_threads_sets_blas_threads(restore_threads):
    getter = _blas_getter()
    kn.set_num_threads(1)
    assert getter() == 1
    kn.set_num_threads(2)
    assert getter() == 2


def test_blas_is_one_thread_inside_a_parallel_region(restore_threads):
    getter = _blas_getter()
    kn.set_num_threads(2)
    assert getter() == 2
    seen = []

    def body(bufs, sizes, lo, hi):  # stands in for a kernel: what does each range see?
        seen.append((threading.current_thread().name, getter(), lo, hi))

    cc.pool(2).run(body, None, None, [(0, 5), (5, 10)])
    assert sorted(s[2:] for s in seen) == [(0, 5), (5, 10)]
    assert [s[1] for s in seen] == [1, 1]
    assert any(name.startswith("kiln-cpu-") for name, *_ in seen)  # a worker took a range
    assert getter() == 2  # restored after the region


def test_one_pool_is_shared_and_grows():
    p = cc.pool(2)
    assert cc.pool(1) is p and cc.pool(2) is p
    n = p.size
    assert cc.pool(n + 2) is p and p.size == n + 1  # n + 2 threads: the caller + n + 1 workers
    assert sum(t.name.startswith("kiln-cpu-") for t in threading.enumerate()) == p.size


def test_blas_single_thread_nests_and_restores(restore_threads):
    getter = _blas_getter()
    kn.set_num_threads(2)
    with threads.blas_single_thread():
        assert getter() == 1
        with threads.blas_single_thread():
            assert getter() == 1
        assert getter() == 1
        kn.set_num_threads(2)  # applied when the region ends
        assert getter() == 1
    assert getter() == 2


@pytest.fixture
def blas_seen(monkeypatch):
    """The BLAS thread count seen inside every kiln single-thread BLAS region."""
    getter = _blas_getter()
    seen = []
    original = cc.blas_single_thread

    @contextlib.contextmanager
    def recording():
        with original():
            seen.append(getter())
            yield

    monkeypatch.setattr(cc, "blas_single_thread", recording)
    return seen


def test_batched_gemm_matches_numpy_and_restores_blas(blas_seen, restore_threads):
    getter = _blas_getter()
    kn.set_num_threads(2)
    seen = blas_seen
    rng = np.random.default_rng(1)
    # float64: the cost model gives small float32 products to kiln's micro-kernel, which
    # calls no BLAS and so sets no BLAS threads; float64 ones stay with BLAS
    a = rng.standard_normal((16, 32, 256))
    b = rng.standard_normal((16, 256, 64))
    f = kn.compile(lambda a, b: a @ b)
    out = f(kn.tensor(a), kn.tensor(b)).numpy()
    np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-10, atol=1e-10)
    assert seen and set(seen) == {1}  # the batched BLAS GEMM ran with one BLAS thread
    assert getter() == 2


@pytest.fixture
def claims(monkeypatch):
    """(total, unit, threads) of every claimed split (a GEMM's batch items or panels), on
    OpenMP threads or, without libgomp, as kiln's pool's claimed ranges."""
    seen = []
    native = cc.parallel_claim()
    real = cc.WorkerPool.run_claimed

    def pooled(self, fn, bufs, sizes, ranges, n):
        seen.append((ranges[-1][1], ranges[0][1] - ranges[0][0], n))
        return real(self, fn, bufs, sizes, ranges, n)

    monkeypatch.setattr(cc.WorkerPool, "run_claimed", pooled)
    if native is not None:
        monkeypatch.setattr(cc, "parallel_claim", lambda: lambda *a: (seen.append(a[3:]), native(*a)))
    return seen


@pytest.mark.parametrize("policy", ["measure", "always"])
def test_a_large_batched_gemm_is_split_by_whole_items(claims, policy, restore_threads, monkeypatch):
    """(32,64,128)x(32,128,64): 2^24 multiply-adds, split from its first call whatever the
    measurement; (4,32,128)x(4,128,64): 2^20, a candidate the measurement decides (its
    first call runs serial), split at once when the policy is "always"."""
    monkeypatch.setattr(threads, "_split_policy", policy)
    rng = np.random.default_rng(2)
    f = kn.compile(lambda a, b: a @ b)
    for batch, m, splits in ((32, 64, True), (4, 32, policy == "always")):
        a = rng.standard_normal((batch, m, 128)).astype(np.float32)
        b = rng.standard_normal((batch, 128, 64)).astype(np.float32)
        for n in (2, 1):
            kn.set_num_threads(n)
            claims.clear()
            out = f(kn.tensor(a), kn.tensor(b)).numpy()
            np.testing.assert_allclose(out, np.matmul(a.astype(np.float64), b), rtol=1e-4, atol=1e-4)
            if splits and n == 2:
                (total, unit, used), = claims
                assert total % batch == 0 and unit == total // batch and used == 2  # whole items
            else:
                assert claims == []


def test_cgroup_files_are_read_v2_then_v1(tmp_path, monkeypatch):
    v2, quota, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    monkeypatch.setattr(threads, "CGROUP_V2_CPU_MAX", str(v2))
    monkeypatch.setattr(threads, "CGROUP_V1_QUOTA", str(quota))
    monkeypatch.setattr(threads, "CGROUP_V1_PERIOD", str(period))
    assert threads.cgroup_cpu_quota() is None  # no files: no quota
    quota.write_text("-1\n")
    period.write_text("100000\n")
    assert threads.cgroup_cpu_quota() is None  # v1 unlimited
    quota.write_text("250000\n")
    assert threads.cgroup_cpu_quota() == 2.5
    v2.write_text("50000 100000\n")  # v2 wins when present
    assert threads.cgroup_cpu_quota() == 0.5


def test_the_pool_and_blas_follow_a_quota_below_the_affinity(tmp_path, monkeypatch, restore_threads):
    getter = _blas_getter()
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")  # one CPU's worth
    monkeypatch.setattr(threads, "CGROUP_V2_CPU_MAX", str(cpu_max))
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 4)
    threads.set_blas_num_threads(2)
    monkeypatch.setattr(threads, "_num_threads", None)  # as in a fresh process
    assert kn.get_num_threads() == 1
    assert cc.default_threads() == 1 and CpuOptions().threads == 1
    assert getter() == 1  # OpenBLAS counted the affinity mask, not the quota


@pytest.mark.parametrize("m,k,n", [(16, 32, 32), (512, 64, 192), (1024, 128, 128)])
def test_every_blas_gemm_kiln_calls_runs_on_one_blas_thread(m, k, n, blas_seen, restore_threads):
    """Small, mid-size (2^21..2^23 multiply-adds: the GPT step's products, which stalled
    at 256-404 ms a step on a loaded machine with OpenBLAS's own 2 threads) and large
    single products: BLAS sees one thread while kiln calls it, its count is restored after."""
    getter = _blas_getter()
    kn.set_num_threads(2)
    threads.set_blas_num_threads(2)
    seen = blas_seen
    rng = np.random.default_rng(4)
    a = rng.standard_normal((m, k))  # float64: small float32 products may take kiln's
    b = rng.standard_normal((k, n))  # micro-kernel (no BLAS call, no thread setting)
    f = kn.compile(lambda a, b: kn.relu(a @ b))
    out = f(kn.tensor(a), kn.tensor(b)).numpy()
    np.testing.assert_allclose(out, np.maximum(a @ b, 0), rtol=1e-10, atol=1e-10)
    assert seen and set(seen) == {1}
    assert getter() == 2


@pytest.fixture
def dynamic(monkeypatch):
    """Dynamic thread counts on, with the other processes' busy CPUs set by the test."""
    others = {"cpus": 0.0}
    monkeypatch.setattr(threads, "_dynamic", True)
    monkeypatch.setattr(threads, "others_busy_cpus", lambda: others["cpus"])
    # the instant agrees with the window: the caller plus the busy CPUs' tasks runnable
    monkeypatch.setattr(threads, "_runnable_now", lambda: 1 + round(others["cpus"]))
    monkeypatch.setattr(threads, "_idle_until", 0.0)
    monkeypatch.setattr(threads, "_looked_at", 0.0)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    return others


def test_threads_beside_other_load():
    assert threads.threads_beside(0.0, 2, 2) == 2
    assert threads.threads_beside(0.4, 2, 2) == 2  # mostly idle: keep both
    assert threads.threads_beside(0.6, 2, 2) == 1
    assert threads.threads_beside(1.0, 2, 2) == 1  # one of two CPUs taken: one thread
    assert threads.threads_beside(7.5, 2, 2) == 1  # never fewer than one
    assert threads.threads_beside(1.2, 8, 4) == 3
    assert threads.threads_beside(0.0, 2, 16) == 2  # never more than asked


def test_a_launch_gives_up_a_thread_to_a_busy_process(dynamic, pool_runs, restore_threads):
    kn.set_num_threads(2)
    kernel = CpuBackend(CpuOptions(threads=2, parallel_threshold=1)).compile(_tanh_kernel())
    x = np.random.default_rng(5).standard_normal((512, 64)).astype(np.float32)
    want = np.tanh(x.astype(np.float64)).astype(np.float32)
    for busy, splits in ((0.0, 1), (1.0, 0), (0.2, 1), (1.8, 0)):
        dynamic["cpus"] = busy
        pool_runs.clear()
        y = np.empty_like(x)
        kernel([x, y], {"B": 512})
        np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-6)
        assert len(pool_runs) == splits
    threads.set_dynamic_threads(False)  # off: the count ignores the load
    pool_runs.clear()
    kernel([x, np.empty_like(x)], {"B": 512})
    assert len(pool_runs) == 1


def test_a_window_busy_with_a_process_that_stopped_keeps_the_threads(dynamic, monkeypatch, restore_threads):
    """The window says another process kept a CPU busy, but nothing else is runnable now
    (it took its turn and stopped): every thread, trusted for IDLE_NOW_S; runnable again
    after that, the window's count."""
    kn.set_num_threads(2)
    monkeypatch.setattr(threads, "_backoff_until", 0.0)  # no back-off left by an earlier test
    clock = {"t": 100.0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["t"])
    running = {"n": 1}
    monkeypatch.setattr(threads, "_runnable_now", lambda: running["n"])
    dynamic["cpus"] = 1.0
    assert threads.parallel_threads() == 2  # only the caller runnable now
    running["n"] = 2
    clock["t"] += threads.IDLE_NOW_S / 2
    assert threads.parallel_threads() == 2  # the idle instant is still trusted
    clock["t"] += threads.IDLE_NOW_S
    assert threads.parallel_threads() == 1  # looked again: another task runnable
    running["n"] = None
    clock["t"] += threads.LOOK_S
    assert threads.parallel_threads() == 1  # unreadable: the window decides
    dynamic["cpus"] = 0.0
    assert threads.parallel_threads() == 2


def test_runnable_now_counts_the_caller():
    n = threads._runnable_now()
    assert n is None or n >= 1


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not os.path.exists("/proc/stat"),
                    reason="needs 2 CPUs and Linux's /proc/stat")
def test_a_busy_process_is_counted_and_this_process_is_not(monkeypatch):
    """A process spinning on one CPU makes others_busy_cpus() at least ~1 (more if the
    machine has other load), while this process's own spinning thread is not counted
    as someone else's (it is subtracted: it alone would read ~1)."""
    monkeypatch.setattr(threads, "_sample", None)
    spin = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        threads.others_busy_cpus()  # baseline
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # sleeps: this process is idle meanwhile
            time.sleep(0.05)
        seen = threads.others_busy_cpus()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert seen >= 0.5


def test_this_process_cpu_time_is_not_counted_as_others(monkeypatch):
    """others = (all CPUs' busy seconds - this process's CPU seconds) / window, sampled at
    most every REFRESH_S; a sample older than STALE_S only starts a new window."""
    clock = {"now": 100.0, "busy": 1000.0, "own": 10.0}
    monkeypatch.setattr(threads, "_sample", None)
    monkeypatch.setattr(threads, "_others", 0.0)
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(threads, "_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(threads.os, "times", lambda: os.times_result((clock["own"], 0.0, 0.0, 0.0, 0.0)))

    def advance(dt, busy, own):
        clock["now"] += dt
        clock["busy"] += busy
        clock["own"] += own
        return threads.others_busy_cpus()

    assert threads.others_busy_cpus() == 0.0  # the first sample is a baseline
    assert advance(0.5, 1.0, 0.5) == pytest.approx(1.0)  # 2 CPUs busy, one of them ours
    assert advance(0.5, 0.5, 0.5) == pytest.approx(0.0)  # all of it ours
    assert advance(0.1, 0.2, 0.0) == pytest.approx(0.0)  # within REFRESH_S: the last value
    assert advance(0.4, 0.8, 0.0) == pytest.approx(2.0)  # the 0.5 s since the last sample: 1.0 busy s
    assert advance(5.0, 1.0, 0.0) == pytest.approx(2.0)  # stale: a new baseline, value kept
    assert advance(0.5, 0.25, 0.0) == pytest.approx(0.5)


def test_only_kernels_that_call_blas_set_blas_threads(blas_seen):
    """kiln's micro-kernel calls no BLAS: it skips the BLAS thread setting (a 3-10 us
    toggle per call); the BLAS variant of the same product sets one thread around it."""
    from kiln.codegen.cpu import CpuBackend, CpuOptions
    from tests.codegen.cpu_helpers import make_arrays
    from tests.codegen.test_cpu_gemm import gemm

    backend = CpuBackend(CpuOptions())
    g = gemm(1, 16, 32, 24)
    for variant, calls_blas in (("micro", False), ("blas", True)):
        compiled = backend._compile_plans([backend._plan(g, set(), variant)])[0]
        assert compiled.calls_blas is calls_blas
        arrays = make_arrays(g, {}, np.random.default_rng(5), low=-1.0, high=1.0)
        blas_seen.clear()
        compiled(arrays, {})
        a, b = arrays[0][0].astype(np.float64), arrays[1][0].astype(np.float64)
        np.testing.assert_allclose(arrays[-1][0], a @ b, rtol=1e-5, atol=1e-5)
        assert blas_seen == ([1] if calls_blas else [])
