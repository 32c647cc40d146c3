"""Complex decomposition: complex64 arithmetic becomes float32 arithmetic on (re, im) pairs.

After this pass no kernel computes on complex values: every supported op on complex64
is rewritten into real ops on the real and imaginary parts, which fusion groups into
ordinary loop, reduction and GEMM kernels on every backend (PyTorch 2.14's compiler does
the same for its experimental complex support). Complex values remain only at the
graph's edges: a complex input is split by `real`/`imag`, a complex output is packed by
`complex`, and an op this pass does not know keeps its complex operands (packed for it,
split after it), so nothing is ever lost, only left unfused.

The rewrite is local. A complex value is represented by `complex(re, im)` nodes; an op
that reads one takes its parts straight from that node (or splits a value that has no
such producer), computes real results, and returns `complex(new_re, new_im)`; the
`real(complex(a, b)) -> a` rules then let the next op take the parts again, and `dce`
removes every `complex` node no one needs whole.

    %1 = mul(%z, %w) : c64[N]          %a, %b = real(%z), imag(%z)    %c, %d = real(%w), imag(%w)
                              ==>      %re = sub(mul(%a, %c), mul(%b, %d))
                                       %im = add(mul(%a, %d), mul(%b, %c))
                                       %1 = complex(%re, %im) : c64[N]

Rules: add sub neg mul div (a / b as a * conj(b) / |b|^2) exp log abs sqrt (the stable
form: no cancellation for a negative real part) pow (small integer powers by repeated
products, others as exp(w log z)) sign, conversions, reductions (reduce_sum), the data
movement ops (broadcast, reshape, transpose, slice, reverse, concatenate, pad, select,
dynamic slices, take/take_along), complex constants, and `dot_general`/`matmul` as real
GEMMs. GEMMs use the 4M form, (A + iB)(C + iD) = (AC - BD) + i(AD + BC): four real
GEMMs. The 3M (Gauss) form saves one GEMM but computes the imaginary part as
(A + B)(C + D) - AC - BD, whose error grows with |AC| + |BD| rather than with |AD + BC|;
in float32 that loses digits exactly when the imaginary part is small, so kiln chooses
4M (as BLAS cgemm does) and keeps 3M available (`KILN_COMPLEX_GEMM=3m`) for large
products where the 25% fewer flops matter more than those digits. A product of matrices
with static shapes runs 4M as ONE real GEMM, [A | B] @ [[C, D], [-D, C]] (`_block_gemm`):
one BLAS call instead of four and no add/subtract kernel after them.
"""

from __future__ import annotations

import os

import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir.graph import Graph, Node, Value
from kiln.passes.rewrite import RewriteBuilder, rebuild

F32 = dt.float32

# ops whose result is computed part by part with the same attributes
_PARTWISE = {"broadcast_in_dim", "reshape", "transpose", "slice", "reverse", "reduce_sum",
             "dynamic_slice", "take", "take_along", "dynamic_update_slice"}


def decompose_complex(graph: Graph) -> Graph:
    """`graph` with complex64 arithmetic rewritten into float32 pairs (module doc);
    `graph` itself when it has no complex value.

    >>> decompose_complex(kn.trace(lambda z: kn.exp(z) * z, z))   # no complex op but the packing
    """
    if not any(v.type.dtype.is_complex for node in graph.walk() for v in node.results + node.operands) \
            and not any(v.type.dtype.is_complex for v in graph.inputs):
        return graph
    return rebuild(graph, _rule)


def gemm_method() -> str:
    """'4m' (the default) or '3m' (KILN_COMPLEX_GEMM=3m): see the module doc."""
    return "3m" if os.environ.get("KILN_COMPLEX_GEMM", "").lower() == "3m" else "4m"


def _is_c(v: Value) -> bool:
    return v.type.dtype.is_complex


def _parts(b: RewriteBuilder, v: Value) -> tuple[Value, Value]:
    """(re, im) of a complex value: from its `complex` producer, else split."""
    node = v.producer
    if node is not None and node.op == "complex":
        return node.operands[0], node.operands[1]
    return b.real(v), b.imag(v)


def _pack(b: RewriteBuilder, re: Value, im: Value) -> Value:
    return b.complex(re, im)


def _rule(b: RewriteBuilder, node: Node):
    op = node.op
    if op in ("real", "imag"):
        src = node.operands[0].producer
        if src is not None and src.op == "complex":
            return [src.operands[0 if op == "real" else 1]]
        return None
    if op == "complex" or not (any(map(_is_c, node.operands)) or any(_is_c(r) for r in node.results)):
        return None
    handler = _HANDLERS.get(op)
    if handler is None and op in _PARTWISE:
        handler = _partwise
    if handler is None:
        return None  # unknown: it keeps its complex operands, packed for it
    out = handler(b, node)
    return None if out is None else ([out] if isinstance(out, Value) else list(out))


