"""The op x backend walk: every elementwise op and every Kernel IR reduction of the
registry, on every dtype its type rule accepts, is native to each registered backend or
legalized into ops the backend's table has -- and the legalized expression computes what
the op's numpy reference does (the rules are checked against the oracle here, once, for
every table). A table with no math library exercises the polynomial transcendentals."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.backend import get_backend, lookup, registered_backends
from kiln.codegen.kernel_ir import REDUCE_OPS, Const, Load, Op, walk
from kiln.codegen.legalize import MACHINE_OPS, evaluate, legalize_expr, legalize_kernel
from kiln.errors import KilnError, KilnNotLegalizableError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.registry import ELEMENTWISE
from kiln.ir.types import TensorType
from tests.codegen import c_backend

DTYPES = (dt.float32, dt.float64, dt.float16, dt.bfloat16, dt.float8_e4m3fn, dt.int8, dt.int16,
          dt.int32, dt.int64, dt.uint8, dt.uint32, dt.bool_)
# C arithmetic with no <math.h> but fmod (float `rem` has no exact cheap rewrite, so it
# stays native everywhere): what a backend without a math library has
NO_MATH = {k: v for k, v in c_backend.SCALAR_TABLE.items()
           if not k.split(":")[0] in ("exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos",
                                      "atan", "atan2", "sinh", "cosh", "tanh", "erf", "pow")}
NO_MATH.update({"floor:float": 1, "sqrt:float": 1, "bitcast_convert": 1})


class _Table:
    def __init__(self, name, table):
        self.name, self.scalar_table = name, table

    def native(self, op, arg_dtypes, out):
        return lookup(self.scalar_table, op, arg_dtypes, out) is not None


def _tables():
    """Every registered backend's table, the toy C backend's and the no-math one."""
    out = [get_backend(example.split(",")[0]) for example in registered_backends().values()]
    return out + [c_backend.CBackend(), _Table("no-math", NO_MATH)]


def _elementwise_cases():
    cases = []
    for name, opdef in sorted(registry.all_ops().items()):
        if opdef.kind != ELEMENTWISE or name in ("bitcast_convert",):
            continue
        for d in DTYPES:
            types = [TensorType(d, (4,))] * (opdef.num_operands or 1)
            attrs = {"dtype": d} if "dtype" in opdef.attrs else {}
            try:
                (out,) = opdef.infer(types, opdef.normalize_attrs(attrs))
            except KilnError:
                continue  # the type rule rejects the dtype: nothing to lower
            if out.dtype.is_complex:
                continue  # complex64 is decomposed into real/imag parts before lowering
            if name == "select":
                types = [TensorType(dt.bool_, (4,))] + types[1:]
            cases.append((name, tuple(t.dtype for t in types), out.dtype))
    return cases


CASES = _elementwise_cases()


def test_the_walk_covers_the_registry():
    names = {c[0] for c in CASES}
    ew = {n for n, o in registry.all_ops().items() if o.kind == ELEMENTWISE}
    # complex parts have no scalar kernel: complex64 is decomposed into real/imag before lowering
    assert ew - names - {"bitcast_convert"} == {"real", "imag", "complex"}
    assert "erfc" in names and ("convert", (dt.float64,), dt.float64) in CASES


def _inputs(d, rng, n=64):
    if d.is_bool:
        return rng.integers(0, 2, n).astype(bool)
    if d.is_floating:
        special = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, np.inf, -np.inf, np.nan, 3.0, 30.0, -7.0]
        x = np.concatenate([special, rng.standard_normal(n) * 4])
        return x.astype(d.np_dtype)
    info = np.iinfo(d.np_dtype)
    edges = [0, 1, info.max, info.min, 2, 7] + ([-1, -2, -7] if info.min < 0 else [])
    return np.concatenate([edges, rng.integers(info.min, info.max, n, endpoint=True)]).astype(d.np_dtype)


def _tolerance(table: str, op: str, d):
    if not d.is_floating or d.bits < 32:
        return 0.0, 0.0  # integers exact; low precision rounds once from float32
    transcendental = op in ("exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
                            "atan2", "sinh", "cosh", "tanh", "erf", "erfc", "pow")
    if d == dt.float64:
        if table == "no-math" and op in ("erf", "pow"):
            return 3e-7, 1e-12  # float32-grade, as documented in transcendental.py
        return 1e-12, 1e-300
    return (4e-6, 1e-30) if transcendental or op == "rsqrt" else (1e-7, 0.0)


@pytest.mark.parametrize("table", _tables(), ids=lambda t: t.name)
def test_every_elementwise_op_is_native_or_legalized_and_correct(table):
    rng = np.random.default_rng(0)
    failures = []
    for name, arg_dtypes, out in CASES:
        args = tuple(Load(f"x{i}", 0, d) for i, d in enumerate(arg_dtypes))
        e = Op(name, args, out)
        held = getattr(table, "dtypes", None)
        if held is not None and any(d.short not in held for d in (*arg_dtypes, out)):
            with pytest.raises(KilnNotLegalizableError):  # a dtype the backend lacks: a clear K372
                legalize_expr(e, table.native, table.name)
            continue
        try:
            legal = legalize_expr(e, table.native, table.name)
        except KilnNotLegalizableError as err:
            failures.append(f"{name}{[d.short for d in arg_dtypes]}: {err.message}")
            continue
        for x in walk(legal):
            if isinstance(x, Op) and not table.native(x.op, [a.dtype for a in x.args], x.dtype):
                failures.append(f"{name}: legalized into {x.op}, which {table.name} lacks")
        if legal is e or any(d.bits < 32 and d.is_floating for d in arg_dtypes) and name not in (
                "convert", "erfc"):
            continue  # native: the backend's own tests check its numerics
        env = {f"x{i}": _inputs(d, rng) for i, d in enumerate(arg_dtypes)}
        if name in ("shift_left", "shift_right_logical", "shift_right_arithmetic", "pow") and not out.is_floating:
            env["x1"] = (np.abs(env["x1"].astype(np.int64)) % 70 - (0 if out.category == dt.UINT else 3)
                         ).astype(arg_dtypes[1].np_dtype)
        if name == "select":
            env["x0"] = rng.integers(0, 2, len(env["x1"])).astype(bool)
        n = min(len(v) for v in env.values())
        env = {k: v[:n] for k, v in env.items()}
        arrays = [env[f"x{i}"] for i in range(len(arg_dtypes))]
        with np.errstate(all="ignore"):
            want = registry.get(name).reference(*arrays, **({"dtype": out} if name == "convert" else {}))
        got = evaluate(legal, env)
        rtol, atol = _tolerance(table.name, name, out)
        try:
            if out.is_floating:
                np.testing.assert_allclose(got.astype(np.float64), np.asarray(want).astype(np.float64),
                                           rtol=rtol, atol=atol, equal_nan=True)
            else:
                np.testing.assert_array_equal(got, want)
        except AssertionError as err:
            failures.append(f"{name}{[d.short for d in arg_dtypes]} -> {out.short} on {table.name}: {err}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("table", _tables(), ids=lambda t: t.name)
def test_every_reduction_is_native_or_legalized(table):
    from kiln.codegen.kernel_ir import BufferParam, Kernel, Loop, Reduce, Store

    for op in REDUCE_OPS:
        opdef = registry.get(f"reduce_{op}")
        for d in DTYPES:
            try:
                opdef.infer([TensorType(d, (4,))], opdef.normalize_attrs({"axes": (0,)}))
            except KilnError:
                continue
            r = Reduce("acc0", op, (Loop("r0", 4),), Load("x", 0, d), d)
            k = Kernel("k", (BufferParam("x", d, (4,), "in"), BufferParam("y", d, (1,), "out")), (), (),
                       (r, Store("y", 0, Op("convert", (Const(0, d),), d))))
            held = getattr(table, "dtypes", None)
            if held is not None and d.short not in held:
                with pytest.raises(KilnNotLegalizableError, match="reduce"):
                    legalize_kernel(k, table.native, table.name)
                continue
            legal = legalize_kernel(k, table.native, table.name).stages[0]
            assert table.native(f"reduce.{legal.op}", [d], d), (op, d.name, table.name)
            if legal.op != op:  # bool sum/max -> or, prod/min -> and: numpy's meaning on bool
                x = np.array([True, False, True, True])
                assert getattr(np, {"or": "any", "and": "all"}[legal.op])(x) == opdef.reference(x, axes=(0,))


def test_a_pair_neither_native_nor_legalizable_names_backend_op_and_dtypes():
    e = Op("exp", (Load("x", 0, dt.float32),), dt.float32)
    bare = _Table("bare", {"add:float": 1})
    with pytest.raises(KilnNotLegalizableError, match=r"bare backend: scalar op '\w+' on \(float32") as info:
        legalize_expr(e, bare.native, "bare")
    assert info.value.code == "K372" and "scalar_table" in str(info.value)


def test_machine_ops_are_not_registry_ops_and_have_numpy_meaning():
    for name in MACHINE_OPS:
        assert name not in registry.all_ops()
    a, b = np.array([-7, 7, -128], np.int8), np.array([2, -2, 3], np.int8)
    np.testing.assert_array_equal(MACHINE_OPS["div_unchecked"](a, b), [-3, -3, -42])
    np.testing.assert_array_equal(MACHINE_OPS["rem_unchecked"](a, b), [-1, 1, -2])
    np.testing.assert_array_equal(MACHINE_OPS["shr_logical_unchecked"](a, np.array([1, 1, 1], np.int8)),
                                  [124, 3, 64])


def test_native_tables_leave_kernels_untouched():
    """A kernel whose ops are all native comes back as the same object: the CPU and Triton
    sources of such kernels do not change (their goldens test that too)."""
    x = Load("x", 0, dt.float32)
    from kiln.codegen.kernel_ir import BufferParam, Kernel, Loop, Store

    k = Kernel("k", (BufferParam("x", dt.float32, (4,), "in"), BufferParam("y", dt.float32, (4,), "out")), (),
               (Loop("i0", 4),), (Store("y", 0, Op("exp", (Op("mul", (x, x), dt.float32),), dt.float32)),))
    for target in ("cpu", "cuda", "reference"):
        assert get_backend(target).legalize(k) is k
