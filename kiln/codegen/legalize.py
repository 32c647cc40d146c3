"""Legalize: rewrite the scalar ops a backend's table lacks into ops it has, once for all.

Each backend declares, in `scalar_table`, the scalar ops it emits natively (see
kiln/codegen/backend.py). This Kernel IR pass walks every expression of a kernel and
replaces an op the table lacks by its rule here, then legalizes the replacement in
turn. The semantics that used to be written once per backend live here only:

- integer `div`/`rem`: x / 0 == 0, x % 0 == 0, INT_MIN / -1 == INT_MIN (numpy wraps),
  around the *unchecked* machine ops `div_unchecked`/`rem_unchecked` (C semantics);
- integer `pow`: square-and-multiply over every exponent bit, C's rules for negative
  exponents (bases 1 and -1 give +-1, others 0);
- shifts: amounts clamped (>= width gives 0, or the sign for arithmetic shifts) around
  `shl_unchecked` / `shr_logical_unchecked` / `shr_arith_unchecked`;
- float64 -> bfloat16/float8 through a round-to-odd float32 (no double rounding);
- clamp, sign, isnan, isinf, isfinite, NaN-propagating float max/min, bool reductions;
- transcendentals as polynomials (kiln/codegen/transcendental.py) for a backend
  without a math library;
- any elementwise op of the registry with a `decompose` rule (written against
  `kiln.ir.emitter.Emitter`, as composites are): a new op needs no backend edit.

    >>> legalize_kernel(kernel, backend.native, "c")   # what Backend.legalize does

A pair (op, dtypes) that is neither native nor has a rule raises K372, naming both.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from kiln.codegen.kernel_ir import BatchKernel, Const, GemmKernel, Kernel, Op, Reduce
from kiln.errors import KilnNotLegalizableError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.dtypes import DType
from kiln.ir.emitter import Emitter
from kiln.ir.registry import ELEMENTWISE
from kiln.ir.types import TensorType

NativeFn = Callable[[str, Sequence[DType], DType], bool]

# Kernel-IR-only ops legalize introduces: C semantics, operands guaranteed in range
# (divisor nonzero and no INT_MIN / -1; shift amount in [0, width)). numpy meaning below.
MACHINE_OPS = {
    "div_unchecked": lambda a, b: _c_div(a, b),
    "rem_unchecked": lambda a, b: a - _c_div(a, b) * b,
    "shl_unchecked": lambda a, b: np.left_shift(a, b.astype(a.dtype)),
    "shr_logical_unchecked": lambda a, b: np.right_shift(
        a.view(np.dtype(f"u{a.dtype.itemsize}")), b.astype(f"u{a.dtype.itemsize}")).view(a.dtype),
    "shr_arith_unchecked": lambda a, b: np.right_shift(a, b.astype(a.dtype)),
}
_MAX_DEPTH = 64  # rules nest (sign -> select -> ...); a cycle would recurse forever


def _c_div(a, b):
    with np.errstate(all="ignore"):
        q = np.floor_divide(a, b)
        fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
        return (q + fix.astype(a.dtype)).astype(a.dtype)


def not_native(backend: str, op: str, arg_dtypes: Sequence[DType], out: DType) -> KilnNotLegalizableError:
    types = ", ".join(d.name for d in arg_dtypes)
    return KilnNotLegalizableError(
        f"{backend} backend: scalar op '{op}' on ({types}) -> {out.name} is neither in the backend's "
        "scalar_table nor rewritable by the legalize pass into ops the table has",
        hint="add the op to the backend's scalar_table, or give the op a `decompose` rule in its "
             "registry entry (see docs/backends.md)")


# -- building expressions --------------------------------------------------------------

_BOOL_RESULT = {"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite"}


def mk(op: str, *args, dtype: DType | None = None) -> Op:
    """An Op whose dtype follows from its operands (bool for compares, the branches'
    for select) unless given; Python numbers become constants of the operands' dtype."""
    like = next(a.dtype for a in (args[1:] if op == "select" else args) if not _is_num(a))
    args = tuple(Const(a, like) if _is_num(a) else a for a in args)
    if dtype is None:
        dtype = dt.bool_ if op in _BOOL_RESULT else like
    return Op(op, args, dtype)


def _is_num(x) -> bool:
    return isinstance(x, (bool, int, float))


def const(value, d: DType) -> Const:
    return Const(value, d)


