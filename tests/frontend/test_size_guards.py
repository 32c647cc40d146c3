"""Python decisions on symbolic sizes (`x.shape[0] > 4`, `if x.shape[1] % 2:`,
`range(x.shape[0])`, `max(x.shape[0], 2)`): decided by the declared ranges without a
guard, else guarded (kn.compile recompiles when the answer changes), else K141 (strict,
trace, export). No sympy exception reaches the user (kiln/frontend/shape_guards.py)."""

import math
import operator

import numpy as np
import pytest
import sympy

import kiln as kn
from kiln import ShapeVar, TensorSpec
from kiln.errors import KilnError

F32 = np.float32
N = ShapeVar("N", min=1, max=64)
SPEC = {"x": TensorSpec([N, 3])}

# every Python use of a size a program makes: the result is turned into a float below
OPS = {
    "gt": lambda n: n > 4, "ge": lambda n: n >= 4, "lt": lambda n: n < 4, "le": lambda n: n <= 4,
    "eq": lambda n: n == 6, "ne": lambda n: n != 6, "rgt": lambda n: 4 > n, "bool": lambda n: bool(n - 6),
    "not": lambda n: not (n - 3), "mod": lambda n: n % 2, "rmod": lambda n: 7 % n,
    "floordiv": lambda n: n // 2, "rfloordiv": lambda n: 13 // n, "truediv": lambda n: n / 4,
    "rtruediv": lambda n: 12 / n, "pow": lambda n: n ** 2, "rpow": lambda n: 2 ** n,
    "neg": lambda n: -n, "pos": lambda n: +n, "abs": lambda n: abs(n - 5),
    "divmod": lambda n: sum(divmod(n, 4)), "rdivmod": lambda n: divmod(20, n)[1],
    "mul_float": lambda n: n * 1.5, "sub": lambda n: 10 - n, "int": lambda n: int(n),
    "float": lambda n: float(n), "index": lambda n: [10, 20, 30, 40, 50, 60, 70, 80][n],
    "range": lambda n: sum(range(n)), "len_list": lambda n: len([0] * n),
    "max": lambda n: max(n, 5), "min": lambda n: min(n, 5), "floor": lambda n: math.floor(n / 4),
    "ceil": lambda n: math.ceil(n / 4), "round": lambda n: round(n / 4), "round_int": lambda n: round(n),
    "trunc": lambda n: math.trunc(n / 4), "shape_eq": None, "mod_if": lambda n: 1 if n % 2 else 0,
    "chain": lambda n: 2 < n <= 6, "format": lambda n: len(f"{n}"), "hash": lambda n: hash(n) == hash(n),
}


def _shape_eq(x):
    return x.shape == (6, 3)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_python_use_of_a_size_matches_eager(name):
    op = OPS[name]

    def f(x):
        value = _shape_eq(x) if op is None else op(x.shape[0])
        return x[:1] * 0 + float(value)

    cf = kn.compile(f, dynamic_shapes=SPEC)
    for n in (6, 3, 7, 6):
        x = np.ones((n, 3), F32)
        want = f(kn.tensor(x)).numpy()
        np.testing.assert_allclose(cf(x).numpy(), want, rtol=1e-6, err_msg=f"n={n}")
    stats = cf.stats()
    assert stats["compiles"] <= 3 and stats["hits"] >= 1  # a guard serves the repeated size


def test_ranges_decide_without_a_guard():
    big = {"x": TensorSpec([ShapeVar("B", min=8, max=64), 3])}
    even = {"x": TensorSpec([ShapeVar("E", min=6, max=64, multiple_of=2), 3])}

    def f(x):
        assert x.shape[0] > 4 and x.shape[0] <= 64 and max(x.shape[0], 2) == x.shape[0]
        return x * (2.0 if x.shape[0] % 2 == 0 else 3.0)

    cf = kn.compile(f, dynamic_shapes=big)
    for n in (8, 9, 30):
        np.testing.assert_array_equal(cf(np.ones((n, 3), F32)).numpy()[0, 0], 2.0 if n % 2 == 0 else 3.0)
    assert cf.stats()["compiles"] == 2  # `% 2` is open for B: guarded, two answers
    ce = kn.compile(f, dynamic_shapes=even)
    for n in (8, 10, 30):
        np.testing.assert_array_equal(ce(np.ones((n, 3), F32)).numpy()[0, 0], 2.0)
    stats = ce.stats()
    assert stats["compiles"] == 1 and stats["size_guards"] == [[]]  # multiple_of=2 decides it


