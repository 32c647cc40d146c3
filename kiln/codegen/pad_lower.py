"""`pad` inside a fused kernel: an index remap with a constant fill.

Output position `i` of a padded dim (low `lo`, interior `it`, operand size `d`) holds
`x[(i - lo) / (it + 1)]` when `0 <= i - lo <= (d - 1) * (it + 1)` and `(i - lo)` is a
multiple of `it + 1`; elsewhere it holds the padding value (the op's rank-0 operand).
The kernel computes `select(in_bounds, load x[clamped], value)`: the load's index is
clamped into the operand (Min/Max in the index; all zero when a symbolic dim of the
operand is 0 at run time), so the load a select does not pick stays inside the buffer.
Before this, every `pad` ran as a numpy extern outside the compiled kernels (the
gradient of attention's q/k/v split: six per GPT step).
"""

from __future__ import annotations

import sympy

from kiln.codegen.kernel_ir import IndexValue, Op
from kiln.ir import dtypes as dt
from kiln.ir.graph import Node


def _static_zero(d) -> bool:
    return isinstance(d, int) and d == 0


def _cmp(name: str, a, b) -> Op:
    return Op(name, (IndexValue(sympy.sympify(a), dt.int64), IndexValue(sympy.sympify(b), dt.int64)),
              dt.bool_)


def _clamp(q, top):
    """`sympy.Max(sympy.Min(q, top), 0)`, the same expression, without sympy's Min/Max
    evaluation (3-8 ms a call: pairwise assumption queries; 21 ms of the GPT step's
    cold lowering for its six pads) where `q` is `s + k` or `s` for a nonnegative
    integer symbol `s` (a loop variable) and integer `k`, and `top` a nonnegative int:
    there `s` is unbounded above and may be 0, so `q >= top` is decided only when
    `k >= top` (Min is `top`), never `q <= top`, and `Min(top, q) >= 0` exactly when
    `k >= 0` (then Max drops its 0; with `top` 0 the result is 0). Anything else goes to
    sympy. tests/codegen/test_pad_lower_clamp.py checks it against sympy, srepr for srepr."""
    if isinstance(top, int) and top >= 0:
        s, k = (q, 0) if isinstance(q, sympy.Symbol) else q.as_coeff_Add()[::-1] \
            if isinstance(q, sympy.Add) and len(q.args) == 2 else (None, None)
        if isinstance(k, sympy.Integer):
            k = int(k)
        if isinstance(s, sympy.Symbol) and type(k) is int and s.is_integer and s.is_nonnegative:
            if k >= top or top == 0:  # Max(0, Min(0, q)) is 0 for every q
                return sympy.Integer(top)
            low = sympy.Min(sympy.Integer(top), q, evaluate=False)  # sympy's order: the number first
            return low if k >= 0 else sympy.Max(sympy.Integer(0), low, evaluate=False)
    return sympy.Max(sympy.Min(q, top), 0)


def lower_pad(gen, node: Node, index: tuple):
    """The Kernel IR expression of `pad`'s result at `index`; `gen(value, index)` lowers
    an operand (codegen/lower.py's generator)."""
    x, value = node.operands
    a = node.attrs
    interior = a.get("interior") or (0,) * len(index)
    fill = gen(value, ())
    if any(_static_zero(d) for d in x.shape):
        return fill  # nothing of x lands anywhere
    mapped, conds = [], []
    for i, d, lo, hi, it in zip(index, x.shape, a["low"], a["high"], interior):
        i = sympy.sympify(i)
        if lo == 0 and hi == 0 and it == 0:
            mapped.append(i)
            continue
        step = it + 1
        p = i - lo
        conds.append(_cmp("ge", p, 0))
        conds.append(_cmp("le", p, (d - 1) * step))
        if step > 1:
            conds.append(_cmp("eq", sympy.Mod(p, step), 0))
            q = sympy.floor(p / step)
        else:
            q = p
        mapped.append(_clamp(q, d - 1))
    symbolic = [sympy.sympify(d) for d in x.shape if not isinstance(d, int)]
    if symbolic:  # x empty at run time: every index 0, so the unpicked load stays in bounds
        nonempty = sympy.Min(1, sympy.Mul(*symbolic))
        mapped = [m * nonempty for m in mapped]
    inner = gen(x, tuple(mapped))
    if not conds:
        return inner
    keep = conds[0]
    for c in conds[1:]:
        keep = Op("and", (keep, c), dt.bool_)
    return Op("select", (keep, inner, fill), x.type.dtype)