class ScalarEmitter(Emitter):
    """The graph-level `Emitter` over scalar Kernel IR expressions, so a registry op's
    `decompose` rule (written for graphs) expands a scalar op too."""

    def type_of(self, x) -> TensorType:
        return TensorType(x.dtype, ())

    def constant(self, array: np.ndarray):
        return Const(array.item(), dt.from_numpy(array.dtype))

    def apply(self, op: str, operands, attrs: dict) -> list:
        if op == "full":
            return [Const(attrs["value"], dt.dtype(attrs["dtype"]))]
        if op == "broadcast_in_dim":
            return [operands[0]]
        opdef = registry.get(op)
        if opdef.kind != ELEMENTWISE:
            raise KilnNotLegalizableError(f"legalize: a scalar decomposition used '{op}', which is not "
                                          "an elementwise op")
        (t,) = opdef.infer([self.type_of(x) for x in operands], opdef.normalize_attrs(attrs))
        return [Op(op, tuple(operands), t.dtype)]


# -- rules: op -> fn(args, out) -> Expr, or None where the rule does not apply ------------

def _int(d: DType) -> bool:
    return d.is_integer and not d.is_bool


def _divrem(op):
    def rule(a, out):
        x, y = a
        d = x.dtype
        if d.is_bool and op == "rem":
            return const(False, d)  # x % True == 0 and x % False == 0 (numpy's x % 0)
        if not _int(d):
            return None
        zero = mk("eq", y, 0)
        if d.category == dt.UINT:
            bad = zero
        else:
            bad = mk("or", zero, mk("and", mk("eq", x, int(np.iinfo(d.np_dtype).min)), mk("eq", y, -1)))
        safe = mk("select", bad, const(1, d), y)
        if op == "div":
            return mk("select", zero, const(0, d), mk("div_unchecked", x, safe))
        return mk("select", bad, const(0, d), mk("rem_unchecked", x, safe))

    return rule


def _int_pow(a, out):
    base, exp = a
    d = base.dtype
    if not _int(d):
        return None
    unsigned = d.category == dt.UINT
    one = const(1, d)
    result, b, e = one, base, exp
    for _ in range(d.bits if unsigned else d.bits - 1):
        bit = mk("ne", mk("and", e, 1), 0)
        result = mk("select", bit, mk("mul", result, b), result)
        b = mk("mul", b, b)
        e = mk("shr_logical_unchecked", e, 1)
    if unsigned:
        return result
    odd = mk("ne", mk("and", exp, 1), 0)
    minus = mk("select", odd, const(-1, d), one)
    negative = mk("select", mk("eq", base, 1), one, mk("select", mk("eq", base, -1), minus, const(0, d)))
    return mk("select", mk("lt", exp, 0), negative, result)


def _shift(op):
    def rule(a, out):
        x, y = a
        d = x.dtype
        if not _int(d):
            return None
        bits = d.bits
        amount = y if d.category == dt.UINT else mk("max", y, 0)
        too_big = mk("ge", amount, bits)
        capped = mk("min", amount, bits - 1)
        if op == "shift_right_arithmetic":
            return mk("shr_arith_unchecked", x, capped)
        machine = "shl_unchecked" if op == "shift_left" else "shr_logical_unchecked"
        return mk("select", too_big, const(0, d), mk(machine, x, capped))

    return rule


def _clamp(a, out):
    return mk("min", mk("max", a[0], a[1]), a[2])


def _sign(a, out):
    (x,) = a
    d = x.dtype
    if d.is_bool:
        return None
    if d.is_floating:  # NaN and +-0 come through unchanged, as numpy's sign
        return mk("select", mk("gt", x, 0.0), const(1.0, d),
                  mk("select", mk("lt", x, 0.0), const(-1.0, d), x))
    if d.category == dt.UINT:
        return mk("convert", mk("ne", x, 0), dtype=d)
    return mk("sub", mk("convert", mk("gt", x, 0), dtype=d), mk("convert", mk("lt", x, 0), dtype=d))


def _isnan(a, out):
    return mk("ne", a[0], a[0])


def _isinf(a, out):
    return mk("eq", mk("abs", a[0]), float("inf"))


def _isfinite(a, out):
    return mk("lt", mk("abs", a[0]), float("inf"))


def _float_extremum(op):
    """NaN-propagating max/min over compare + select; +0 beats -0 for max (and -0 for
    min), as IEEE maximum/minimum and numpy do."""
    def rule(a, out):
        x, y = a
        if not x.dtype.is_floating:
            return None
        pick = mk("select", mk("gt" if op == "max" else "lt", x, y), x, y)
        both_zero = mk("and", mk("eq", x, 0.0), mk("eq", y, 0.0))
        # for zeros: max is -0 only if both are (x + y); min is +0 only if both are
        zero = mk("add", x, y) if op == "max" else mk("neg", mk("add", mk("neg", x), mk("neg", y)))
        value = mk("select", both_zero, zero, pick)
        return mk("select", mk("ne", x, x), x, mk("select", mk("ne", y, y), y, value))

    return rule


