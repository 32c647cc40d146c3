"""`random_bits` on the CPU as native code: Threefry-2x32 in vector lanes, over kiln's threads.

`random_bits` (kiln/ir/ops/creation.py) stays an extern step in compiled programs: its
element j is word j % 2 of Threefry-2x32 (20 rounds) of the counter j // 2 under the
key, and that pairing does not fit a pointwise loop nest (each counter yields two
elements). Its numpy reference runs 5 array passes per round over blocks: the two
Dropout masks of a 512 x 1024 training step took 2.7 ms each on one thread, 10% of the
large MLP's step (bench_train.py, `kn.profile()`).

This module is the CPU backend's implementation of the `random_bits` template kind
(`CpuBackend.templates()`): a hand-written LLVM function over a range of counters whose
rounds are 32-bit adds, rotates (`llvm.fshl`, one `vprold` on AVX-512) and xors, and
whose two words are stored side by side, so LLVM's loop vectorizer runs 16 counters per
instruction; the counters are split over kiln's threads (`native_pool.parallel_for`)
when there are many. The function is built once per machine (the glue cache keeps its
object code). The bits are the reference's, bit for bit (tested).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

ENTRY = "kiln_threefry_bits"
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)  # Threefry-2x32's (Salmon et al., SC'11)
PARITY = 0x1BD11BDA
SPLIT_COUNTERS = 1 << 15  # counters (~0.1 ms of one thread) worth a split region
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def _rounds(c: str, tag: str) -> tuple[list[str], str, str]:
    """IR lines computing Threefry-2x32 of the i64 counter `%c` under the key words
    %k0 %k1 %k2; returns (lines, word 0, word 1)."""
    lines = [f"  %x0{tag} = trunc i64 {c} to i32",
             f"  %hi{tag} = lshr i64 {c}, 32",
             f"  %x1{tag} = trunc i64 %hi{tag} to i32",
             f"  %a0{tag} = add i32 %x0{tag}, %k0",
             f"  %b0{tag} = add i32 %x1{tag}, %k1"]
    keys = ("%k0", "%k1", "%k2")
    a, b = f"%a0{tag}", f"%b0{tag}"
    for i in range(20):
        r = ROTATIONS[i % 8]
        na, rot, nb = f"%a{i + 1}{tag}", f"%r{i + 1}{tag}", f"%b{i + 1}{tag}"
        lines += [f"  {na} = add i32 {a}, {b}",
                  f"  {rot} = call i32 @llvm.fshl.i32(i32 {b}, i32 {b}, i32 {r})",
                  f"  {nb} = xor i32 {rot}, {na}"]
        a, b = na, nb
        if i % 4 == 3:
            s = i // 4 + 1
            ia, ib, ic = f"%ia{s}{tag}", f"%ib{s}{tag}", f"%ic{s}{tag}"
            lines += [f"  {ia} = add i32 {a}, {keys[s % 3]}",
                      f"  {ib} = add i32 {b}, {keys[(s + 1) % 3]}",
                      f"  {ic} = add i32 {ib}, {s}"]
            a, b = ia, ic
    return lines, a, b


def module_text() -> str:
    """fn(bufs = [key u32[2], out u32[n]], sizes = [n], begin, end): the counters
    [begin, end) of the n bits' ceil(n / 2); counter c writes out[2c] and out[2c + 1]
    (the last counter of an odd n only out[n - 1])."""
    body, a, b = _rounds("%c", "")
    last, la, _ = _rounds("%half", ".t")
    nl = "\n"
    return f"""declare i32 @llvm.fshl.i32(i32, i32, i32)

define void @{ENTRY}(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) nounwind {{
entry:
  %pk = load ptr, ptr %bufs
  %po.at = getelementptr ptr, ptr %bufs, i64 1
  %po = load ptr, ptr %po.at
  %n = load i64, ptr %sizes
  %k0 = load i32, ptr %pk
  %pk1 = getelementptr i32, ptr %pk, i64 1
  %k1 = load i32, ptr %pk1
  %kx = xor i32 %k0, %k1
  %k2 = xor i32 %kx, {PARITY}
  %half = lshr i64 %n, 1
  %short = icmp slt i64 %end, %half
  %stop = select i1 %short, i64 %end, i64 %half
  %go = icmp slt i64 %begin, %stop
  br i1 %go, label %loop, label %tail

loop:
  %c = phi i64 [ %begin, %entry ], [ %next, %loop ]
{nl.join(body)}
  %i0 = shl nuw nsw i64 %c, 1
  %p0 = getelementptr inbounds i32, ptr %po, i64 %i0
  store i32 {a}, ptr %p0, align 4
  %p1 = getelementptr inbounds i32, ptr %p0, i64 1
  store i32 {b}, ptr %p1, align 4
  %next = add nuw nsw i64 %c, 1
  %more = icmp slt i64 %next, %stop
  br i1 %more, label %loop, label %tail, !llvm.loop !0

tail:
  %odd = trunc i64 %n to i1
  %reach = icmp sgt i64 %end, %half
  %from = icmp sle i64 %begin, %half
  %both = and i1 %odd, %reach
  %all = and i1 %both, %from
  br i1 %all, label %last, label %done

last:
{nl.join(last)}
  %il = shl nuw nsw i64 %half, 1
  %pl = getelementptr inbounds i32, ptr %po, i64 %il
  store i32 {la}, ptr %pl, align 4
  br label %done

done:
  ret void
}}

!0 = distinct !{{!0, !1}}
!1 = !{{!"llvm.loop.vectorize.enable", i1 true}}
"""


@lru_cache(maxsize=None)
def _entry():
    """(the jitted module, the function's address), built once per process (the object
    code from the glue cache when a process before built it on this machine)."""
    from kiln.codegen.cpu.glue_cache import glue_module

    jitted = glue_module(module_text(), 3)
    return jitted, jitted.address(ENTRY)


def threefry_bits(key: np.ndarray, shape: tuple, threads: int | None = None) -> np.ndarray:
    """uint32 bits of `shape` from the u32[2] `key`: `random_bits`' reference, natively."""
    key = np.ascontiguousarray(key, dtype=np.uint32)
    n = int(np.prod(shape, dtype=np.int64))
    out = np.empty(n, np.uint32)
    if n:
        counters = (n + 1) // 2
        sizes = (ctypes.c_int64 * 1)(n)
        bufs = (ctypes.c_void_p * 2)(key.ctypes.data, out.ctypes.data)
        _, address = _entry()
        region = None
        if counters >= SPLIT_COUNTERS:
            from kiln.runtime.threads import parallel_threads

            threads = parallel_threads() if threads is None else threads
            if threads > 1:
                from kiln.codegen.cpu.native_pool import parallel_for

                region = parallel_for()
        if region is not None:
            region(address, bufs, sizes, counters, 16, threads)
        else:
            _FN(address)(bufs, sizes, 0, counters)
    return out.reshape(shape)


def run_random_bits(arrays, attrs) -> list:
    """The CPU backend's extern `random_bits` (templates()["random_bits"])."""
    (key,) = arrays  # a u32[2]: the op's type rule admits no other key
    return [threefry_bits(key, tuple(attrs["shape"]))]
