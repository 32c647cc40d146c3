"""Split one kernel launch over threads from native code: `parallel_for` (a static cut of
the range) and `parallel_claim` (units claimed from an atomic counter).

A launch split over kiln's Python `WorkerPool` hands the worker its range through a
queue and waits for it through another. Each hand-off needs the worker thread to take
the GIL, and back to back (a training step launches ~120 kernels) a round trip measured
85-120 us on this project's 2-vCPU machines, against 8 us after an idle pause: a
16384-element `exp` kernel took 15 us on one thread and 140 us split over two. Here one
ctypes call (the GIL released for its whole length) enters the split function, which
runs the kernel's raw entry on each share of [0, total), cut as the pool cuts it
(`compiled.split`: near-equal chunks, multiples of `align`) or claimed `unit` at a time.

Where the host has it (Linux), the split functions are kiln's own team
(`native_team.py`): a region's caller waits only for units that a thread claimed, so a
worker that sleeps, or whose core another process holds, never delays it. Elsewhere
they run `GOMP_parallel` (GNU OpenMP), whose join waits for every thread of the team;
libgomp's threads spin a short while between regions (`openmp_runtime` sets
GOMP_SPINCOUNT), so a step's consecutive launches find them awake, and sleep after it.
Without either, and in a child process forked after a libgomp region ran (its thread
pool does not survive `fork`: the child would wait for threads it does not have),
callers use the `WorkerPool`; a forked child starts a team of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from functools import lru_cache

import llvmlite.binding as llvm

from kiln.codegen.cpu import jit, native_team, native_team_ir
from kiln.runtime.threads import get_num_threads

# parallel_for(kernel entry, bufs, sizes, total, align, threads)
PARALLEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int32)

# the region's context: the kernel entry and its arguments, the range's end, the unit
# (the static cut's alignment, or the claim size) and the claim counter
_FIELDS = (("fn", "ptr"), ("bufs", "ptr"), ("sizes", "ptr"), ("total", "i64"), ("unit", "i64"),
           ("next", "i64"))


def _fields(verb: str) -> str:
    """IR that loads the context's fields in a region body ("load") or stores the entry's
    arguments into it ("store"; the counter starts at 0)."""
    lines = []
    for k, (name, ty) in enumerate(_FIELDS):
        lines.append(f"  %{name}.p = getelementptr %ctx, ptr %c, i32 0, i32 {k}")
        if verb == "store":
            lines.append(f"  store {ty} {'0' if name == 'next' else '%' + name}, ptr %{name}.p")
        elif name != "next":
            lines.append(f"  %{name} = load {ty}, ptr %{name}.p")
    return "\n".join(lines)


def _entry(name: str, body: str) -> str:
    """`void name(fn, bufs, sizes, total, unit, threads)`: one OpenMP region running `body`."""
    return f"""
define void @{name}(ptr %fn, ptr %bufs, ptr %sizes, i64 %total, i64 %unit, i32 %threads) {{
entry:
  %c = alloca %ctx
{_fields("store")}
  call void @GOMP_parallel(ptr @{body}, ptr %c, i32 %threads, i32 0)
  ret void
}}
"""


_GOMP_IR = f"""
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()

%ctx = type {{ ptr, ptr, ptr, i64, i64, i64 }}

; the static cut: thread t runs chunk t of near-equal chunks, multiples of `unit`
define internal void @share(ptr %c) {{
entry:
{_fields("load")}
  %tid32 = call i32 @omp_get_thread_num()
  %nt32 = call i32 @omp_get_num_threads()
  %tid = sext i32 %tid32 to i64
  %nt = sext i32 %nt32 to i64
{native_team_ir.cut_ir("%nt")}
{native_team_ir.range_ir("%tid", "%cut")}
done:
  ret void
}}