def _int_extremum(op):
    def rule(a, out):
        x, y = a
        if x.dtype.is_floating:
            return None
        if x.dtype.is_bool:
            return mk("or" if op == "max" else "and", x, y)
        return mk("select", mk("gt" if op == "max" else "lt", x, y), x, y)

    return rule


def _convert(a, out):
    """float64 -> bfloat16 / float8: through float32 rounded to odd, then once to `out`."""
    (x,) = a
    if not (x.dtype == dt.float64 and out.is_floating and out.bits < 32 and out.short != "f16"):
        return None
    r = mk("convert", x, dtype=dt.float32)
    back = mk("convert", r, dtype=dt.float64)
    bits = mk("bitcast_convert", r, dtype=dt.int32)
    # round-to-nearest went away from zero: step one ulp toward zero (the truncation)
    overshoot = mk("and", mk("gt", mk("abs", back), mk("abs", x)), mk("lt", mk("abs", back), float("inf")))
    bits = mk("select", overshoot, mk("sub", bits, 1), bits)
    inexact = mk("and", mk("ne", back, x), mk("eq", x, x))
    bits = mk("select", inexact, mk("or", bits, 1), bits)
    return mk("convert", mk("bitcast_convert", bits, dtype=dt.float32), dtype=out)


def _rsqrt(a, out):
    if not a[0].dtype.is_floating:
        return None
    return mk("div", const(1.0, a[0].dtype), mk("sqrt", a[0]))


def _not(a, out):
    (x,) = a
    return mk("xor", x, const(True if x.dtype.is_bool else -1, x.dtype))


def _neg(a, out):
    (x,) = a
    if x.dtype.is_floating:
        return mk("sub", const(-0.0, x.dtype), x)
    return mk("sub", const(0, x.dtype), x) if not x.dtype.is_bool else None


def _abs(a, out):
    (x,) = a
    d = x.dtype
    if d.is_bool or d.category == dt.UINT:
        return x if not d.is_bool else None
    if d.is_floating:  # clear the sign bit: -0 -> 0, NaN stays NaN
        ity = dt.int64 if d == dt.float64 else (dt.int32 if d.bits == 32 else None)
        if ity is None:
            return None
        mask = (1 << (ity.bits - 1)) - 1
        return mk("bitcast_convert", mk("and", mk("bitcast_convert", x, dtype=ity), mask), dtype=d)
    return mk("select", mk("lt", x, 0), mk("sub", const(0, d), x), x)


RULES: dict[str, Callable] = {
    "div": _divrem("div"), "rem": _divrem("rem"), "pow": _int_pow,
    "shift_left": _shift("shift_left"), "shift_right_logical": _shift("shift_right_logical"),
    "shift_right_arithmetic": _shift("shift_right_arithmetic"),
    "clamp": _clamp, "sign": _sign, "isnan": _isnan, "isinf": _isinf, "isfinite": _isfinite,
    "convert": _convert, "rsqrt": _rsqrt, "not": _not, "neg": _neg, "abs": _abs,
}


def _max_rule(op):
    f, i = _float_extremum(op), _int_extremum(op)
    return lambda a, out: f(a, out) if a[0].dtype.is_floating else i(a, out)


RULES["max"], RULES["min"] = _max_rule("max"), _max_rule("min")


def rule_for(op: str, args: tuple, out: DType):
    """The rewrite of `op(args)` (one step), or None where no rule applies."""
    from kiln.codegen import transcendental

    if out.is_complex or any(a.dtype.is_complex for a in args):
        return None  # complex kernels are not lowered (the cpu backend runs them by parts)
    rule = RULES.get(op)
    if rule is not None:
        done = rule(args, out)
        if done is not None:
            return done
    done = transcendental.expand(op, args, out)
    if done is not None:
        return done
    if op in MACHINE_OPS:
        return None
    opdef = registry.get(op)
    if opdef.kind == ELEMENTWISE and opdef.decompose is not None:
        (value,) = ScalarEmitter().decompose(op, list(args), {})
        return value
    return None


# -- reductions -------------------------------------------------------------------------

def reduce_key(op: str) -> str:
    """The table key of Kernel IR reduction `op` ("reduce.sum", ...)."""
    return f"reduce.{op}"