def test_a_failed_guard_recompiles_naming_it_and_counts_toward_the_limit():
    def f(x):
        if x.shape[0] > 4:
            return x * 2
        return x - 1

    cf = kn.compile(f, dynamic_shapes=SPEC, recompile_limit=2)
    np.testing.assert_array_equal(cf(np.ones((6, 3), F32)).numpy(), np.full((6, 3), 2, F32))
    np.testing.assert_array_equal(cf(np.ones((2, 3), F32)).numpy(), np.zeros((2, 3), F32))
    np.testing.assert_array_equal(cf(np.ones((9, 3), F32)).numpy(), np.full((9, 3), 2, F32))
    stats = cf.stats()
    assert stats["compiles"] == 2 and stats["hits"] == 1
    reason = stats["recompiles"][0]["reason"]
    assert "N > 4" in reason and "is True" in reason and "N=2" in reason and "x.shape[0] > 4" in reason
    range_of = kn.compile(lambda x: x * len(range(x.shape[0])), dynamic_shapes=SPEC, recompile_limit=2)
    range_of(np.ones((2, 3), F32))
    range_of(np.ones((3, 3), F32))
    with pytest.raises(kn.KilnError, match="recompile_limit=2"):
        range_of(np.ones((4, 3), F32))


def test_strict_trace_and_export_refuse_with_k141():
    def f(x):
        return x * 2 if x.shape[0] > 4 else x

    with pytest.raises(kn.KilnConcretizationError, match=r"K141.*N > 4.*N in \[1, 64\]"):
        kn.compile(f, dynamic_shapes=SPEC, strict=True)(np.ones((6, 3), F32))
    with pytest.raises(kn.KilnConcretizationError, match="K141"):
        kn.export(f, (np.ones((6, 3), F32),), dynamic_shapes=SPEC)
    with pytest.raises(kn.KilnConcretizationError, match="Python int"):
        kn.trace(lambda x: x * len(range(x.shape[0])), np.ones((6, 3), F32), dynamic_shapes=SPEC)


def test_a_size_as_a_tensor_value_is_computed_in_the_graph():
    def f(x, i):
        n = x.shape[0]
        mean = x.sum(0) / n  # torch code: a SymInt as a weak Python number
        return (mean * 2 + n - (n // 2) + x[0] * (n % 3) + 1.0 / n + n ** 2 + x[1] * n ** -0.5,
                i + n, i * (n / 4))

    def ref(x, i):
        n = x.shape[0]
        return (x.sum(0) / n * 2 + n - n // 2 + x[0] * (n % 3) + 1.0 / n + n ** 2 + x[1] * n ** -0.5,
                i + n, i * (n / 4))

    cf = kn.compile(f, dynamic_shapes={"x": TensorSpec([N, 3]), "i": None})
    for n in (3, 7, 12):
        x, i = np.random.default_rng(n).standard_normal((n, 3)).astype(F32), np.arange(3)
        got, want = cf(x, i), ref(x, i)
        np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-5)
        assert got[0].dtype == kn.float32 and got[1].dtype == kn.int64
        np.testing.assert_array_equal(got[1].numpy(), want[1])
        np.testing.assert_allclose(got[2].numpy(), want[2], rtol=1e-6)
    assert cf.stats()["compiles"] == 1 and cf.stats()["size_guards"] == [[]]
    with pytest.raises(KilnError, match="K140"):  # an expression it does not evaluate
        kn.trace(lambda x: x * abs(x.shape[0] - 5), np.ones((6, 3), F32), dynamic_shapes=SPEC)


def test_kiln_internals_still_see_sympy_dims():
    seen = {}

    def f(x):
        seen["user"] = x.shape[0]
        return kn.zeros(x.shape).sum() + x.reshape(x.shape[0] * 3).sum()

    g = kn.trace(f, np.ones((6, 3), F32), dynamic_shapes=SPEC)
    assert isinstance(g.inputs[0].type.shape[0], sympy.Symbol)
    assert not isinstance(seen["user"], sympy.Basic) and str(seen["user"]) == "N"
    assert operator.index(3) == 3  # the module's own names are untouched