; the claimed cut: each thread takes the next `unit` points from the shared counter until
; none are left, so a thread that starts late (descheduled) takes fewer; for GEMM panels
; and batch items, whose work per unit is large and even
define internal void @claim(ptr %c) {{
entry:
{_fields("load")}
  br label %head
head:
  %lo = atomicrmw add ptr %next.p, i64 %unit monotonic
  %some = icmp slt i64 %lo, %total
  br i1 %some, label %run, label %done
run:
  %e = add i64 %lo, %unit
  %over = icmp sgt i64 %e, %total
  %hi = select i1 %over, i64 %total, i64 %e
  call void %fn(ptr %bufs, ptr %sizes, i64 %lo, i64 %hi)
  br label %head
done:
  ret void
}}
{_entry("kiln_parallel_for", "share")}{_entry("kiln_parallel_claim", "claim")}"""


@lru_cache(maxsize=None)
def openmp_runtime() -> str | None:
    """Load GNU OpenMP (libgomp) into LLVM's symbol space; its path, or None when the
    host has none (then split launches run through kiln's pool). KILN_CAPTURE_OPENMP=0
    turns it off."""
    if os.environ.get("KILN_CAPTURE_OPENMP", "1") == "0":
        return None
    # between regions a thread spins a while, then sleeps: forever-spinning threads steal
    # a busy machine's cores (10x slower loops seen on 2 loaded cores) and sleeping at once
    # costs a wake-up per region (a replayed 20-trip loop 1.5x slower than no capture);
    # about 0.1 ms of spinning keeps a loop's regions hot. The user's settings win.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "100000")
    for name in ("libgomp.so.1", ctypes.util.find_library("gomp")):
        if not name:
            continue
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            llvm.load_library_permanently(name)
            return name
        except (OSError, RuntimeError):
            continue
    return None


# the split glue this process builds: kiln's team where the host has one, else libgomp's
_IR = native_team_ir.team_ir() if native_team.available() else _GOMP_IR

_lock = threading.Lock()
_state: dict = {}  # "built": see `_built`
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    # the parent's OpenMP regions may have started threads (kiln's team starts anew)
    _forked = bool(_state.get("built")) and not _state["built"].get("team")


os.register_at_fork(after_in_child=_after_fork_in_child)


def _built() -> dict:
    """{"fn", "claim": the ctypes split functions, "address", "claim_address": their
    entries, "engine": their code, "team": True on kiln's own team}, built once per
    process (~10 ms, ~2 ms from the cache): kiln's native team where the host has one
    (native_team.available), else GNU OpenMP's; {} with neither."""
    if "built" not in _state:
        with _lock:
            if "built" not in _state:
                built = {}
                names = None
                if native_team.available():
                    names = ("kiln_team_for", "kiln_team_claim")
                elif openmp_runtime() is not None:
                    names = ("kiln_parallel_for", "kiln_parallel_claim")
                text = _IR
                if names is not None:
                    engine = jit.glue_module(text)
                    address, claim = (engine.address(n) for n in names)
                    built = {"fn": PARALLEL_FN(address), "address": address, "engine": engine,
                             "claim": PARALLEL_FN(claim), "claim_address": claim,
                             "team": names[0] == "kiln_team_for"}
                _state["built"] = built
    built = _state["built"]
    if built.get("team"):  # started at first use (and anew in a forked child), grown
        native_team.publish(built["engine"], get_num_threads() - 1)  # with kn.set_num_threads
    return built


def native_splits() -> bool:
    """Does this host split launches from native code (kiln's team or libgomp)?"""
    return native_team.available() or openmp_runtime() is not None


def prepare() -> None:
    """Build (or load) the process's split glue now, if a split launch could want it:
    a cold compile calls this while its LLVM threads build (`build_overlap`), so that
    the first step does not pay it (~15-20 ms built, ~4-10 ms from the cache)."""
    if not _forked:
        _built()


def wake() -> None:
    """Wake the team's sleeping workers (a prepared call with split launches, before its
    first launch): they spin by its first split region. Nothing on libgomp."""
    native_team.wake()


def parallel_for():
    """The native `parallel_for` (see `PARALLEL_FN`): kiln's team's, or libgomp's; None
    without either, or in a child forked after libgomp's regions ran (see the module
    docstring)."""
    return None if _forked else _steered(_built()).get("fn")


def _steered(built: dict) -> dict:
    """`built`, the team's workers first kept off the caller's CPU where they are kiln's
    team (`native_team.steer`): a split launch called from Python (not a prepared call,
    whose `wake` steers) woke a sleeping worker onto its caller's CPU, where it ran the
    region's units and then spun while the caller waited for its CPU: the batched GEMM's
    split trials took 2.3-6 ms (every unit run by the worker) against 0.1 ms serial."""
    if built.get("team"):
        native_team.steer_workers()
    return built


def parallel_for_address() -> int:
    """`parallel_for`'s address, for native code that calls it (a captured plan's launch
    list, a prepared call's trampoline); only where `native_splits()`."""
    return _built()["address"]


def parallel_claim():
    """The native `parallel_claim(entry, bufs, sizes, total, unit, threads)`, or None
    (as `parallel_for`): the threads claim `unit` points at a time from a shared atomic
    counter until [0, total) is done (a GEMM's panels or batch items: a thread that got
    its core late takes fewer)."""
    return None if _forked else _steered(_built()).get("claim")


def run_range(address: int, call, bufs, sizes, total: int, split: bool, unit: int = 1) -> None:
    """Run a native `fn(bufs, sizes, begin, end)` (the template modules' ABI: scan, topk,
    gathers) over [0, total): cut over kiln's threads where `split` (the caller judged the
    work large enough) and more than one thread is free now, else on the caller's thread
    by `call` (the function's ctypes object)."""
    region = threads = None
    if split and total > 1:
        from kiln.runtime.threads import parallel_threads

        threads = min(parallel_threads(), total)
        if threads > 1:
            region = parallel_for()
    if region is not None:
        region(address, bufs, sizes, total, unit, threads)
    else:
        call(bufs, sizes, 0, total)


def parallel_claim_address() -> int:
    """`parallel_claim`'s address (a prepared call's trampoline); where `native_splits()`."""
    return _built()["claim_address"]


def on_team() -> bool:
    """Do split launches in this process run on kiln's native team (not libgomp)?"""
    return parallel_for() is not None and bool(_built().get("team"))


def usable() -> bool:
    """Can native code enter a split region in this process now (kiln's team, or
    libgomp loaded and not a child forked after a region ran)?"""
    return parallel_for() is not None