_BOOL_REDUCE = {"sum": "or", "max": "or", "prod": "and", "min": "and"}


def reduce_identity(op: str, d: DType):
    """The value a reduction starts from (numpy's identities; +-inf for float max/min)."""
    if d.is_bool:
        return _BOOL_REDUCE.get(op, op) in ("and",)
    if op == "sum":
        return 0.0 if d.is_floating else 0
    if op == "prod":
        return 1.0 if d.is_floating else 1
    if d.is_floating:
        return -float("inf") if op == "max" else float("inf")
    info = np.iinfo(d.np_dtype)
    if op == "and":
        return -1 if d.category != dt.UINT else int(info.max)
    if op == "or":
        return 0
    return int(info.min) if op == "max" else int(info.max)


def _legal_reduce(r: Reduce, native: NativeFn, backend: str) -> Reduce:
    d = r.dtype
    if native(reduce_key(r.op), [d], d):
        return r
    if d.is_bool and r.op in _BOOL_REDUCE and native(reduce_key(_BOOL_REDUCE[r.op]), [d], d):
        return replace(r, op=_BOOL_REDUCE[r.op])
    raise not_native(backend, reduce_key(r.op), [d], d)


# -- the pass -----------------------------------------------------------------------------

def legalize_expr(e, native: NativeFn, backend: str, memo: dict | None = None):
    """`e` with every op `native` rejects rewritten (recursively); K372 when stuck."""
    memo = {} if memo is None else memo

    def visit(x, depth: int):
        if x in memo:
            return memo[x]
        if not isinstance(x, Op):
            return x
        if depth > _MAX_DEPTH:
            raise not_native(backend, x.op, [a.dtype for a in x.args], x.dtype)
        args = tuple(visit(a, depth) for a in x.args)
        node = x if args == x.args else Op(x.op, args, x.dtype)
        dtypes = [a.dtype for a in args]
        if not native(x.op, dtypes, x.dtype):
            rewritten = rule_for(x.op, args, x.dtype)
            if rewritten is None:
                raise not_native(backend, x.op, dtypes, x.dtype)
            node = visit(rewritten, depth + 1)
        memo[x] = node
        return node

    return visit(e, 0)


def legalize_kernel(kernel, native: NativeFn, backend: str):
    """`kernel` with every scalar op and reduction the backend lacks rewritten. Returns
    the same object when nothing changed (golden sources stay byte-identical)."""
    memo: dict = {}
    if isinstance(kernel, BatchKernel):  # a batched launch: each member legalized
        return kernel.with_members(legalize_kernel(m, native, backend) for m in kernel.members)
    if isinstance(kernel, GemmKernel):
        epilogue = legalize_expr(kernel.epilogue, native, backend, memo)
        return kernel if epilogue == kernel.epilogue else replace(kernel, epilogue=epilogue)
    if not isinstance(kernel, Kernel):
        return kernel
    stages = []
    for st in kernel.stages:
        value = legalize_expr(st.value, native, backend, memo)
        new = st if value == st.value else replace(st, value=value)
        if isinstance(new, Reduce):
            new = _legal_reduce(new, native, backend)
        stages.append(new)
    stages = tuple(stages)
    return kernel if stages == kernel.stages else replace(kernel, stages=stages)


# -- evaluating legalized expressions with numpy (machine ops included) --------------------

def evaluate(e, env: dict):
    """The numpy value of a scalar expression over `env` (Load buffer name -> array),
    machine ops included: the oracle tests compare legalized expressions against."""
    from kiln.codegen.kernel_ir import Load
    from kiln.ir.emitter import EAGER

    memo: dict = {}

    def val(x):
        if x in memo:
            return memo[x]
        if isinstance(x, Const):
            v = np.asarray(x.value).astype(x.dtype.np_dtype)
        elif isinstance(x, Load):
            v = np.asarray(env[x.buffer]).astype(x.dtype.np_dtype)
        else:
            args = [val(a) for a in x.args]
            shape = np.broadcast_shapes(*[np.shape(a) for a in args])
            args = [np.ascontiguousarray(np.broadcast_to(a, shape)) for a in args]
            if x.op in MACHINE_OPS:
                with np.errstate(all="ignore"):
                    v = np.asarray(MACHINE_OPS[x.op](*args)).astype(x.dtype.np_dtype)
            else:
                attrs = {"dtype": x.dtype} if "dtype" in registry.get(x.op).attrs else {}
                with np.errstate(all="ignore"):
                    (v,) = EAGER.apply(x.op, args, attrs)
        memo[x] = v
        return v

    return val(e)
