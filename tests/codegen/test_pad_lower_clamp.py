"""pad's clamped index (codegen/pad_lower.py `_clamp`) is exactly sympy's
`Max(Min(q, top), 0)`: the same expression tree (srepr), hash and arguments, for loop
variables shifted by any integer and any nonnegative top, and for the forms it leaves to
sympy (other symbols, products, floors, symbolic tops)."""

import sympy

from kiln.codegen.kernel_ir import loop_var
from kiln.codegen.pad_lower import _clamp


def _same(q, top):
    want = sympy.Max(sympy.Min(q, top), 0)
    got = _clamp(q, top)
    assert sympy.srepr(got) == sympy.srepr(want), (q, top)
    assert got == want and hash(got) == hash(want) and got.args == want.args


def test_a_shifted_loop_variable_clamps_as_sympy_does():
    for name in ("i0", "i3"):
        s = loop_var(name)
        for k in (-70, -65, -64, -63, -2, -1, 0, 1, 2, 31, 63, 64, 65, 100):
            for top in (0, 1, 2, 31, 63, 64, 65, 127):
                _same(s + k, top)
        _same(s, 0)


def test_other_forms_are_sympys():
    i, j = loop_var("i0"), loop_var("i1")
    plain = sympy.Symbol("x")  # no assumptions
    n = sympy.Symbol("N", integer=True, positive=True)
    for q in (plain - 3, 2 * i - 1, i + j - 4, sympy.floor((i - 3) / 2), -i + 5, i - n):
        for top in (0, 7):
            _same(q, top)
    _same(i - 2, n - 1)  # a symbolic top
