"""The runtime owns threading: how many CPUs this process may use, kiln's intra-op thread
count (`kn.set_num_threads` / `kn.get_num_threads`, as torch's), and the BLAS library's
thread count.

Why: numpy's OpenBLAS starts one thread per core and busy-waits between calls. Next to
kiln's own worker pool, or on a machine where another process holds cores, those threads
fight: a batched small `np.matmul` measured 0.5 s with OpenBLAS's default threads and
0.25 ms with one (issue 22). So kiln sizes its pool to the CPUs the process may really
use (affinity mask and cgroup CPU quota, not `os.cpu_count()`), keeps BLAS at one thread
inside its parallel regions and for small or batched products, and lets the user set
both with one call. No environment variable is needed.

    >>> kn.get_num_threads()         # CPUs this process may use (affinity, cgroup quota)
    >>> kn.set_num_threads(1)        # kiln's kernels and BLAS: one thread each
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from functools import lru_cache

from kiln.errors import KilnArgumentError

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


# -- how many CPUs the process may use ------------------------------------------------

def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` text ("QUOTA PERIOD", QUOTA "max" when
    unlimited); None when unlimited or unreadable.

    >>> parse_cpu_max("150000 100000")   # 1.5
    """
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpu_quota() -> float | None:
    """This process's cgroup CPU quota in CPUs (v2 `cpu.max`, else v1 cfs files)."""
    text = _read(CGROUP_V2_CPU_MAX)
    if text is not None:
        return parse_cpu_max(text)
    quota, period = _read(CGROUP_V1_QUOTA), _read(CGROUP_V1_PERIOD)
    if quota is None or period is None:
        return None
    return parse_cpu_max(f"{quota.strip()} {period.strip()}".replace("-1 ", "max "))


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (`taskset`, `os.sched_setaffinity`)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def available_cpus(quota: float | None = None, affinity: int | None = None) -> int:
    """CPUs the process may use: its affinity mask capped by the cgroup quota (rounded
    up: a 1.5-CPU quota runs 2 threads at 75%). Arguments override the live readings."""
    cpus = affinity_cpus() if affinity is None else affinity
    quota = cgroup_cpu_quota() if quota is None else quota
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


# -- the BLAS library's threads ---------------------------------------------------------

@lru_cache(maxsize=None)
def _openblas():
    """(set, get) of numpy's bundled OpenBLAS thread count, or None (no OpenBLAS)."""
    from kiln.codegen.cpu.jit import find_openblas

    path = find_openblas()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for suffix in ("64_", ""):  # scipy-openblas64 (numpy >= 2) and plain builds
        setter = getattr(lib, f"scipy_openblas_set_num_threads{suffix}", None)
        getter = getattr(lib, f"scipy_openblas_get_num_threads{suffix}", None)
        if setter is None:
            setter = getattr(lib, f"openblas_set_num_threads{suffix}", None)
            getter = getattr(lib, f"openblas_get_num_threads{suffix}", None)
        if setter is not None and getter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], None
            getter.argtypes, getter.restype = [], ctypes.c_int
            return setter, getter
    return None


def blas_num_threads() -> int | None:
    """The BLAS library's current thread count (None: no controllable BLAS found)."""
    lib = _openblas()
    return None if lib is None else int(lib[1]())


def set_blas_num_threads(n: int) -> None:
    """Set the BLAS library's thread count (no-op without a controllable BLAS)."""
    lib = _openblas()
    if lib is not None:
        lib[0](int(n))


_blas_lock = threading.Lock()
_blas_depth = 0  # nested/concurrent single-thread regions: the outermost restores
_blas_saved: int | None = None


