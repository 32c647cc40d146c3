"""Index arithmetic in C-family kernels: sympy index expressions as `long` C, the
floor-division helpers they call, and flat-index decomposition."""

from __future__ import annotations

import re

import sympy

from kiln.errors import KilnBackendContractError

# Python's floor division and modulo (the Kernel IR's) in C, whose / and % truncate
INDEX_HELPERS = """inline long kiln_floordiv(long a, long b) {
  long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long kiln_mod(long a, long b) {
  long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""


def index_c(e, names: dict) -> str:
    """A sympy index expression as `long` C; `names` maps symbol names to C names.
    Floor division and Mod keep Python's signs (kiln_floordiv / kiln_mod).

        >>> index_c(sympy.Symbol("i") * 4 + 1, {"i": "v_i"})   # '(1L + 4L * v_i)' (sympy's order)
    """
    e = sympy.sympify(e)
    if e.is_Integer:
        return f"{int(e)}L"
    if e.is_Symbol:
        return names[e.name]
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(index_c(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(index_c(a, names) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([index_c(e.base, names)] * int(e.exp)) + ")"
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        top, bottom = index_c(sympy.expand(num), names), index_c(den, names)
        if isinstance(e, sympy.ceiling):
            return f"(-kiln_floordiv(-{top}, {bottom}))"
        return f"kiln_floordiv({top}, {bottom})"
    if isinstance(e, sympy.Mod):
        return f"kiln_mod({index_c(e.args[0], names)}, {index_c(e.args[1], names)})"
    if isinstance(e, (sympy.Min, sympy.Max)):
        fn = "min" if isinstance(e, sympy.Min) else "max"
        text = index_c(e.args[0], names)
        for a in e.args[1:]:
            text = f"{fn}({text}, {index_c(a, names)})"
        return text
    raise KilnBackendContractError(f"C-family emitter: index expression {e} uses {type(e).__name__}, "
                                   "which it does not print")


def decompose(names: list[str], extents: list, flat: str, symnames: dict, pad: str) -> list[str]:
    """Statements binding each loop variable from a flat row-major index."""
    out, strides, stride = [], [], sympy.Integer(1)
    for ext in reversed(extents):
        strides.append(stride)
        stride = sympy.expand(stride * ext)
    strides.reverse()
    for j, (v, ext, st) in enumerate(zip(names, extents, strides)):
        text = flat if st == 1 else f"({flat} / {index_c(st, symnames)})"
        if j > 0:
            text = f"({text} % {index_c(ext, symnames)})"
        out.append(f"{pad}const long {v} = {text};")
    return out


def names_of(kernel) -> tuple[dict, dict]:
    """C names of a loop kernel's sizes and loop variables (`s_B`, `v_i0`) and of its
    buffers (name -> (`b_x`, dtype))."""
    symnames = {s: f"s_{s}" for s in kernel.sizes}
    buffers = {b.name: (f"b_{b.name}", b.dtype) for b in kernel.buffers}
    for loop in kernel.outer:
        symnames[loop.var] = f"v_{loop.var}"
    for st in kernel.stages:
        for loop in st.loops:
            symnames[loop.var] = f"v_{loop.var}"
    return symnames, buffers


def kernel_name(name: str) -> str:
    """A Kernel IR kernel's name as a C identifier."""
    return "kiln_" + re.sub(r"\W", "_", name)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def static_int(e) -> int | None:
    """The int value of a size expression, or None when it is symbolic."""
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None
