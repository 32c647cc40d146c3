"""Native launch lists: a captured plan's ops as one LLVM function.

`CpuLauncher.compile(ops)` emits `void plan(ptr table)`, which runs the ops in order with
no Python between them: a launch loads its buffers' pointers from the table into a
stack array and calls the kernel's raw entry (its address is a constant; the sizes a
private global); a copy is `llvm.memmove`; a `Switch` is a clamped `switch`; a `Loop`
is a loop whose condition reads the flag buffer the cond ops wrote. `bind` emits
`void bind(ptr table, ptr objects)`, which reads each input's data pointer from its
numpy object (the field the kernels' `.np` entries read) and fills the views' entries,
so binding the inputs of a replay costs one store per input in Python.

The functions are small (calls and branches), so they are optimized at O1 and cost a
few tens of milliseconds to build, once per capture.

    >>> plan = CapturedPlan(program, kernels, externs, sizes, arrays, CpuLauncher())
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache
from typing import Sequence

import llvmlite.binding as llvm

import numpy as np

from kiln.codegen.cpu import jit
from kiln.codegen.cpu.llvm_emit import NUMPY_DATA_OFFSET
from kiln.runtime.capture import Copy, Launcher, Loop, NativeLaunch, Swap, Switch

_PLAN_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_BIND_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_INT_TYPES = {1: "i8", 2: "i16", 4: "i32", 8: "i64"}


class _Emitter:
    def __init__(self):
        self.lines: list[str] = []
        self.globals: list[str] = []
        self.n = 0
        self.max_args = 1
        self.workers: list[str] = []

    def tmp(self) -> str:
        self.n += 1
        return f"%t{self.n}"

    def label(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

    def start(self, label: str) -> None:
        self.lines.append(f"{label}:")

    def entry(self, index: int) -> str:
        """The table entry `index` (a pointer)."""
        slot, value = self.tmp(), self.tmp()
        self.emit(f"{slot} = getelementptr ptr, ptr %table, i64 {index}")
        self.emit(f"{value} = load ptr, ptr {slot}")
        return value

    def ops(self, ops: Sequence) -> None:
        for op in ops:
            getattr(self, "op_" + type(op).__name__)(op)

    def op_NativeLaunch(self, op: NativeLaunch) -> None:
        self.max_args = max(self.max_args, len(op.args))
        for position, index in enumerate(op.args):
            value, slot = self.entry(index), self.tmp()
            self.emit(f"{slot} = getelementptr ptr, ptr %args, i64 {position}")
            self.emit(f"store ptr {value}, ptr {slot}")
        sizes = f"@sizes{len(self.globals)}"
        values = ", ".join(f"i64 {v}" for v in op.sizes) or "i64 0"
        self.globals.append(f"{sizes} = private unnamed_addr constant [{max(1, len(op.sizes))} x i64] [{values}]")
        if op.threads > 1:
            worker = self._worker(op, sizes)
            self.emit(f"call void @GOMP_parallel(ptr {worker}, ptr %args, i32 {op.threads}, i32 0)")
            return
        fn = self.tmp()
        self.emit(f"{fn} = inttoptr i64 {op.address} to ptr")
        self.emit(f"call void {fn}(ptr %args, ptr {sizes}, i64 0, i64 {op.total})")

    def _worker(self, op: NativeLaunch, sizes: str) -> str:
        """A function each OpenMP thread runs: its share of [0, total), cut as the
        runtime's pool cuts it (chunks rounded up to 64 points from 1024 points on)."""
        name = f"@worker{len(self.workers)}"
        align = 64 if op.total >= 1024 else 1
        self.workers.append("\n".join([
            f"define internal void {name}(ptr %args) {{",
            "  %tid32 = call i32 @omp_get_thread_num()",
            "  %nt32 = call i32 @omp_get_num_threads()",
            "  %tid = sext i32 %tid32 to i64",
            "  %nt = sext i32 %nt32 to i64",
            f"  %a = add i64 {op.total}, %nt",
            "  %b = sub i64 %a, 1",
            "  %per = udiv i64 %b, %nt",
            f"  %c = add i64 %per, {align - 1}",
            f"  %d = udiv i64 %c, {align}",
            f"  %chunk = mul i64 %d, {align}",
            "  %lo = mul i64 %tid, %chunk",
            "  %e = add i64 %lo, %chunk",
            f"  %over = icmp sgt i64 %e, {op.total}",
            f"  %hi = select i1 %over, i64 {op.total}, i64 %e",
            "  %some = icmp slt i64 %lo, %hi",
            "  br i1 %some, label %run, label %done",
            "run:",
            f"  %fn = inttoptr i64 {op.address} to ptr",
            f"  call void %fn(ptr %args, ptr {sizes}, i64 %lo, i64 %hi)",
            "  br label %done",
            "done:",
            "  ret void",
            "}"]))
        return name

    def op_Copy(self, op: Copy) -> None:
        if op.nbytes == 0 or op.dst == op.src:
            return
        dst, src = self.entry(op.dst), self.entry(op.src)
        self.emit(f"call void @llvm.memmove.p0.p0.i64(ptr {dst}, ptr {src}, i64 {op.nbytes}, i1 false)")

    def op_Swap(self, op: Swap) -> None:
        members_a, members_b = op.members()
        pa, pb = self.entry(op.a), self.entry(op.b)
        for members, value in ((members_a, pb), (members_b, pa)):
            for m in members:
                slot = self.tmp()
                self.emit(f"{slot} = getelementptr ptr, ptr %table, i64 {m}")
                self.emit(f"store ptr {value}, ptr {slot}")

    def op_Switch(self, op: Switch) -> None:
        pointer, raw, wide = self.entry(op.index), self.tmp(), self.tmp()
        ty = _INT_TYPES[np.dtype(op.index_dtype).itemsize]
        self.emit(f"{raw} = load {ty}, ptr {pointer}")
        if np.dtype(op.index_dtype).kind in "bu":
            self.emit(f"{wide} = zext {ty} {raw} to i64" if ty != "i64" else f"{wide} = add i64 {raw}, 0")
        else:
            self.emit(f"{wide} = sext {ty} {raw} to i64" if ty != "i64" else f"{wide} = add i64 {raw}, 0")
        last = len(op.branches) - 1
        low, clamped, negative, high = self.tmp(), self.tmp(), self.tmp(), self.tmp()
        self.emit(f"{negative} = icmp slt i64 {wide}, 0")
        self.emit(f"{low} = select i1 {negative}, i64 0, i64 {wide}")
        self.emit(f"{high} = icmp sgt i64 {low}, {last}")
        self.emit(f"{clamped} = select i1 {high}, i64 {last}, i64 {low}")
        labels = [self.label("branch") for _ in op.branches]
        join = self.label("join")
        cases = " ".join(f"i64 {k}, label %{lab}" for k, lab in enumerate(labels))
        self.emit(f"switch i64 {clamped}, label %{labels[-1]} [ {cases} ]")
        for lab, branch in zip(labels, op.branches):
            self.start(lab)
            self.ops(branch)
            self.emit(f"br label %{join}")
        self.start(join)

    def op_Loop(self, op: Loop) -> None:
        self.ops(op.init)
        head, body, done = self.label("head"), self.label("body"), self.label("done")
        self.emit(f"br label %{head}")
        self.start(head)
        self.ops(op.cond)
        pointer, flag, go = self.entry(op.flag), self.tmp(), self.tmp()
        self.emit(f"{flag} = load i8, ptr {pointer}")
        self.emit(f"{go} = icmp ne i8 {flag}, 0")
        self.emit(f"br i1 {go}, label %{body}, label %{done}")
        self.start(body)
        self.ops(op.body)
        self.ops(op.back)
        self.emit(f"br label %{head}")
        self.start(done)

    def module(self, name: str, signature: str) -> str:
        header = [f"define void @{name}({signature}) {{", "entry:",
                  f"  %args = alloca [{self.max_args} x ptr]"]
        declares = ["declare void @llvm.memmove.p0.p0.i64(ptr, ptr, i64, i1)"]
        if self.workers:
            declares += ["declare void @GOMP_parallel(ptr, ptr, i32, i32)",
                         "declare i32 @omp_get_thread_num()", "declare i32 @omp_get_num_threads()"]
        return "\n".join([*declares, *self.globals, *self.workers, *header, *self.lines,
                          "  ret void", "}", ""])


