"""Float max/min reductions that vectorize: accumulate ordered integer keys.

A float `max` reduction combined with `llvm.maximum` (NaN-propagating, -0.0 < +0.0) is
not vectorized by LLVM on x86: it stays a scalar loop whose every step waits on the
previous one (the row max of attention's softmax was the largest kernel of the GPT
training step). Here each element is mapped to a signed integer whose order is the
float order (the sign-magnitude bits with the magnitude flipped for negative numbers:
-inf < ... < -0.0 < +0.0 < ... < +inf), NaN mapped to the integer extreme that wins
(INT_MAX for max, INT_MIN for min). The loop then carries an integer `icmp` + `select`
reduction, which LLVM vectorizes without fast-math flags, and the result key maps back
to the float exactly. The semantics are `llvm.maximum`/`llvm.minimum`'s, which the
scalar path had: any NaN gives NaN (the quiet default NaN, as torch returns NaN), and
+0.0 is larger than -0.0 whatever the order of the elements (numpy and torch keep
whichever zero they meet first; IEEE 754-2019 `maximum` orders them, and so does kiln).
Float16/bfloat16 values live in float32 registers, so they use the float32 keys.
"""

from __future__ import annotations

import struct

from kiln.codegen.kernel_ir import Reduce
from kiln.codegen.legalize import reduce_identity

from kiln.codegen.cpu import dtype_map
from kiln.codegen.cpu.ir_builder import Fn, V, const

# the kernel emitter's switch (benchmarks/bench_minmax_reduce.py measures both paths)
ENABLED = True

_BITS = {"float": 32, "double": 64}
_QUIET_NAN = {"float": 0x7FC00000, "double": 0x7FF8000000000000}


def applies(r: Reduce) -> bool:
    """True for float max/min reductions with a reduce loop (the ones keyed here)."""
    return ENABLED and bool(r.loops) and r.op in ("max", "min") and r.dtype.is_floating


def key_type(r: Reduce) -> str:
    """The integer accumulator type: i32 for float32 registers, i64 for float64."""
    return f"i{_BITS[dtype_map.reg_type(r.dtype)]}"


def _nan_key(r: Reduce) -> int:
    bits = _BITS[dtype_map.reg_type(r.dtype)]
    return (1 << (bits - 1)) - 1 if r.op == "max" else -(1 << (bits - 1))


def _key_of_float(value: float, fty: str) -> int:
    """The key of a float constant (Python mirror of `to_key`)."""
    bits = _BITS[fty]
    u = int.from_bytes(struct.pack("<f" if bits == 32 else "<d", value), "little", signed=True)
    return u ^ ((1 << (bits - 1)) - 1) if u < 0 else u


def key_init(r: Reduce) -> V:
    """The identity's key (-inf for max, +inf for min: legalize.reduce_identity)."""
    fty = dtype_map.reg_type(r.dtype)
    return const(key_type(r), _key_of_float(reduce_identity(r.op, r.dtype), fty))


def to_key(fn: Fn, r: Reduce, x: V) -> V:
    """The ordered integer key of the register float `x`."""
    ity = key_type(r)
    bits = _BITS[x.ty]
    u = fn.cast("bitcast", x, ity)
    flip = fn.bin("and", fn.bin("ashr", u, const(ity, bits - 1)), const(ity, (1 << (bits - 1)) - 1))
    key = fn.bin("xor", u, flip)
    return fn.select(fn.fcmp("uno", x, x), const(ity, _nan_key(r)), key)


def combine(fn: Fn, r: Reduce, acc: V, key: V) -> V:
    """The keyed max/min step: a signed integer compare and select."""
    keep = fn.icmp("sgt" if r.op == "max" else "slt", acc, key)
    return fn.select(keep, acc, key)


def from_key(fn: Fn, r: Reduce, key: V) -> V:
    """The register float of a result key (the quiet NaN for the NaN key)."""
    fty = dtype_map.reg_type(r.dtype)
    ity, bits = key.ty, _BITS[fty]
    flip = fn.bin("and", fn.bin("ashr", key, const(ity, bits - 1)), const(ity, (1 << (bits - 1)) - 1))
    u = fn.bin("xor", key, flip)
    u = fn.select(fn.icmp("eq", key, const(ity, _nan_key(r))), const(ity, _QUIET_NAN[fty]), u)
    return fn.cast("bitcast", u, fty)