class _BlasSingleThread:
    """The context `blas_single_thread()` returns: a class rather than a generator, as it
    runs around every BLAS call kiln makes (~1 us less per call than contextlib's)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _blas_depth, _blas_saved
        with _blas_lock:
            if _blas_depth == 0:
                current = blas_num_threads()
                _blas_saved = current
                if current is not None and current != 1:
                    set_blas_num_threads(1)
            _blas_depth += 1

    def __exit__(self, *exc) -> None:
        global _blas_depth, _blas_saved
        with _blas_lock:
            _blas_depth -= 1
            if _blas_depth == 0:
                if _blas_saved is not None and _blas_saved != 1:
                    set_blas_num_threads(_blas_saved)
                _blas_saved = None


_BLAS_SINGLE_THREAD = _BlasSingleThread()


def blas_single_thread() -> _BlasSingleThread:
    """BLAS runs on one thread inside the block (kiln's parallel regions, small and
    batched products); the count in force before is restored when the last such block
    on any thread exits.

    >>> with blas_single_thread(): ...
    """
    return _BLAS_SINGLE_THREAD


# -- kiln's intra-op thread count -------------------------------------------------------

_num_threads: int | None = None  # None: available_cpus(), read once


def get_num_threads() -> int:
    """Threads kiln's CPU kernels split a large launch over (caller + pool workers), as
    `torch.get_num_threads()`: by default the CPUs this process may use.

    >>> kn.get_num_threads()
    """
    global _num_threads
    if _num_threads is None:
        _num_threads = available_cpus()
        limit_blas_to_quota()
    return _num_threads


def set_num_threads(n: int) -> None:
    """Use `n` threads for kiln's CPU kernels and the BLAS library, as
    `torch.set_num_threads`. Kernels already compiled split over at most `n`; kernels
    compiled afterwards default to `n`.

    >>> kn.set_num_threads(1)   # e.g. one process per core
    """
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KilnArgumentError(f"set_num_threads: n must be a positive int, got {n!r}",
                                hint="kn.set_num_threads(2)")
    _num_threads = n
    with _blas_lock:
        if _blas_depth == 0:
            set_blas_num_threads(n)
        else:  # inside a single-thread region: applied when it ends
            global _blas_saved
            _blas_saved = n


def limit_blas_to_quota() -> None:
    """When the count is first read: OpenBLAS counts the affinity mask but not a cgroup quota, so on a
    quota-limited container it would start more threads than the process may run."""
    quota = cgroup_cpu_quota()
    if quota is not None and math.ceil(quota) < affinity_cpus():
        current = blas_num_threads()
        if current is not None and current > get_num_threads():
            set_blas_num_threads(get_num_threads())


# -- sharing the machine: threads for the next parallel region ------------------------
# A region split over n threads waits at its end for all of them. When other processes
# keep cores busy, a thread of kiln's waits for a core for a scheduler time slice (ms)
# while the region's work is a fraction of that: a 0.3 ms kernel split over 2 threads
# took 6-8 ms (median) at load 9 on 2 CPUs. So, as GNU OpenMP's dynamic mode
# (OMP_DYNAMIC, which subtracts the load average), a region uses the CPUs that other
# processes left idle: measured from /proc/stat (all CPUs' busy time) minus this
# process's own CPU time (os.times), over the last quarter second.

REFRESH_S = 0.25  # how often the busy time of other processes is sampled
STALE_S = 1.0  # a sample older than this is a new baseline, not a window
_dynamic = os.environ.get("KILN_DYNAMIC_THREADS", "1") != "0"
_load_lock = threading.Lock()
_sample: tuple[float, float, float] | None = None  # (monotonic s, busy s of all CPUs, own s)
_others = 0.0  # CPUs other processes kept busy over the last window


def _busy_seconds() -> float | None:
    """Busy time of all CPUs since boot, in seconds (/proc/stat), or None (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != b"cpu":
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _clock_ticks()


@lru_cache(maxsize=None)
def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100


def others_busy_cpus() -> float:
    """CPUs that other processes kept busy over the last sampled window (about
    REFRESH_S); 0.0 where it cannot be measured. Cheap: samples at most every REFRESH_S."""
    global _sample, _others
    now = time.monotonic()
    last = _sample
    if last is not None and now - last[0] < REFRESH_S:
        return _others
    if not _load_lock.acquire(blocking=False):  # another thread is sampling
        return _others
    try:
        busy = _busy_seconds()
        if busy is None:
            return 0.0
        times = os.times()
        own = times.user + times.system
        if last is not None and now - last[0] < STALE_S:
            window = now - last[0]
            _others = max(0.0, ((busy - last[1]) - (own - last[2])) / window)
        _sample = (now, busy, own)
        return _others
    finally:
        _load_lock.release()


def threads_beside(others: float, threads: int, cpus: int) -> int:
    """Threads for a region: at most `threads`, no more than the `cpus` that `others`
    (CPUs busy with other processes) leave, rounded to the nearest, at least 1.

    >>> threads_beside(1.0, 2, 2)   # a busy process on one of two CPUs: 1
    """
    return max(1, min(threads, math.floor(cpus - others + 0.5)))


@lru_cache(maxsize=None)
def _online_cpus() -> int | None:
    """os.cpu_count(), read once: it reads sysfs (~2 us), and this is on every split
    launch's path."""
    return os.cpu_count()


def parallel_threads() -> int:
    """Threads kiln's next parallel region uses: `get_num_threads()`, fewer while other
    processes keep CPUs busy (see above; `set_dynamic_threads(False)` turns that off), and
    one during a back-off (`back_off`)."""
    n = get_num_threads()
    if n <= 1 or not _dynamic:
        return n
    if _backoff_until and time.monotonic() < _backoff_until:
        return 1
    beside = threads_beside(others_busy_cpus(), n, _online_cpus() or n)
    return n if beside < n and _idle_now() else beside


# The busy time above is a window's: it says what other processes did in the last quarter
# second, not what they do now. Processes that take turns with this one (a benchmark's
# implementations in persistent processes, a data loader between steps) leave a window
# that reads "busy" right after they stopped: a process whose turn came just after
# another's 0.15 s burst got one thread for the next 0.25 s, on an idle machine
# (bench_train's large MLP ran its steps at one thread: 55 against 28 ms). So where the
# window would take threads away, the machine is looked at as it is: no other task
# runnable at this instant (/proc/loadavg's running count is the caller alone) gives
# back every thread for IDLE_NOW_S; a core taken after that shows in the next window,
# and a split that waits for one backs off (`back_off`).
IDLE_NOW_S = 0.05  # how long an instant with no other runnable task is trusted
LOOK_S = 0.005  # the machine is looked at most this often
_idle_until = 0.0
_looked_at = 0.0


def _runnable_now() -> int | None:
    """Tasks runnable on the machine at this instant, the caller included (/proc/loadavg's
    fourth field), or None where it cannot be read."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _idle_now() -> bool:
    """No task but the caller runnable now, or seen so within the last IDLE_NOW_S."""
    global _idle_until, _looked_at
    now = time.monotonic()
    if now < _idle_until:
        return True
    if now - _looked_at < LOOK_S:
        return False
    _looked_at = now
    running = _runnable_now()
    if running is not None and running <= 1:
        _idle_until = now + IDLE_NOW_S
        return True
    return False


# Load comes in bursts shorter than the sampling window: a region that started while the
# CPUs looked idle then waits a time slice (ms) for a thread whose core another process
# took. A split that took several times its best time says so at once: regions run on
# one thread for BACKOFF_S (kiln/codegen/cpu/split_rule.py reports it).
BACKOFF_S = 0.5
_backoff_until = 0.0


def back_off(seconds: float = BACKOFF_S) -> None:
    """Parallel regions use one thread for the next `seconds` (dynamic threads only)."""
    global _backoff_until
    _backoff_until = time.monotonic() + seconds


def backing_off() -> bool:
    """Are parallel regions backing off now (`back_off`: a split just waited for a core)?"""
    return bool(_backoff_until) and time.monotonic() < _backoff_until


def set_dynamic_threads(enabled: bool) -> None:
    """Whether parallel regions give up threads while other processes keep CPUs busy
    (on by default; the environment variable KILN_DYNAMIC_THREADS=0 turns it off)."""
    global _dynamic
    _dynamic = bool(enabled)


def dynamic_threads() -> bool:
    return _dynamic


# -- which launches split -----------------------------------------------------------------
# Splitting a launch pays a region's fixed cost (waking the team, the join) and moves its
# data to another core's cache; on this project's 2-CPU machines that measured 10-60 us a
# launch, as much as a 32K-element kernel takes on one thread. So by default a launch the
# cost model calls large enough is not split on trust: its first calls run serial and
# split alternately, timed, and it splits from then on only where splitting was faster
# (kiln/codegen/cpu/split_rule.py). "always" splits every such launch (the model alone),
# "never" none; KILN_SPLIT sets the policy a process starts with.

SPLIT_POLICIES = ("measure", "always", "never")
_split_policy = os.environ.get("KILN_SPLIT", "measure")
if _split_policy not in SPLIT_POLICIES:
    _split_policy = "measure"


def set_split_policy(policy: str) -> None:
    """How kiln decides to split a launch over threads: "measure" (the default: time the
    first calls serial and split, keep the faster), "always" (every launch the cost model
    calls large enough) or "never".

    >>> set_split_policy("always")
    """
    global _split_policy
    if policy not in SPLIT_POLICIES:
        raise KilnArgumentError(f"set_split_policy: policy must be one of {', '.join(SPLIT_POLICIES)}, "
                                f"got {policy!r}", hint='set_split_policy("measure")')
    _split_policy = policy


def split_policy() -> str:
    return _split_policy

