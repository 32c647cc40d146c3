"""A small LLVM IR *text* builder: typed SSA values, instructions, loops, module parts.

We emit text rather than llvmlite.ir objects because building IR objects in Python is
the slowest part of a cold compile; formatting strings is ~10x cheaper, and LLVM's
parser checks everything anyway. A value is a `V(ref, ty)`: `ref` is an SSA name or a
literal (`1`, `0x3FF0000000000000`) and `ty` its LLVM type.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class V:
    ref: str
    ty: str

    def __str__(self) -> str:
        return f"{self.ty} {self.ref}"


FLOAT_TYPES = ("half", "float", "double")


def float_literal(value: float, ty: str) -> str:
    """LLVM accepts a float constant only if exactly representable in its type: print the
    hex of the double holding the value already rounded to `ty` (see NOTES.md)."""
    if ty == "float":
        value = float(np.float32(value))
    elif ty == "half":
        value = float(np.float16(value))
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", value))[0]


def const(ty: str, value) -> V:
    if ty in FLOAT_TYPES:
        return V(float_literal(float(value), ty), ty)
    if ty == "i1":
        return V("true" if value else "false", ty)
    return V(str(int(value)), ty)


def int_bits(ty: str) -> int:
    return int(ty[1:])


class Module:
    """Collects function definitions, declarations and loop metadata of one module."""

    def __init__(self, f32_math: str = "native"):
        self.f32_math = f32_math  # CpuOptions.f32_math: which float32 math bodies to emit
        self.functions: list[str] = []
        self.declarations: dict[str, str] = {}
        self.metadata: list[str] = []
        self.helpers: set[str] = set()  # names of helper functions already defined
        self.text_weight = 1.0  # LLVM's time per character of it (parallel_build.build_cost)

    def declare(self, name: str, signature: str) -> None:
        """`signature` is the full `declare ...` line."""
        self.declarations.setdefault(name, signature)

    def intrinsic(self, base: str, ty: str, nargs: int) -> str:
        """Name of an overloaded float intrinsic (llvm.sqrt.f32, ...), declared once."""
        suffix = {"float": "f32", "double": "f64", "half": "f16"}.get(ty, ty)
        name = f"llvm.{base}.{suffix}"
        self.declare(name, f"declare {ty} @{name}({', '.join([ty] * nargs)})")
        return name

    def loop_metadata(self, vectorize: bool = True, interleave: int | None = None,
                      unroll: bool = True, unroll_vectorized: bool = False) -> str:
        """A fresh `!llvm.loop` node asking the vectorizer to vectorize this loop (and, with
        `interleave`, to run that many vectors of it side by side); `unroll=False` adds
        `llvm.loop.unroll.disable` (no full, partial or runtime unrolling), which with
        `unroll_vectorized` holds for the loop before vectorization and its scalar
        remainder only: the vector loop is LLVM's to unroll, as it would be by default
        (`llvm.loop.vectorize.followup_vectorized`, its runtime unrolling off)."""
        base = len(self.metadata)
        hints = [f'!{{!"llvm.loop.vectorize.enable", i1 {"true" if vectorize else "false"}}}']
        if interleave is not None:
            hints.append(f'!{{!"llvm.loop.interleave.count", i32 {interleave}}}')
        if not unroll:
            hints.append('!{!"llvm.loop.unroll.disable"}')
            if unroll_vectorized:
                followup = base + len(hints) + 2
                hints.append(f'!{{!"llvm.loop.vectorize.followup_vectorized", !{followup}}}')
        ids = [f"!{base + 1 + i}" for i in range(len(hints))]
        self.metadata.append(f"!{base} = distinct !{{!{base}, {', '.join(ids)}}}")
        self.metadata += [f"{ref} = {h}" for ref, h in zip(ids, hints)]
        if not unroll and unroll_vectorized:
            self.metadata.append(f'!{base + len(hints) + 1} = !{{!"llvm.loop.unroll.runtime.disable"}}')
        return f"!{base}"

    def text(self) -> str:
        return join_modules([self])


_METADATA_REF = re.compile(r"!(\d+)")
_INT = re.compile(r"-?\d+")


def _renumbered(text: str, offset: int) -> str:
    return _METADATA_REF.sub(lambda m: f"!{int(m.group(1)) + offset}", text)


def _defined_name(function: str) -> str:
    """The symbol a `define ... @name(...)` text defines."""
    head = function[:function.index("(")]
    return head[head.rindex("@") + 1:]


def join_modules(modules: list[Module]) -> str:
    """The text of one module holding all of `modules` (emitted apart, in this order):
    declarations once each, a helper function that several define only where it first
    appears, every other function as it is, each module's metadata numbered after the
    previous ones'. The text one Module would have had for the same kernels (exactly so
    while helpers hold no loop metadata; a dropped copy's would stay, unreferenced)."""
    if len(modules) == 1:
        m = modules[0]
        return "\n".join(list(m.declarations.values()) + m.functions + m.metadata) + "\n"
    declarations: dict[str, str] = {}
    functions: list[str] = []
    defined: set[str] = set()
    metadata: list[str] = []
    for m in modules:
        offset = len(metadata)
        for name, line in m.declarations.items():
            declarations.setdefault(name, line)
        for f in m.functions:
            if m.helpers and f.startswith("define"):
                name = _defined_name(f)
                if name in m.helpers:
                    if name in defined:
                        continue
                    defined.add(name)
            functions.append(_renumbered(f, offset) if offset and _METADATA_REF.search(f) else f)
        metadata += [_renumbered(line, offset) for line in m.metadata] if offset else m.metadata
    return "\n".join(list(declarations.values()) + functions + metadata) + "\n"


