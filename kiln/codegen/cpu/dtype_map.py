"""kiln dtypes in LLVM: register types, storage types, and the low-precision conversions.

Low-precision floats (float16, bfloat16, the float8 formats) are stored as their bits and
held in registers as float32 values that are exactly representable in the narrow type:
every op whose result is low precision rounds its float32 result back (RNE) right away,
which is exactly the reference semantics (`via_f32`: compute in float32, round once per
op). All conversions are branch-free integer arithmetic, so loops using them vectorize;
float16 uses LLVM's `half` (F16C `vcvtps2ph` on x86).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

from kiln.codegen.cpu.ir_builder import Fn, V, const


@dataclass(frozen=True)
class MiniFloat:
    """A narrow float format converted by integer arithmetic: exponent/mantissa bits,
    bias, and whether the all-ones exponent is inf/NaN (IEEE) or ordinary (e4m3fn)."""

    ebits: int
    mbits: int
    bias: int
    ieee: bool


_MINI = {
    "bf16": MiniFloat(8, 7, 127, True),
    "f8e5m2": MiniFloat(5, 2, 15, True),
    "f8e4m3fn": MiniFloat(4, 3, 7, False),
}

_REG = {"i1": "i1", "u8": "i8", "i8": "i8", "i16": "i16", "i32": "i32", "u32": "i32",
        "i64": "i64", "f8e4m3fn": "float", "f8e5m2": "float", "bf16": "float", "f16": "float",
        "f32": "float", "f64": "double"}
_STORE = {"i1": "i8", "f8e4m3fn": "i8", "f8e5m2": "i8", "bf16": "i16", "f16": "half"}


def reg_type(d: DType) -> str:
    """The LLVM type a value of dtype `d` has in registers."""
    try:
        return _REG[d.short]
    except KeyError:
        raise KilnDTypeError(f"cpu backend: dtype {d.name} is not supported by the CPU code "
                             "generator (complex64 kernels are not lowered to LLVM yet)") from None


def storage_type(d: DType) -> str:
    reg_type(d)
    return _STORE.get(d.short, _REG[d.short])


def is_low_precision(d: DType) -> bool:
    return d.is_floating and d.bits < 32


def is_unsigned(d: DType) -> bool:
    return d.category == dt.UINT or d.is_bool


def load_convert(fn: Fn, raw: V, d: DType) -> V:
    """Storage bits -> register value."""
    if d.is_bool:
        return fn.icmp("ne", raw, const("i8", 0))
    if d.short == "f16":
        return fn.cast("fpext", raw, "float")
    if d.short in _MINI:
        return _mini_to_f32(fn, raw, _MINI[d.short])
    return raw


def store_convert(fn: Fn, value: V, d: DType) -> V:
    """Register value -> storage bits (register values of low-precision dtypes are
    already rounded, so this is exact)."""
    if d.is_bool:
        return fn.cast("zext", value, "i8")
    if d.short == "f16":
        return fn.cast("fptrunc", value, "half")
    if d.short in _MINI:
        return _f32_to_mini(fn, value, _MINI[d.short])
    return value


def round_to(fn: Fn, value: V, d: DType) -> V:
    """Round a float32 register value to dtype `d` (identity for 32/64-bit types)."""
    if not is_low_precision(d):
        return value
    if d.short == "f16":
        return fn.cast("fpext", fn.cast("fptrunc", value, "half"), "float")
    if d.short == "bf16":
        # bf16 is the top half of f32: round the low 16 bits away, keeping NaN quiet
        u = fn.cast("bitcast", value, "i32")
        odd = fn.bin("and", fn.bin("lshr", u, const("i32", 16)), const("i32", 1))
        bias = fn.bin("add", odd, const("i32", 0x7FFF))
        rounded = fn.bin("and", fn.bin("add", u, bias), const("i32", -65536))
        quiet = fn.bin("and", fn.bin("or", u, const("i32", 0x400000)), const("i32", -65536))
        isnan = fn.fcmp("uno", value, value)
        return fn.cast("bitcast", fn.select(isnan, quiet, rounded), "float")
    mini = _MINI[d.short]
    return _mini_to_f32(fn, _f32_to_mini(fn, value, mini), mini)


def _f32_to_mini(fn: Fn, value: V, f: MiniFloat) -> V:
    """float32 -> narrow float bits with round-to-nearest-even (Giesen's float->half,
    generalised): normal numbers round by integer add on the bits, subnormals by adding
    a magic float that aligns the target's subnormal grid to the float32 ulp."""
    store = "i16" if f.ebits + f.mbits + 1 == 16 else "i8"
    width = f.ebits + f.mbits + 1
    shift = 23 - f.mbits
    u = fn.cast("bitcast", value, "i32")
    sign = fn.bin("and", u, const("i32", -0x80000000))
    a = fn.bin("xor", u, sign)
    af = fn.cast("bitcast", a, "float")
    # normal: rebias the exponent and round on the bits (the carry may bump the exponent)
    odd = fn.bin("and", fn.bin("lshr", a, const("i32", shift)), const("i32", 1))
    rebias = ((f.bias - 127) << 23) + (1 << (shift - 1)) - 1
    normal = fn.bin("lshr", fn.bin("add", fn.bin("add", a, const("i32", rebias)), odd),
                    const("i32", shift))
    # subnormal in the target: one float add does the RNE
    magic_bits = ((127 - f.bias) + shift + 1) << 23
    magic = fn.cast("bitcast", const("i32", magic_bits), "float")
    sub = fn.bin("sub", fn.cast("bitcast", fn.fadd(af, magic), "i32"), const("i32", magic_bits))
    min_normal = (127 - f.bias + 1) << 23
    is_sub = fn.icmp("ult", a, const("i32", min_normal))
    bits = fn.select(is_sub, sub, normal)
    if f.ieee:
        inf_code = ((1 << f.ebits) - 1) << f.mbits
        nan_code = inf_code | (1 << (f.mbits - 1))
        overflow_at = (127 + (1 << f.ebits) - 1 - f.bias) << 23  # 2^(emax+1) and above
        big = fn.icmp("uge", a, const("i32", overflow_at))
        bits = fn.select(big, const("i32", inf_code), bits)
        # a rounding carry past the largest finite value already lands on inf_code
    else:
        nan_code = (1 << (width - 1)) - 1  # e4m3fn: S.1111.111; no infinities
        bits = fn.select(fn.icmp("ugt", bits, const("i32", nan_code)), const("i32", nan_code), bits)
        big = fn.icmp("uge", a, const("i32", 0x7F800000))
        bits = fn.select(big, const("i32", nan_code), bits)
    isnan = fn.icmp("ugt", a, const("i32", 0x7F800000))
    bits = fn.select(isnan, const("i32", nan_code), bits)
    bits = fn.bin("or", bits, fn.bin("lshr", sign, const("i32", 32 - width)))
    return fn.cast("trunc", bits, store)