def _partwise(b, node):
    x = node.operands[0]
    if not _is_c(x):
        return None
    re, im = _parts(b, x)
    rest = list(node.operands[1:])
    if node.op == "dynamic_update_slice":
        ure, uim = _parts(b, rest[0])
        return _pack(b, b.call(node.op, re, ure, *rest[1:], **node.attrs),
                     b.call(node.op, im, uim, *rest[1:], **node.attrs))
    return _pack(b, b.call(node.op, re, *rest, **node.attrs), b.call(node.op, im, *rest, **node.attrs))


def _add(b, node):
    (a, c), (x, y) = _parts(b, node.operands[0]), _parts(b, node.operands[1])
    return _pack(b, b.call(node.op, a, x), b.call(node.op, c, y))


def _neg(b, node):
    a, c = _parts(b, node.operands[0])
    return _pack(b, b.neg(a), b.neg(c))


def _mul_parts(b, a, c, x, y):
    return b.sub(b.mul(a, x), b.mul(c, y)), b.add(b.mul(a, y), b.mul(c, x))


def _mul(b, node):
    (a, c), (x, y) = _parts(b, node.operands[0]), _parts(b, node.operands[1])
    return _pack(b, *_mul_parts(b, a, c, x, y))


def _div(b, node):
    (a, c), (x, y) = _parts(b, node.operands[0]), _parts(b, node.operands[1])
    den = b.add(b.mul(x, x), b.mul(y, y))
    return _pack(b, b.div(b.add(b.mul(a, x), b.mul(c, y)), den),
                 b.div(b.sub(b.mul(c, x), b.mul(a, y)), den))


def _exp(b, node):
    a, c = _parts(b, node.operands[0])
    e = b.exp(a)
    return _pack(b, b.mul(e, b.cos(c)), b.mul(e, b.sin(c)))


def _hypot(b, a, c):
    return b.sqrt(b.add(b.mul(a, a), b.mul(c, c)))


def _log_parts(b, a, c):
    return b.log(_hypot(b, a, c)), b.atan2(c, a)


def _log(b, node):
    return _pack(b, *_log_parts(b, *_parts(b, node.operands[0])))


def _abs(b, node):
    return _hypot(b, *_parts(b, node.operands[0]))


def _zeros(b, v):
    return b.full(0.0, F32, v.type.shape)


def _sqrt(b, node):
    """Principal root without cancellation: t = sqrt((|a| + |z|) / 2); for a >= 0 it is
    (t, c / 2t), for a < 0 (|c| / 2t, copysign(t, c)); 0 at z = 0."""
    a, c = _parts(b, node.operands[0])
    half = b.full(0.5, F32, a.type.shape)
    t = b.sqrt(b.mul(b.add(b.abs(a), _hypot(b, a, c)), half))
    zero = _zeros(b, a)
    safe = b.select(b.eq(t, zero), b.full(1.0, F32, a.type.shape), t)
    two_t = b.add(safe, safe)
    nonneg = b.ge(a, zero)
    re = b.select(nonneg, t, b.div(b.abs(c), two_t))
    im = b.select(nonneg, b.div(c, two_t), b.select(b.lt(c, zero), b.neg(t), t))
    is_zero = b.eq(t, zero)
    return _pack(b, b.select(is_zero, zero, re), b.select(is_zero, zero, im))


def _constant_value(v: Value):
    """The Python number a `full` (or complex of two fulls) fills, else None."""
    node = v.producer
    if node is None:
        return None
    if node.op == "full":
        return node.attrs["value"]
    if node.op == "complex":
        re, im = (_constant_value(o) for o in node.operands)
        return None if re is None or im is None else complex(re, im)
    return None


def _pow(b, node):
    z, w = node.operands
    a, c = _parts(b, z)
    k = _constant_value(w)
    if k is not None and complex(k).imag == 0 and complex(k).real in (1.0, 2.0, 3.0, 4.0):
        re, im = a, c  # small integer powers: repeated products, exact at z = 0
        for _ in range(int(complex(k).real) - 1):
            re, im = _mul_parts(b, re, im, a, c)
        return _pack(b, re, im)
    x, y = _parts(b, w) if _is_c(w) else (b.convert(w, F32), _zeros(b, a))
    lre, lim = _log_parts(b, a, c)
    pre, pim = _mul_parts(b, x, y, lre, lim)
    e = b.exp(pre)
    return _pack(b, b.mul(e, b.cos(pim)), b.mul(e, b.sin(pim)))


def _sign(b, node):
    a, c = _parts(b, node.operands[0])
    r = _hypot(b, a, c)
    zero = _zeros(b, a)
    safe = b.select(b.eq(r, zero), b.full(1.0, F32, a.type.shape), r)
    return _pack(b, b.div(a, safe), b.div(c, safe))