class Fn:
    """Builds one function body. Instructions go to the current block."""

    def __init__(self, module: Module, prefix: str = "v"):
        self.module = module
        self.lines: list[str] = ["entry:"]
        self.counter = 0
        self.prefix = prefix
        self.block = "entry"
        # loops and non-vectorizable calls seen so far: a loop asks for vectorization only
        # if it is innermost and calls nothing scalar (else LLVM warns it could not)
        self.loops_started = 0
        self.scalar_calls = 0

    # -- names and blocks -------------------------------------------------------------
    def fresh(self, hint: str = "") -> str:
        self.counter += 1
        return f"%{self.prefix}{self.counter}{hint}"

    def new_label(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}{self.counter}"

    def start_block(self, label: str) -> None:
        self.lines.append(f"{label}:")
        self.block = label

    def emit(self, text: str, ty: str, hint: str = "") -> V:
        name = self.fresh(hint)
        self.lines.append(f"  {name} = {text}")
        return V(name, ty)

    def stmt(self, text: str) -> None:
        self.lines.append(f"  {text}")

    def br(self, label: str, meta: str = "") -> None:
        self.stmt(f"br label %{label}" + (f", !llvm.loop {meta}" if meta else ""))

    def cbr(self, cond: V, then: str, other: str) -> None:
        self.stmt(f"br i1 {cond.ref}, label %{then}, label %{other}")

    # -- arithmetic -------------------------------------------------------------------
    def bin(self, op: str, a: V, b: V, flags: str = "") -> V:
        flags = f" {flags}" if flags else ""
        return self.emit(f"{op}{flags} {a.ty} {a.ref}, {b.ref}", a.ty)

    def fadd(self, a, b, flags=""):
        return self.bin("fadd", a, b, flags)

    def fsub(self, a, b, flags=""):
        return self.bin("fsub", a, b, flags)

    def fmul(self, a, b, flags=""):
        return self.bin("fmul", a, b, flags)

    def fdiv(self, a, b):
        return self.bin("fdiv", a, b)

    def fneg(self, a: V) -> V:
        return self.emit(f"fneg {a.ty} {a.ref}", a.ty)

    def fma(self, a: V, b: V, c: V) -> V:
        return self.call(self.module.intrinsic("fma", a.ty, 3), a.ty, [a, b, c])

    def unary_intrinsic(self, base: str, a: V) -> V:
        return self.call(self.module.intrinsic(base, a.ty, 1), a.ty, [a])

    def binary_intrinsic(self, base: str, a: V, b: V) -> V:
        return self.call(self.module.intrinsic(base, a.ty, 2), a.ty, [a, b])

    def fcmp(self, pred: str, a: V, b: V) -> V:
        return self.emit(f"fcmp {pred} {a.ty} {a.ref}, {b.ref}", "i1")

    def icmp(self, pred: str, a: V, b: V) -> V:
        return self.emit(f"icmp {pred} {a.ty} {a.ref}, {b.ref}", "i1")

    def select(self, c: V, a: V, b: V) -> V:
        return self.emit(f"select i1 {c.ref}, {a.ty} {a.ref}, {b.ty} {b.ref}", a.ty)

    def cast(self, op: str, a: V, ty: str) -> V:
        if a.ty == ty and op in ("bitcast", "zext", "sext", "trunc", "fpext", "fptrunc"):
            return a
        return self.emit(f"{op} {a.ty} {a.ref} to {ty}", ty)

    def freeze(self, a: V) -> V:
        return self.emit(f"freeze {a.ty} {a.ref}", a.ty)

    def call(self, name: str, ret: str, args: list[V]) -> V:
        text = f"call {ret} @{name}({', '.join(map(str, args))})"
        if ret == "void":
            self.stmt(text)
            return V("", "void")
        return self.emit(text, ret)

    # -- memory -----------------------------------------------------------------------
    def gep(self, elem_ty: str, ptr: V, index: V) -> V:
        return self.emit(f"getelementptr inbounds {elem_ty}, ptr {ptr.ref}, i64 {index.ref}", "ptr")

    def load(self, ty: str, ptr: V, align: int) -> V:
        return self.emit(f"load {ty}, ptr {ptr.ref}, align {align}", ty)

    def store(self, value: V, ptr: V, align: int) -> None:
        self.stmt(f"store {value.ty} {value.ref}, ptr {ptr.ref}, align {align}")

    # -- shorthands for typed constants --------------------------------------------------
    @staticmethod
    def c(ty: str, value) -> V:
        return const(ty, value)

    def define(self, header: str) -> str:
        """The complete function text: `header` is `define ... {` without the brace."""
        return header + " {\n" + "\n".join(self.lines) + "\n}\n"