@lru_cache(maxsize=None)
def openmp_runtime() -> str | None:
    """Load GNU OpenMP (libgomp) into LLVM's symbol space; its path, or None when the
    host has none (then parallel launches of a captured plan run through kiln's pool)."""
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


class CpuLauncher(Launcher):
    """Compiles native runs of a captured plan for the host CPU; a launch the runtime
    would split over its pool is split over OpenMP threads when libgomp is present."""

    def __init__(self):
        self._keep: list = []  # engines: the functions point into them
        self.parallel = openmp_runtime() is not None

    def _build(self, text: str, name: str, fntype):
        mod = jit.parse(text)
        jit.optimize(mod, 1)
        engine = jit.Jitted(mod, opt_level=1)
        self._keep.append(engine)
        return fntype(engine.address(name))

    def compile(self, ops: Sequence):
        em = _Emitter()
        em.ops(ops)
        return self._build(em.module("plan", "ptr %table"), "plan", _PLAN_FN)

    def bind(self, inputs: Sequence[int], aliases: Sequence[tuple[int, int]]):
        if not _data_field_ok():
            return None
        em = _Emitter()
        for k, index in enumerate(inputs):
            obj_slot, obj, field, data, entry = (em.tmp() for _ in range(5))
            em.emit(f"{obj_slot} = getelementptr ptr, ptr %objects, i64 {k}")
            em.emit(f"{obj} = load ptr, ptr {obj_slot}")
            em.emit(f"{field} = getelementptr i8, ptr {obj}, i64 {NUMPY_DATA_OFFSET}")
            em.emit(f"{data} = load ptr, ptr {field}")
            em.emit(f"{entry} = getelementptr ptr, ptr %table, i64 {index}")
            em.emit(f"store ptr {data}, ptr {entry}")
        for target, source in aliases:
            value, entry = em.entry(source), em.tmp()
            em.emit(f"{entry} = getelementptr ptr, ptr %table, i64 {target}")
            em.emit(f"store ptr {value}, ptr {entry}")
        return self._build(em.module("bind", "ptr %table, ptr %objects"), "bind", _BIND_FN)


