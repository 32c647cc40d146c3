"""Lowering: a `fused` node's region becomes one Kernel IR kernel.

Values are generated as scalar expressions at an index (a tuple of sympy exprs in the
loop variables): elementwise ops compose, structural ops (broadcast, transpose,
slice, reverse, unit reshapes, iota, full) only remap the index, region parameters
become loads from their buffers, in-group reductions become `ReduceRef`s, and a
gemm's own result becomes the accumulator `Acc` of its epilogue.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy

from kiln.passes.gemm_layout import gemm_layout, row_major_strides
from kiln.codegen.pad_lower import lower_pad
from kiln.codegen.kernel_ir import (
    IN, OUT, Acc, BufferParam, Const, GemmKernel, IndexValue, Kernel, Load, Loop, Op, Reduce,
    ReduceRef, Store, loop_var,
)
from kiln.errors import KilnError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.graph import Node, Region, Value
from kiln.ir.ops.rules import LOW_PRECISION
from kiln.ir.registry import ELEMENTWISE
from kiln.ir.shapes import dims_equal, free_symbol_names, numel
from kiln.passes.fusion_analysis import REDUCTIONS, fused_cone, is_unit_reshape


class LoweringError(KilnError):
    code = "K160"
    title = "internal: a fusion group could not be lowered"


def flat_index(index, shape) -> sympy.Expr:
    """The row-major flat position of `index` in `shape` (expanded)."""
    return _flat_index(tuple(index), tuple(shape))


# A kernel asks for the same few flat indices again and again (every load and store of a
# group at the loop's own index): the GPT step's lowering makes 545 requests of 51 indices,
# each an expand over sympy products (~26 us). Expressions are immutable values, so one
# computation per (index, shape) serves them all, within a compile and across compiles.
@functools.lru_cache(maxsize=4096)
def _flat_index(index: tuple, shape: tuple) -> sympy.Expr:
    strides = row_major_strides(shape)
    return sympy.expand(sum((sympy.sympify(i) * s for i, s in zip(index, strides)), sympy.Integer(0)))


def unflatten(var, shape) -> tuple:
    """Multi-dim index of flat position `var` in `shape`, written so that
    flat_index(unflatten(x, s), s) expands back to exactly x."""
    if len(shape) == 1:
        return (var,)
    strides = row_major_strides(shape)
    out = []
    for j, (d, p) in enumerate(zip(shape, strides)):
        term = sympy.floor(var / p) if p != 1 else sympy.sympify(var)
        if j > 0:
            term = term - d * (sympy.floor(var / (d * p)) if (d * p) != 1 else var)
        out.append(term)
    return tuple(out)


def accumulator_dtype(dtype: dt.DType) -> dt.DType:
    return dt.float32 if dtype.np_dtype in LOW_PRECISION else dtype


class _Gen:
    def __init__(self, region: Region, buffer_of: dict[int, str]):
        self.region = region
        self.buffer_of = buffer_of  # region param id -> kernel buffer name
        self.producer = {id(r): n for n in region.nodes for r in n.results}
        self.memo: dict = {}
        self.reduce_refs: dict[int, tuple[str, tuple, dt.DType]] = {}  # value id -> (name, outer index, acc)
        self.acc: tuple[int, tuple] | None = None  # gemm result value id, its index

    def __call__(self, value: Value, index: tuple):
        # each index entry keyed by its type and its value: sympy expressions hash and
        # compare by structure (as their srepr text would, at a fraction of the cost), and
        # the type keeps a Python int apart from the sympy Integer equal to it
        key = (id(value), tuple((type(i), i) for i in index))
        if key not in self.memo:
            self.memo[key] = self._gen(value, tuple(index))
        return self.memo[key]

    def _gen(self, value: Value, index: tuple):
        t = value.type
        if id(value) in self.buffer_of:
            return Load(self.buffer_of[id(value)], flat_index(index, t.shape), t.dtype)
        if self.acc is not None and id(value) == self.acc[0]:
            self._same_index(index, self.acc[1], "gemm result")
            return Acc(t.dtype)
        if id(value) in self.reduce_refs:
            name, outer, acc = self.reduce_refs[id(value)]
            self._same_index(index, outer, "reduction")
            ref = ReduceRef(name, acc)
            return ref if acc == t.dtype else Op("convert", (ref,), t.dtype)
        node = self.producer[id(value)]
        op, a = node.op, node.attrs
        operand_shape = node.operands[0].shape if node.operands else ()
        if op == "full":
            return Const(a["value"], t.dtype)
        if op == "iota":
            position = IndexValue(sympy.sympify(index[a["dimension"]]), dt.int64)
            return position if t.dtype == dt.int64 else Op("convert", (position,), t.dtype)
        if op == "broadcast_in_dim":
            mapped = tuple(0 if (isinstance(d, int) and d == 1 and not (isinstance(t.shape[m], int) and t.shape[m] == 1))
                           else index[m] for d, m in zip(operand_shape, a["broadcast_dimensions"]))
            return self(node.operands[0], mapped)
        if op == "transpose":
            mapped = [None] * len(index)
            for i, p in enumerate(a["permutation"]):
                mapped[p] = index[i]
            return self(node.operands[0], tuple(mapped))
        if op == "slice":
            stride = a["stride"] or (1,) * len(index)
            return self(node.operands[0], tuple(s + st * i for s, st, i in zip(a["start"], stride, index)))
        if op == "pad":
            return lower_pad(self, node, index)
        if op == "reverse":
            mapped = tuple(operand_shape[d] - 1 - i if d in a["dims"] else i for d, i in enumerate(index))
            return self(node.operands[0], mapped)
        if op == "reshape" and is_unit_reshape(node):
            kept = [i for i, d in zip(index, t.shape) if not (isinstance(d, int) and d == 1)]
            mapped = []
            for d in operand_shape:
                mapped.append(0 if isinstance(d, int) and d == 1 else kept.pop(0))
            return self(node.operands[0], tuple(mapped))
        if registry.get(op).kind == ELEMENTWISE:
            args = tuple(self(o, index) for o in node.operands)
            return Op(op, args, t.dtype)
        raise LoweringError(f"{op} cannot be generated inside a fused kernel")

    @staticmethod
    def _same_index(index, expected, what):
        if len(index) != len(expected) or any(
                x != y and sympy.expand(sympy.sympify(x) - sympy.sympify(y)) != 0
                for x, y in zip(index, expected)):
            raise LoweringError(f"a {what} is read at index {index}, not at its own position {expected}")


def _size_names(*shapes) -> tuple[str, ...]:
    names: set[str] = set()
    for shape in shapes:
        for d in shape:
            names |= free_symbol_names(d)
    return tuple(sorted(names))


def lower_fused(node: Node, name: str):
    """Kernel IR for one `fused` node."""
    (region,) = node.regions
    buffer_of = {id(p): f"in{i}" for i, p in enumerate(region.params)}
    buffers = [BufferParam(f"in{i}", p.type.dtype, p.type.shape, IN) for i, p in enumerate(region.params)]
    buffers += [BufferParam(f"out{i}", v.type.dtype, v.type.shape, OUT) for i, v in enumerate(region.results)]
    # a loop may run over a size no buffer has (the B of full((B,)) reduced to a scalar)
    sizes = _size_names(*[b.shape for b in buffers],
                        *[r.type.shape for n in region.nodes for r in n.results])
    gen = _Gen(region, buffer_of)
    kind = node.attrs["kind"]
    if kind == "gemm":
        return _lower_gemm(name, region, gen, buffers, sizes)
    if kind == "reduction":
        return _lower_reduction(name, region, gen, buffers, sizes)
    return _lower_loop(name, region, gen, buffers, sizes)


def _lower_loop(name, region, gen, buffers, sizes):
    shape = region.results[0].type.shape
    if not all(len(v.shape) == len(shape) and all(dims_equal(a, b) for a, b in zip(v.shape, shape))
               for v in region.results):
        raise LoweringError("a loop group's outputs must share one shape")
    loops = tuple(Loop(f"i{k}", d) for k, d in enumerate(shape))
    index = tuple(loop_var(l.var) for l in loops)
    stores = tuple(Store(f"out{i}", flat_index(index, shape), gen(v, index))
                   for i, v in enumerate(region.results))
    return _collapse_contiguous(Kernel(name, tuple(buffers), sizes, loops, stores), shape)


def _collapse_contiguous(kernel: Kernel, shape) -> Kernel:
    """When every access is at the output's own position, one flat loop suffices
    (the backend then vectorizes a single long loop)."""
    if len(shape) <= 1:
        return kernel
    from kiln.codegen.kernel_ir import walk

    flat = kernel.stages[0].index
    for stage in kernel.stages:
        if stage.index != flat:
            return kernel
        for e in walk(stage.value):
            if isinstance(e, IndexValue) or (isinstance(e, Load) and e.index != flat):
                return kernel
    v = loop_var("i0")

    def rewrite(e):
        if isinstance(e, Load):
            return Load(e.buffer, v, e.dtype)
        if isinstance(e, Op):
            return Op(e.op, tuple(rewrite(a) for a in e.args), e.dtype)
        return e

    stores = tuple(Store(s.buffer, v, rewrite(s.value)) for s in kernel.stages)
    return Kernel(kernel.name, kernel.buffers, kernel.sizes, (Loop("i0", numel(shape)),), stores)


def _lower_reduction(name, region, gen, buffers, sizes):
    reduces = [n for n in region.nodes if n.op in REDUCTIONS]
    domain = reduces[0].operands[0].shape
    axes = tuple(sorted(reduces[0].attrs["axes"]))
    kept = [i for i in range(len(domain)) if i not in axes]
    outer = tuple(Loop(f"o{k}", domain[i]) for k, i in enumerate(kept))
    inner = tuple(Loop(f"r{k}", domain[i]) for k, i in enumerate(axes))
    full = [None] * len(domain)
    for l, i in zip(outer, kept):
        full[i] = loop_var(l.var)
    for l, i in zip(inner, axes):
        full[i] = loop_var(l.var)
    full = tuple(full)
    parts = _partitions(domain, axes, reduces, region)
    if parts:
        return _lower_split_reduction(name, region, gen, buffers, sizes, domain, axes, reduces, parts)
    row = tuple(loop_var(l.var) for l in outer)
    row_shape = tuple(domain[i] for i in kept)
    stages = []
    for k, node in enumerate(reduces):
        acc = accumulator_dtype(node.results[0].type.dtype)
        value = gen(node.operands[0], full)
        if value.dtype != acc:
            value = Op("convert", (value,), acc)
        stages.append(Reduce(f"acc{k}", node.op[len("reduce_"):], inner, value, acc))
        gen.reduce_refs[id(node.results[0])] = (f"acc{k}", row, acc)
    for i, v in enumerate(region.results):
        if len(v.shape) == len(domain) and all(dims_equal(a, b) for a, b in zip(v.shape, domain)):
            stages.append(Store(f"out{i}", flat_index(full, domain), gen(v, full), inner))
        else:
            index = _row_index(v.shape, row, row_shape)
            stages.append(Store(f"out{i}", flat_index(index, v.shape), gen(v, index)))
    return Kernel(name, tuple(buffers), sizes, outer, tuple(stages))


def _row_index(shape, row, row_shape) -> tuple:
    """The index of a row-shaped value at the current row: the row itself, with zeros at
    the size-1 dims that keepdim=True leaves (fusion's `row_shaped`)."""
    if len(shape) == len(row_shape):
        return row
    rest = iter(row)
    return tuple(sympy.Integer(0) if isinstance(d, int) and d == 1 else next(rest) for d in shape)


SPLIT_MIN_ELEMENTS = 1 << 18  # below this a full reduction runs on one thread anyway


def _partitions(domain, axes, reduces, region) -> int:
    """How many partial results a large full reduction computes in parallel (0: none).

    A reduction over every dim has a single outer point, which one thread computes.
    When it is large, static and its reductions are independent, it becomes P
    partial reductions (parallel over P) and a tiny combining kernel."""
    if len(axes) != len(domain) or not all(isinstance(d, int) for d in domain):
        return 0
    total = numel(domain)
    if total < SPLIT_MIN_ELEMENTS:
        return 0
    reduce_ids = {id(n.results[0]) for n in reduces}
    for n in reduces:  # a reduction reading another (var after mean) needs the full first one
        if any(id(m.results[0]) in reduce_ids and m is not n
               for m in fused_cone(n.operands[0], region)):
            return 0
    for p in (64, 48, 32, 16, 8):
        if total % p == 0:
            return p
    return 0


def _lower_split_reduction(name, region, gen, buffers, sizes, domain, axes, reduces, parts):
    """Two kernels: P partial reductions into scratch buffers, then their combination."""
    chunk = numel(domain) // parts
    p, r = loop_var("p0"), loop_var("r0")
    full = unflatten(p * chunk + r, domain)
    partial_stages, scratch = [], []
    for k, node in enumerate(reduces):
        acc = accumulator_dtype(node.results[0].type.dtype)
        value = gen(node.operands[0], full)
        if value.dtype != acc:
            value = Op("convert", (value,), acc)
        op = node.op[len("reduce_"):]
        partial_stages.append(Reduce(f"acc{k}", op, (Loop("r0", chunk),), value, acc))
        partial_stages.append(Store(f"part{k}", p, ReduceRef(f"acc{k}", acc)))
        scratch.append(BufferParam(f"part{k}", acc, (parts,), OUT))
    inputs = tuple(b for b in buffers if b.role == IN)
    first = Kernel(f"{name}_partial", inputs + tuple(scratch), sizes, (Loop("p0", parts),),
                   tuple(partial_stages))
    q = loop_var("q0")
    combine = []
    for k, node in enumerate(reduces):
        acc = scratch[k].dtype
        combine.append(Reduce(f"acc{k}", node.op[len("reduce_"):], (Loop("q0", parts),),
                              Load(f"part{k}", q, acc), acc))
        gen.reduce_refs[id(node.results[0])] = (f"acc{k}", (), acc)
    for i, v in enumerate(region.results):
        combine.append(Store(f"out{i}", sympy.Integer(0), gen(v, ())))
    scratch_in = tuple(BufferParam(b.name, b.dtype, b.shape, IN) for b in scratch)
    second = Kernel(f"{name}_combine", scratch_in + tuple(b for b in buffers if b.role == OUT),
                    sizes, (), tuple(combine))
    return SplitReduction(first, second, scratch)


@dataclass(frozen=True)
class SplitReduction:
    """A full reduction lowered to two kernels with scratch buffers between them."""

    partial: Kernel
    combine: Kernel
    scratch: tuple


def _lower_gemm(name, region, gen, buffers, sizes):
    gemm_nodes = [n for n in region.nodes if n.op in ("matmul", "dot_general")]
    if len(gemm_nodes) != 1 or len(region.results) != 1:
        raise LoweringError("a gemm group holds one product and one output")
    (node,) = gemm_nodes
    layout = gemm_layout(node)
    a, b = node.operands
    if id(a) not in gen.buffer_of or id(b) not in gen.buffer_of:
        raise LoweringError("gemm operands must be buffers")
    out = region.results[0]
    gb, gi, gj = (loop_var(v) for v in ("gb", "gi", "gj"))
    result_shape = node.results[0].type.shape
    nb, nr, nc = layout.out_groups
    index = (unflatten(gb, result_shape[:nb]) + unflatten(gi, result_shape[nb:nb + nr])
             + ((gj,) if nc else ()))
    gen.acc = (id(node.results[0]), index)
    epilogue = gen(out, index)
    acc = accumulator_dtype(node.results[0].type.dtype)
    return GemmKernel(name, tuple(buffers), sizes, gen.buffer_of[id(a)], gen.buffer_of[id(b)],
                      "out0", layout.batch, layout.m, layout.n, layout.k,
                      tuple(layout.a_strides), tuple(layout.b_strides), epilogue, acc)