def _mini_to_f32(fn: Fn, raw: V, f: MiniFloat) -> V:
    """narrow float bits -> float32 (exact): shift the bits into place, rebias, and fix
    subnormals with one float subtract and the exponent-all-ones codes with selects."""
    width = f.ebits + f.mbits + 1
    shift = 23 - f.mbits
    w = fn.cast("zext", raw, "i32")
    if f.ebits == 8:  # bfloat16 is a truncated float32
        return fn.cast("bitcast", fn.bin("shl", w, const("i32", 16)), "float")
    mag = fn.bin("and", w, const("i32", (1 << (width - 1)) - 1))
    sign = fn.bin("shl", fn.bin("lshr", w, const("i32", width - 1)), const("i32", 31))
    o = fn.bin("add", fn.bin("shl", mag, const("i32", shift)), const("i32", (127 - f.bias) << 23))
    # subnormal: value = mantissa * 2^(1-bias-mbits); o holds 2^(1-bias) * (1 + m) - 2^(1-bias)
    sub_fix = fn.fsub(fn.cast("bitcast", fn.bin("add", o, const("i32", 1 << 23)), "float"),
                      fn.cast("bitcast", const("i32", (127 - f.bias + 1) << 23), "float"))
    is_sub = fn.icmp("ult", mag, const("i32", 1 << f.mbits))
    o = fn.select(is_sub, fn.cast("bitcast", sub_fix, "i32"), o)
    top = ((1 << f.ebits) - 1) << f.mbits
    if f.ieee:
        special = fn.icmp("uge", mag, const("i32", top))
        inf_nan = fn.bin("or", fn.bin("shl", fn.bin("and", mag, const("i32", (1 << f.mbits) - 1)),
                                      const("i32", shift)), const("i32", 0x7F800000))
        quiet = fn.select(fn.icmp("ugt", mag, const("i32", top)), fn.bin("or", inf_nan, const("i32", 0x400000)),
                          inf_nan)
        o = fn.select(special, quiet, o)
    else:
        is_nan = fn.icmp("eq", mag, const("i32", (1 << (width - 1)) - 1))
        o = fn.select(is_nan, const("i32", 0x7FC00000), o)
    return fn.cast("bitcast", fn.bin("or", o, sign), "float")