def _convert(b, node):
    x, target = node.operands[0], node.attrs["dtype"]
    if _is_c(x) and not target.is_complex:  # numpy's rule: the imaginary part is dropped
        return b.convert(_parts(b, x)[0], target)
    if not _is_c(x) and target.is_complex:
        re = b.convert(x, F32)
        return _pack(b, re, _zeros(b, re))
    return None


def _select(b, node):
    pred, x, y = node.operands
    (a, c), (u, v) = _parts(b, x), _parts(b, y)
    return _pack(b, b.select(pred, a, u), b.select(pred, c, v))


def _concatenate(b, node):
    parts = [_parts(b, x) for x in node.operands]
    return _pack(b, b.call("concatenate", *[p[0] for p in parts], **node.attrs),
                 b.call("concatenate", *[p[1] for p in parts], **node.attrs))


def _pad(b, node):
    (a, c), (pa, pc) = _parts(b, node.operands[0]), _parts(b, node.operands[1])
    return _pack(b, b.call("pad", a, pa, **node.attrs), b.call("pad", c, pc, **node.attrs))


def _constant(b, node):
    array = b.graph.constants[node.attrs["name"]]
    return _pack(b, b.constant(np.ascontiguousarray(array.real, np.float32)),
                 b.constant(np.ascontiguousarray(array.imag, np.float32)))


def _gemm(b, node):
    """Complex GEMM as real GEMMs (4M; 3M with KILN_COMPLEX_GEMM=3m: module doc)."""
    x, y = node.operands
    if not (_is_c(x) and _is_c(y)):
        return None
    (a, c), (u, v) = _parts(b, x), _parts(b, y)

    def gemm(p, q):
        return b.call(node.op, p, q, **node.attrs)

    if gemm_method() == "3m":
        t1, t2, t3 = gemm(a, u), gemm(c, v), gemm(b.add(a, c), b.add(u, v))
        return _pack(b, b.sub(t1, t2), b.sub(b.sub(t3, t1), t2))
    if BLOCK_GEMM and node.op == "matmul" and _static_matrices(x, y, node.results[0]):
        return _block_gemm(b, a, c, u, v, node.results[0].shape)
    return _pack(b, b.sub(gemm(a, u), gemm(c, v)), b.add(gemm(a, v), gemm(c, u)))


# 4M as one GEMM where the product is of matrices with static shapes (_block_gemm);
# benchmarks/bench_complex.py flips it off to measure the four-GEMM form in the same run
BLOCK_GEMM = True


def _static_matrices(x: Value, y: Value, out: Value) -> bool:
    return len(x.shape) >= 2 and len(y.shape) >= 2 and all(
        isinstance(d, int) for d in out.shape + x.shape[-1:] + y.shape)


def _block_of(b, u: Value, v: Value) -> Value:
    """[[C, D], [-D, C]] for C, D of shape (..., k, n), in one loop kernel: a
    (..., 2, k, 2, n) select over two iotas, then a reshape (a view) to (..., 2k, 2n)."""
    *batch, k, n = u.shape
    nb = len(batch)
    shape = (*batch, 2, k, 2, n)
    i = b.call("iota", dtype=dt.int32, shape=shape, dimension=nb)
    j = b.call("iota", dtype=dt.int32, shape=shape, dimension=nb + 2)
    dims = tuple(range(nb)) + (nb + 1, nb + 3)

    def spread(x):
        return b.call("broadcast_in_dim", x, shape=shape, broadcast_dimensions=dims)

    zero = b.full(0, dt.int32, shape)
    off = b.select(b.call("eq", i, zero), spread(v), spread(b.neg(v)))
    block = b.select(b.call("eq", i, j), spread(u), off)
    return b.call("reshape", block, shape=(*batch, 2 * k, 2 * n))


def _block_gemm(b, a, c, u, v, shape) -> Value:
    """4M as ONE real GEMM: [A | B] @ [[C, D], [-D, C]] = [AC - BD | AD + BC]. The same
    four products and error bound as four GEMMs, in one BLAS call of twice the size per
    side: a multi-threaded BLAS pays its thread hand-off once instead of four times,
    and the result's halves need no separate add and subtract kernel (bench_complex.py)."""
    left = b.call("concatenate", a, c, dimension=len(a.shape) - 1)
    both = b.call("matmul", left, _block_of(b, u, v))
    n = shape[-1]
    zero = (0,) * len(shape)
    re = b.call("slice", both, start=zero, limit=tuple(shape))
    im = b.call("slice", both, start=zero[:-1] + (n,), limit=tuple(shape[:-1]) + (2 * n,))
    return _pack(b, re, im)


_HANDLERS = {
    "add": _add, "sub": _add, "neg": _neg, "mul": _mul, "div": _div, "exp": _exp, "log": _log,
    "abs": _abs, "sqrt": _sqrt, "pow": _pow, "sign": _sign, "convert": _convert,
    "select": _select, "concatenate": _concatenate, "pad": _pad, "constant": _constant,
    "matmul": _gemm, "dot_general": _gemm,
}