class CountedLoop:
    """`for i in [start, stop)`, with loop-carried values as phis.

        loop = CountedLoop(fn, start, stop, carried=[acc0])
        i, (acc,) = loop.begin()
        ... emit body, computing acc_next ...
        (acc_out,) = loop.end([acc_next])

    The loop gets `llvm.loop.vectorize.enable` metadata unless vectorize=False
    (vectorization off) or None (no hint: LLVM's own cost model decides).
    `interleave=n` asks the vectorizer for n vectors per iteration (1: one, no copies).
    `unroll_nested=False`: if the loop turns out to contain other loops, it also gets
    `llvm.loop.unroll.disable`. Unrolling a loop around a vectorized loop (a column
    reduction's 16 x 32 row loops, fully unrolled) copies the inner loop with its vector
    body, remainder and epilogue each time: compile time and code size grow ~10x and the
    run time does not improve (benchmarks/results/cpu.md, section llvm_build). An
    innermost vectorized loop with loop-carried values (a reduction) gets it too, unless
    its trip count is a small literal, with an interleave of four unless given (`end`).
    """

    def __init__(self, fn: Fn, start: V, stop: V, carried: list[V] = (), vectorize: bool = True,
                 unroll_nested: bool = True, interleave: int | None = None):
        self.fn, self.start, self.stop, self.carried = fn, start, stop, list(carried)
        self.vectorize = vectorize
        self.unroll_nested = unroll_nested
        self.interleave = interleave

    def begin(self):
        fn = self.fn
        fn.loops_started += 1
        self.marks = (fn.loops_started, fn.scalar_calls)
        self.pre = fn.block
        self.head, self.body, self.exit = (fn.new_label(h) for h in ("head", "body", "exit"))
        fn.br(self.head)
        fn.start_block(self.head)
        self.i = V(fn.fresh("i"), "i64")
        self.phis = [V(fn.fresh("acc"), c.ty) for c in self.carried]
        # the phi lines are patched in end(), once the latch values are known
        self.phi_at = len(fn.lines)
        fn.lines.append("")
        cond = fn.icmp("slt", self.i, self.stop)
        fn.cbr(cond, self.body, self.exit)
        fn.start_block(self.body)
        return self.i, self.phis

    # a pointwise loop whose element is a long chain of divisions or square roots (20 Newton
    # steps, unrolled): LLVM's cost model runs one vector at a time, so each vector's chain
    # waits on the divider's latency; four vectors side by side keep the divider busy
    # (20-step Newton over 2^20 floats, one thread: 3.7 -> 3.4 ms)
    LONG_CHAIN = 8

    def _interleave(self, vectorize: bool) -> int | None:
        if not vectorize:
            return None
        if self.interleave is not None:
            return self.interleave
        if self.carried:  # reductions: LLVM already splits accumulators
            return None
        body = self.fn.lines[self.phi_at:]
        slow = sum(" fdiv " in line or "@llvm.sqrt." in line for line in body)
        return 4 if slow >= self.LONG_CHAIN else None

    # a reduction loop with a literal trip count up to this is left to LLVM's full unrolling
    TINY_TRIP = 8

    def _tiny(self) -> bool:
        """Whether the trip count is a literal of at most TINY_TRIP."""
        a, b = self.start.ref, self.stop.ref
        return bool(_INT.fullmatch(a) and _INT.fullmatch(b)) and int(b) - int(a) <= self.TINY_TRIP

    def end(self, next_values: list[V] = ()):
        fn = self.fn
        latch = fn.block
        nxt = fn.bin("add", self.i, const("i64", 1), "nuw nsw")
        innermost_simple = self.marks == (fn.loops_started, fn.scalar_calls)
        unroll = self.unroll_nested or self.marks[0] == fn.loops_started
        if self.vectorize is None and innermost_simple:
            meta = ""  # no hint: LLVM's cost model decides, and says nothing when it declines
        else:
            vectorize = bool(self.vectorize) and innermost_simple
            interleave = self._interleave(vectorize)
            if vectorize and self.carried and not self._tiny():
                # a reduction: LLVM fully unrolls a constant-trip loop before vectorizing,
                # which turned a 64-long row sum into 64 dependent scalar adds (2x slower);
                # unroll.disable also means one vector per iteration unless asked, so ask
                # for the four accumulators its cost model gives reductions, and leave
                # the vector loop LLVM's to unroll (a 1024-long block of a float32 sum:
                # 16 vector steps, unrolled, 25% faster over 2^25 elements)
                unroll = False
                if interleave is None:
                    interleave = 4
            meta = fn.module.loop_metadata(vectorize, interleave, unroll,
                                           unroll_vectorized=bool(vectorize and self.carried))
        fn.br(self.head, meta)
        phis = [f"  {self.i.ref} = phi i64 [ {self.start.ref}, %{self.pre} ], [ {nxt.ref}, %{latch} ]"]
        for p, init, new in zip(self.phis, self.carried, next_values):
            phis.append(f"  {p.ref} = phi {p.ty} [ {init.ref}, %{self.pre} ], [ {new.ref}, %{latch} ]")
        fn.lines[self.phi_at] = "\n".join(phis)
        fn.start_block(self.exit)
        return self.phis