# -- one trampoline for a prepared call's launches (kiln/runtime/fast_call.py) ---------------
# `void launches(i64 *list, i64 n, i64 *objects, i64 *args)` runs n kernel launches from a
# flat list: per launch the entry's address, its argument count, the address of its size
# values, its loop count, then one word per argument: an object's address as is, or
# -(k + 1) for the call's k-th object (an input or an output, bound per call). It calls
# each kernel's `.np` entry (which reads the data pointer from the numpy object) with the
# arguments gathered into `args`: one ctypes call for the whole program instead of one
# per kernel (~0.6-1 us each).

_LAUNCHES_IR = """
define void @kiln_launches(ptr %list, i64 %n, ptr %objects, ptr %args) {
entry:
  br label %head
head:
  %i = phi i64 [ 0, %entry ], [ %i1, %call ]
  %pos = phi i64 [ 0, %entry ], [ %next, %call ]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %launch, label %exit
launch:
  %p_fn = getelementptr i64, ptr %list, i64 %pos
  %fn_i = load i64, ptr %p_fn
  %pos1 = add i64 %pos, 1
  %p_na = getelementptr i64, ptr %list, i64 %pos1
  %nargs = load i64, ptr %p_na
  %pos2 = add i64 %pos, 2
  %p_sz = getelementptr i64, ptr %list, i64 %pos2
  %sizes_i = load i64, ptr %p_sz
  %pos3 = add i64 %pos, 3
  %p_tot = getelementptr i64, ptr %list, i64 %pos3
  %total = load i64, ptr %p_tot
  %base = add i64 %pos, 4
  br label %ahead
ahead:
  %j = phi i64 [ 0, %launch ], [ %j1, %aset ]
  %amore = icmp slt i64 %j, %nargs
  br i1 %amore, label %aload, label %call
aload:
  %pj = add i64 %base, %j
  %p_v = getelementptr i64, ptr %list, i64 %pj
  %v = load i64, ptr %p_v
  %isobj = icmp slt i64 %v, 0
  br i1 %isobj, label %aobj, label %aset
aobj:
  %k0 = sub i64 0, %v
  %k = sub i64 %k0, 1
  %p_o = getelementptr i64, ptr %objects, i64 %k
  %o = load i64, ptr %p_o
  br label %aset
aset:
  %val = phi i64 [ %v, %aload ], [ %o, %aobj ]
  %p_a = getelementptr i64, ptr %args, i64 %j
  store i64 %val, ptr %p_a
  %j1 = add i64 %j, 1
  br label %ahead
call:
  %fn = inttoptr i64 %fn_i to ptr
  %sizes = inttoptr i64 %sizes_i to ptr
  call void %fn(ptr %args, ptr %sizes, i64 0, i64 %total)
  %i1 = add i64 %i, 1
  %next = add i64 %base, %nargs
  br label %head
exit:
  ret void
}
"""

LAUNCHES_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
_launches_engine: list = []


@lru_cache(maxsize=None)
def launch_trampoline():
    """The process's one `kiln_launches` function (built on first use, ~tens of ms)."""
    mod = jit.parse(_LAUNCHES_IR)
    jit.optimize(mod, 1)
    engine = jit.Jitted(mod, opt_level=1)
    _launches_engine.append(engine)  # the function points into it: kept for the process
    return LAUNCHES_FN(engine.address("kiln_launches"))


def _data_field_ok() -> bool:
    from kiln.codegen.cpu.compiled import _DATA_FIELD_OK

    return _DATA_FIELD_OK
