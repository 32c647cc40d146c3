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
from functools import lru_cache
from typing import Sequence

import numpy as np

from kiln.codegen.cpu import jit
from kiln.codegen.cpu.llvm_emit import NUMPY_DATA_OFFSET
from kiln.codegen.cpu.native_pool import native_splits, on_team, openmp_runtime, parallel_for_address  # noqa: F401
from kiln.codegen.cpu.native_team_ir import QUIET_WORKERS
from kiln.runtime.capture import Copy, Launcher, Loop, NativeLaunch, Swap, Switch

_PLAN_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_BIND_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_INT_TYPES = {1: "i8", 2: "i16", 4: "i32", 8: "i64"}


class _Emitter:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet  # split launches ask kiln's team's workers to sleep right after
        self.lines: list[str] = []
        self.globals: list[str] = []
        self.n = 0
        self.max_args = 1

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
        fn = self.tmp()
        self.emit(f"{fn} = inttoptr i64 {op.address} to ptr")
        if op.threads > 1:  # cut as the runtime cuts a split launch (native_pool.py)
            split = self.tmp()
            threads = op.threads | (QUIET_WORKERS if self.quiet else 0)
            self.emit(f"{split} = inttoptr i64 {parallel_for_address()} to ptr")
            self.emit(f"call void {split}(ptr {fn}, ptr %args, ptr {sizes}, i64 {op.total}, "
                      f"i64 {64 if op.total >= 1024 else 1}, i32 {threads})")
            return
        self.emit(f"call void {fn}(ptr %args, ptr {sizes}, i64 0, i64 {op.total})")

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
        return "\n".join([*declares, *self.globals, *header, *self.lines,
                          "  ret void", "}", ""])


class CpuLauncher(Launcher):
    """Compiles native runs of a captured plan for the host CPU; a launch the runtime
    would split over its pool is split over OpenMP threads when libgomp is present."""

    def __init__(self):
        self._keep: list = []  # engines: the functions point into them
        self.parallel = native_splits()

    def _build(self, text: str, name: str, fntype):
        engine = jit.glue_module(text)
        self._keep.append(engine)
        return fntype(engine.address(name))

    def compile(self, ops: Sequence, quiet: bool = False):
        """`void plan(ptr table)` running `ops`; `quiet` (only where split launches run on
        kiln's team, `native_pool.on_team()`): the team's workers sleep right after each
        split region instead of spinning (native_team_ir.QUIET_WORKERS)."""
        if quiet and not on_team():
            raise ValueError("quiet split launches need kiln's native team (libgomp would read "
                             "the flag as a thread count)")
        em = _Emitter(quiet)
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
# `void launches(i64 *list, i64 n, i64 *objects, i64 *args, i32 threads, i32 loose)` runs n
# kernel launches from a flat list: per launch the entry's address, its argument count,
# the address of its size values, its loop count, a split function (0: serial; else
# native_pool's kiln_parallel_for or kiln_parallel_claim), the split's unit (alignment or
# claim unit), the launch's most threads, whether its split is `sure` (1: far above a
# region's cost, split_rule.SURE_*; 0: a measured verdict), then one word per argument:
# an object's address as is, or -(k + 1) for the call's k-th object (an input or an
# output, bound per call). It calls each kernel's `.np` entry (which reads the data
# pointer from the numpy object) with the arguments gathered into `args`, split over
# min(most, `threads`) OpenMP threads for a sure split and min(most, `loose`) for a
# measured one, where the launch has a split function and that is 2 or more (a prepared
# call's whole-run check runs its measured splits serial while the sure ones stay split):
# one ctypes call for the whole program instead of one per kernel (~0.6-1 us each), split
# launches included (through the Python call path they cost ~5-10 us each more).
# the words of a launch before its arguments
_WORDS = ("fn_i", "nargs", "sizes_i", "total", "split_i", "unit", "most", "sure")
_READ_WORDS = "\n".join(
    f"  %pos{k} = add i64 %pos, {k}\n  %p_{w} = getelementptr i64, ptr %list, i64 %pos{k}\n"
    f"  %{w} = load i64, ptr %p_{w}" for k, w in enumerate(_WORDS))

_LAUNCHES_IR = """
define void @kiln_launches(ptr %list, i64 %n, ptr %objects, ptr %args, i32 %threads, i32 %loose) {
entry:
  br label %head
head:
  %i = phi i64 [ 0, %entry ], [ %i1, %after ]
  %pos = phi i64 [ 0, %entry ], [ %next, %after ]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %launch, label %exit
launch:
""" + _READ_WORDS + f"""
  %base = add i64 %pos, {len(_WORDS)}
  br label %ahead
""" + """ahead:
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
  %issure = icmp ne i64 %sure, 0
  %cap = select i1 %issure, i32 %threads, i32 %loose
  %t64 = sext i32 %cap to i64
  %fewer = icmp slt i64 %most, %t64
  %nt = select i1 %fewer, i64 %most, i64 %t64
  %many = icmp sgt i64 %nt, 1
  %has = icmp ne i64 %split_i, 0
  %go = and i1 %many, %has
  br i1 %go, label %split, label %serial
split:
  %sfn = inttoptr i64 %split_i to ptr
  %nt32 = trunc i64 %nt to i32
  call void %sfn(ptr %fn, ptr %args, ptr %sizes, i64 %total, i64 %unit, i32 %nt32)
  br label %after
serial:
  call void %fn(ptr %args, ptr %sizes, i64 0, i64 %total)
  br label %after
after:
  %i1 = add i64 %i, 1
  %next = add i64 %base, %nargs
  br label %head
exit:
  ret void
}
"""

LAUNCHES_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int32, ctypes.c_int32)
_launches_engine: list = []


@lru_cache(maxsize=None)
def launch_trampoline():
    """The process's one `kiln_launches` function (built on first use, ~tens of ms)."""
    engine = jit.glue_module(_LAUNCHES_IR)
    _launches_engine.append(engine)  # the function points into it: kept for the process
    return LAUNCHES_FN(engine.address("kiln_launches"))


def _data_field_ok() -> bool:
    from kiln.codegen.cpu.compiled import _DATA_FIELD_OK

    return _DATA_FIELD_OK
