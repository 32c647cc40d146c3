"""Complex decomposition: complex64 arithmetic becomes float32 arithmetic on (re, im) pairs.

After this pass no kernel computes on complex values: every supported op on complex64
is rewritten into real ops on the real and imaginary parts, which fusion groups into
ordinary loop, reduction and GEMM kernels on every backend (PyTorch 2.14's compiler does
the same for its experimental complex support). Complex values remain only at the
graph's edges and are never copied there: a complex input's parts are read in place,
as stride-2 slices of its `view_as_real` (the interleaved layout, see
kiln/ir/ops/complex_view.py), which fusion folds into the kernels' loads; a complex
output stays `complex(re, im)`, which build_program turns into pair stores of the kernel
computing both parts (kiln/codegen/complex_stores.py) or else one packing step; an op
this pass does not know keeps its complex operands, so nothing is ever lost, only left
unfused.

The rewrite is local. A complex value is represented by `complex(re, im)` nodes; an op
that reads one takes its parts straight from that node (or reads them in place from a
value that has no such producer), computes real results, and returns
`complex(new_re, new_im)`; the `real(complex(a, b)) -> a` rules then let the next op take
the parts again, and `dce` removes every `complex` node no one needs whole.

    %1 = mul(%z, %w) : c64[N]          %a, %b = pairs(%z)[:, 0], pairs(%z)[:, 1]   (pairs = view_as_real)
                              ==>      %c, %d = pairs(%w)[:, 0], pairs(%w)[:, 1]
                                       %re = sub(mul(%a, %c), mul(%b, %d))
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
with static shapes runs 4M as ONE real GEMM on the interleaved layout (`_interleaved_gemm`):
A's memory as a real (m, 2k) matrix times a (2k, 2n) block of B's parts is the complex
result's memory, so one BLAS call, no add/subtract kernel and no packing of A or C.

On the CPU (`decompose_complex_blas`, the CPU backend's variant of this pass) a complex
`matmul` of at least BLAS_MACS multiply-adds stays whole instead: an extern step that the
CPU backend runs as `cblas_cgemm` calls (4M, the same OpenBLAS numpy ships) on the
operands' own memory, one per output tile over kiln's threads
(kiln/codegen/cpu/gemm_complex.py). The real forms above built B's (2k, 2n) pair block
in a loop kernel whose innermost extent is 2 (2-4 ms of a 512^3 product's 5.5-8) and
then ran 8mnk real flops, cgemm's count; the complex calls build nothing
(benchmarks/results/cpu.md, gemm_partition). Smaller products keep the real form, whose
kernels fuse with their neighbours.
"""

from __future__ import annotations

import os

import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir.graph import Graph, Node, Value
from kiln.passes.dce import dce
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
    return dce(rebuild(graph, _rule))


def decompose_complex_blas(graph: Graph) -> Graph:
    """`decompose_complex` for a backend that calls BLAS on complex operands (the CPU):
    a complex `matmul` of at least BLAS_MACS multiply-adds, or of symbolic size, stays
    whole, `cblas_cgemm` tiles on the CPU (module doc); the rest as `decompose_complex`.

    >>> decompose_complex_blas(kn.trace(lambda a, b: a @ b, a, b))   # 512 x 512 complex64: unchanged
    """
    if not any(v.type.dtype.is_complex for node in graph.walk() for v in node.results + node.operands) \
            and not any(v.type.dtype.is_complex for v in graph.inputs):
        return graph
    return dce(rebuild(graph, _rule_blas))


# a complex product below this many multiply-adds keeps the real form (fusible kernels):
# a BLAS extern call costs ~10-20 us of Python around it
BLAS_MACS = 1 << 15


def _one_cgemm(node: Node) -> bool:
    """A complex matmul of same-dtype complex operands worth one cgemm call (4M: with
    KILN_COMPLEX_GEMM=3m the user asked for the 3M real form, which is kept; OpenBLAS's
    own cgemm3m measured slower than its cgemm here, 8.5 vs 6.6 ms CPU at 512^3)."""
    if node.op != "matmul" or len(node.operands) != 2 or gemm_method() == "3m":
        return False
    x, y = node.operands
    if not (_is_c(x) and _is_c(y) and x.type.dtype == y.type.dtype):
        return False
    macs = 1
    for d in tuple(node.results[0].shape) + tuple(x.shape[-1:]):
        if not isinstance(d, int):
            return True  # symbolic: no size to judge by, BLAS serves every one
        macs *= d
    return macs >= BLAS_MACS


def _rule_blas(b: RewriteBuilder, node: Node):
    return None if _one_cgemm(node) else _rule(b, node)


def gemm_method() -> str:
    """'4m' (the default) or '3m' (KILN_COMPLEX_GEMM=3m): see the module doc."""
    return "3m" if os.environ.get("KILN_COMPLEX_GEMM", "").lower() == "3m" else "4m"


def _is_c(v: Value) -> bool:
    return v.type.dtype.is_complex


def _parts(b: RewriteBuilder, v: Value) -> tuple[Value, Value]:
    """(re, im) of a complex value: from its `complex` producer, else read in place."""
    node = v.producer
    if node is not None and node.op == "complex":
        return node.operands[0], node.operands[1]
    return _interleaved_part(b, v, 0), _interleaved_part(b, v, 1)


def _interleaved_part(b: RewriteBuilder, v: Value, which: int) -> Value:
    """Part `which` (0 real, 1 imag) of complex `v` read from its own memory: element
    (..., which) of the f32[S, 2] view, a stride-2 read fusion folds into the kernel."""
    pairs = _pairs_of(b, v)
    shape = tuple(v.type.shape)
    nd = len(shape)
    part = b.call("slice", pairs, start=(0,) * nd + (which,), limit=shape + (which + 1,))
    return b.call("reshape", part, shape=shape)


def _pairs_of(b: RewriteBuilder, v: Value) -> Value:
    """f32[S, 2] over complex `v`'s memory (one `view_as_real` per value)."""
    cache = b.__dict__.setdefault("_complex_pairs", {})
    if id(v) not in cache:
        cache[id(v)] = (v, b.call("view_as_real", v))
    return cache[id(v)][1]


def _pack(b: RewriteBuilder, re: Value, im: Value) -> Value:
    return b.complex(re, im)


def _rule(b: RewriteBuilder, node: Node):
    op = node.op
    if op in ("real", "imag"):
        src = node.operands[0].producer
        if src is not None and src.op == "complex":
            return [src.operands[0 if op == "real" else 1]]
        return [_interleaved_part(b, node.operands[0], 0 if op == "real" else 1)]
    if op == "view_as_real":
        src = node.operands[0].producer
        if src is not None and src.op == "view_as_complex":  # a round trip is the memory itself
            return [src.operands[0]]
        return None
    if op == "view_as_complex":
        src = node.operands[0].producer
        if src is not None and src.op == "view_as_real":
            return [src.operands[0]]
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
    # np.array, not np.ascontiguousarray: that makes a 0-d constant 1-d
    return _pack(b, b.constant(np.array(array.real, np.float32)),
                 b.constant(np.array(array.imag, np.float32)))


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
        return _interleaved_gemm(b, x, u, v, node.results[0].shape)
    return _pack(b, b.sub(gemm(a, u), gemm(c, v)), b.add(gemm(a, v), gemm(c, u)))


# 4M as one GEMM where the product is of matrices with static shapes (_block_gemm);
# benchmarks/bench_complex.py flips it off to measure the four-GEMM form in the same run
BLOCK_GEMM = True


def _static_matrices(x: Value, y: Value, out: Value) -> bool:
    return len(x.shape) >= 2 and len(y.shape) >= 2 and all(
        isinstance(d, int) for d in out.shape + x.shape[-1:] + y.shape)


def _pair_block(b, u: Value, v: Value) -> Value:
    """The real (2k, 2n) matrix of B = C + iD that maps interleaved rows to interleaved
    rows: entry (2p + s, 2q + t) is C[p, q] where s == t, D[p, q] at (0, 1) and -D[p, q]
    at (1, 0). Built by one loop kernel over (..., k, 2, n, 2), then a reshape (a view)."""
    *batch, k, n = u.shape
    nb = len(batch)
    shape = (*batch, k, 2, n, 2)
    s = b.call("iota", dtype=dt.int32, shape=shape, dimension=nb + 1)
    t = b.call("iota", dtype=dt.int32, shape=shape, dimension=nb + 3)
    dims = tuple(range(nb)) + (nb, nb + 2)

    def spread(x):
        return b.call("broadcast_in_dim", x, shape=shape, broadcast_dimensions=dims)

    zero = b.full(0, dt.int32, shape)
    off = b.select(b.call("eq", s, zero), spread(v), spread(b.neg(v)))
    block = b.select(b.call("eq", s, t), spread(u), off)
    return b.call("reshape", block, shape=(*batch, 2 * k, 2 * n))


def _interleaved_gemm(b, x: Value, u: Value, v: Value, shape) -> Value:
    """4M as ONE real GEMM on the interleaved layout: A's memory viewed as a real
    (..., m, 2k) matrix [a_r0, a_i0, a_r1, a_i1, ...] times the (2k, 2n) pair block of B
    (`_pair_block`) gives, row by row, [AC - BD, AD + BC] interleaved, i.e. the complex
    (..., m, n) result's own memory. A and the result are views (no packing); only B's
    block is built. The same four products and error bound as four GEMMs, one BLAS call
    (a multi-threaded BLAS pays its thread hand-off once: bench_complex.py)."""
    *lead, m, k = x.shape
    left = b.call("reshape", _pairs_of(b, x), shape=(*lead, m, 2 * k))
    both = b.call("matmul", left, _pair_block(b, u, v))
    pairs = b.call("reshape", both, shape=tuple(shape) + (2,))
    return b.call("view_as_complex", pairs)


_HANDLERS = {
    "add": _add, "sub": _add, "neg": _neg, "mul": _mul, "div": _div, "exp": _exp, "log": _log,
    "abs": _abs, "sqrt": _sqrt, "pow": _pow, "sign": _sign, "convert": _convert,
    "select": _select, "concatenate": _concatenate, "pad": _pad, "constant": _constant,
    "matmul": _gemm, "dot_general": _gemm,
}
