"""Kernel IR: one backend-neutral object per fused group.

A `Kernel` computes, for every point of its `outer` (parallel) loops, a sequence of
stages: a `Reduce` folds a scalar expression over inner loops into a named value; a
`Store` writes a scalar expression to a buffer over its own inner loops. Buffers are
contiguous row-major arrays addressed by flat element indices, which are sympy
expressions affine in the loop variables (strides may be symbolic sizes). Sizes are
runtime arguments, so one kernel serves every size of a symbolic dim.

    kernel softmax_0(in x: f32[B, 1024], out y: f32[B, 1024]) sizes(B)
      parallel i0 in [0, B)
        m = reduce max r0 in [0, 1024): load x[1024*i0 + r0]
        s = reduce sum r0 in [0, 1024): exp(load x[1024*i0 + r0] - m)
        loop r0 in [0, 1024): store y[1024*i0 + r0] = exp(load x[1024*i0 + r0] - m) / s

A `GemmKernel` is the template for what is not a loop nest: a (batched) matrix product
whose `epilogue` expression (over the accumulator `Acc` and loads indexed by the output
position) is fused into it. Scalar ops are the names of elementwise primitives in the
op registry (add, exp, select, convert, ...), so backends implement each scalar op once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import sympy

from kiln.ir.dtypes import DType
from kiln.ir.shapes import Dim, format_shape, symbol

IN, OUT = "in", "out"


def loop_var(name: str) -> sympy.Symbol:
    """Loop variables are integer symbols, distinct from shape variables by a prefix."""
    return symbol(name)


@dataclass(frozen=True)
class BufferParam:
    name: str
    dtype: DType
    shape: tuple[Dim, ...]
    role: str  # IN or OUT

    def __str__(self) -> str:
        return f"{self.role} {self.name}: {self.dtype.short}{format_shape(self.shape)}"


# -- scalar expressions ---------------------------------------------------------------


@dataclass(frozen=True)
class Const:
    value: Union[bool, int, float]
    dtype: DType

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Load:
    buffer: str
    index: sympy.Expr  # flat element index
    dtype: DType

    def __str__(self) -> str:
        return f"load {self.buffer}[{self.index}]"


@dataclass(frozen=True)
class IndexValue:
    """An integer computed from loop variables and sizes (iota, bounds checks)."""

    expr: sympy.Expr
    dtype: DType

    def __str__(self) -> str:
        return f"({self.expr})"


@dataclass(frozen=True)
class Op:
    op: str  # an elementwise primitive of the registry; `convert` casts to `dtype`
    args: tuple
    dtype: DType
    # expressions are DAGs (a 20-step Newton iteration reuses y twice per step): the
    # hash is computed once, so hashing and memoizing stay linear in the DAG's size
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.op, self.args, self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return format_expr(self)


@dataclass(frozen=True)
class ReduceRef:
    """The value of an earlier Reduce stage at the current outer point."""

    name: str
    dtype: DType

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Acc:
    """The GEMM accumulator at the current output position (epilogues only)."""

    dtype: DType

    def __str__(self) -> str:
        return "acc"


Expr = Union[Const, Load, IndexValue, Op, ReduceRef, Acc]


def format_expr(e: Expr, names: dict | None = None) -> str:
    """Text of an expression; sub-expressions in `names` print as their name."""
    names = names or {}
    memo: dict = {}

    def text(x):
        if x in names:
            return names[x]
        if not isinstance(x, Op):
            return str(x)
        if x not in memo:
            inner = ", ".join(text(a) for a in x.args)
            memo[x] = f"{x.op}:{x.dtype.short}({inner})" if x.op == "convert" else f"{x.op}({inner})"
        return memo[x]

    return text(e)


def shared_subexpressions(exprs) -> list:
    """Op nodes used more than once across `exprs`, children first (for let-bindings)."""
    uses: dict = {}
    order: list = []

    def visit(x):
        if not isinstance(x, Op):
            return
        uses[x] = uses.get(x, 0) + 1
        if uses[x] > 1:
            return
        for a in x.args:
            visit(a)
        order.append(x)

    for e in exprs:
        visit(e)
    return [x for x in order if uses[x] > 1]


def children(e: Expr) -> tuple:
    return e.args if isinstance(e, Op) else ()


def walk(e: Expr):
    """Every sub-expression once, children before parents."""
    seen: set = set()
    order = []

    def visit(x):
        if x in seen:
            return
        seen.add(x)
        for c in children(x):
            visit(c)
        order.append(x)

    visit(e)
    return order


# -- stages and kernels -----------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    var: str
    extent: Dim

    def __str__(self) -> str:
        return f"{self.var} in [0, {self.extent})"


REDUCE_OPS = ("sum", "prod", "max", "min", "and", "or")


@dataclass(frozen=True)
class Reduce:
    name: str
    op: str  # one of REDUCE_OPS
    loops: tuple[Loop, ...]
    value: Expr
    dtype: DType  # the accumulator's dtype (float32 for low-precision inputs)


@dataclass(frozen=True)
class Store:
    buffer: str
    index: sympy.Expr
    value: Expr
    loops: tuple[Loop, ...] = ()


Stage = Union[Reduce, Store]


class _Buffers:
    """Inputs and outputs of a kernel, from its buffer list."""

    @property
    def inputs(self) -> tuple[BufferParam, ...]:
        return tuple(b for b in self.buffers if b.role == IN)

    @property
    def outputs(self) -> tuple[BufferParam, ...]:
        return tuple(b for b in self.buffers if b.role == OUT)


@dataclass(frozen=True)
class Kernel(_Buffers):
    name: str
    buffers: tuple[BufferParam, ...]
    sizes: tuple[str, ...]  # shape variables passed at run time
    outer: tuple[Loop, ...]
    stages: tuple[Stage, ...]


@dataclass(frozen=True)
class GemmKernel(_Buffers):
    """out[b, i, j] = epilogue(sum_k a[b, i, k] * b[b, k, j]) for batch b in `batch`.

    `a` and `b` are buffer names with their logical layouts given by strides (so a
    transposed operand needs no copy); the epilogue may load other buffers at index
    expressions in the variables `gb`, `gi`, `gj` (batch, row, column)."""

    name: str
    buffers: tuple[BufferParam, ...]
    sizes: tuple[str, ...]
    a: str
    b: str
    out: str
    batch: Dim
    m: Dim
    n: Dim
    k: Dim
    a_strides: tuple  # (batch, row, k) element strides
    b_strides: tuple  # (batch, k, col)
    epilogue: Expr  # over Acc and loads; Acc alone when there is none
    acc_dtype: DType = field(default=None)


@dataclass(frozen=True)
class BatchKernel(_Buffers):
    """Small independent kernels run as ONE launch (kiln/passes/batching.py).

    Each member keeps its own iteration space, shapes, strides and body; the launch's
    index space is the concatenation of the members' flattened outer spaces, member k
    owning [offset_k, offset_k + points_k) (`points` below), so a backend splits it over
    threads like one kernel's and runs the member whose range a point falls in (a switch
    over sub-problems). `buffers` is the union of the members' buffers (each slot once),
    `args[k][j]` the index in it of member k's buffer j, `sizes` the union of their sizes."""

    name: str
    buffers: tuple[BufferParam, ...]
    sizes: tuple[str, ...]
    members: tuple[Kernel, ...]
    args: tuple[tuple[int, ...], ...]

    def points(self) -> tuple:
        """Each member's flattened outer extent (sympy, over `sizes`)."""
        out = []
        for m in self.members:
            n = sympy.Integer(1)
            for loop in m.outer:
                n *= sympy.sympify(loop.extent)
            out.append(n)
        return tuple(out)

    def with_members(self, members) -> "BatchKernel":
        members = tuple(members)
        if all(a is b for a, b in zip(members, self.members)):
            return self
        return BatchKernel(self.name, self.buffers, self.sizes, members, self.args)


GEMM_VARS = ("gb", "gi", "gj")

# Template kinds: what is not a loop nest. A backend's `templates()` is keyed by these,
# never by graph-IR op names; "gemm" is `GemmKernel` (compiled by `build`), the others
# are run by the backend's template implementation where it has one (TEMPLATE_OF_OP below
# says which graph op each comes from) and by the op's numpy reference elsewhere.
TEMPLATE_KINDS = ("gemm", "grouped_gemm", "grouped_gemm_dw", "attention", "random_bits",
                  "scatter", "conv", "take", "take_along", "scan", "sort", "fft")

# graph ops that lower to a template kind rather than a loop nest; a backend's
# templates() is keyed by the kind, never by these op names
TEMPLATE_OF_OP = {"grouped_matmul": "grouped_gemm", "grouped_matmul_dw": "grouped_gemm_dw",
                  "scaled_dot_product_attention": "attention",
                  # a matmul left an extern step (the CPU's complex products: cpu/gemm_complex.py)
                  "matmul": "gemm",
                  # Threefry bits, two elements per counter (cpu/random_native.py)
                  "random_bits": "random_bits",
                  # updates summed at positions given by data (cpu/scatter_native.py)
                  "scatter_along": "scatter",
                  # a sliding-window contraction (cpu/conv_native.py: im2col blocks + GEMM)
                  "convolution": "conv",
                  # slices and elements read at positions given by data (cpu/gather_native.py)
                  "take": "take", "take_along": "take_along",
                  # a running sum along an axis (cpu/scan_native.py)
                  "cumsum": "scan",
                  # a sorted order, or its first entries (topk: cpu/topk_native.py)
                  "sort": "sort",
                  # complex transforms along an axis (cpu/fft_native.py: MKL's DFTI)
                  "fft": "fft"}


def template_externs(backend) -> dict:
    """Graph op -> the backend's implementation, for the template kinds it implements
    (the runtime calls these instead of the op's numpy reference). It lives here, not in
    lower.py, so that a program-cache hit builds its executable without importing the
    lowering (2 ms with bytecode, 7 ms compiled from source)."""
    impls = backend.templates()
    return {op: impls[kind] for op, kind in TEMPLATE_OF_OP.items() if kind in impls}

AnyKernel = Union[Kernel, GemmKernel, BatchKernel]


# -- printing ----------------------------------------------------------------------------


def format_kernel(k: AnyKernel) -> str:
    """Readable, linear-size text. A sub-expression a stage uses twice is bound once as
    `t<n>` in a `where` clause under that stage (so its loop variables are in scope)."""
    params = ", ".join(str(b) for b in k.buffers)
    sizes = f" sizes({', '.join(k.sizes)})" if k.sizes else ""
    lines = [f"kernel {k.name}({params}){sizes}"]
    if isinstance(k, BatchKernel):  # one launch: the members, each over its own space
        lines[0] = "batched " + lines[0]
        for member, args in zip(k.members, k.args):
            binding = ", ".join(f"{b.name}={k.buffers[a].name}" for b, a in zip(member.buffers, args))
            lines.append(f"  member ({binding}):")
            lines += ["    " + line for line in format_kernel(member).splitlines()]
        return "\n".join(lines)
    names: dict = {}

    def bind(value, indent: str) -> tuple[str, list[str]]:
        local = [x for x in shared_subexpressions([value])]
        where = []
        for x in local:
            if x not in names:
                names[x] = f"t{len(names)}"
        for x in local:
            others = {y: n for y, n in names.items() if y is not x}
            where.append(f"{names[x]} = {format_expr(x, others)}")
        text = format_expr(value, {x: names[x] for x in local})
        block = [f"{indent}  {'where' if i == 0 else '     '} {w}" for i, w in enumerate(where)]
        return text, block

    if isinstance(k, GemmKernel):
        lines.append(f"  gemm [{k.batch}] x [{k.m}, {k.k}] @ [{k.k}, {k.n}]: "
                     f"a={k.a} strides{k.a_strides}, b={k.b} strides{k.b_strides}")
        text, block = bind(k.epilogue, "    ")
        lines.append(f"    store {k.out}[gb, gi, gj] = {text}")
        return "\n".join(lines + block)
    indent = "  "
    if k.outer:
        lines.append(f"  parallel {', '.join(map(str, k.outer))}")
        indent = "    "
    for stage in k.stages:
        loops = ", ".join(map(str, stage.loops))
        text, block = bind(stage.value, indent)
        if isinstance(stage, Reduce):
            lines.append(f"{indent}{stage.name} = reduce {stage.op}:{stage.dtype.short} {loops}: {text}")
        else:
            head = f"loop {loops}: " if loops else ""
            lines.append(f"{indent}{head}store {stage.buffer}[{stage.index}] = {text}")
        lines += block
    return "\n".join(lines)


def kernel_fingerprint(k: AnyKernel) -> str:
    """Everything that determines a kernel's code, in linear-size text (a cache key).

    `format_kernel` plus the dtypes it leaves implicit (every Op's result dtype)."""
    if isinstance(k, BatchKernel):
        return "\n".join([format_kernel(k)] + [kernel_fingerprint(m) for m in k.members])
    values = [k.epilogue] if isinstance(k, GemmKernel) else [st.value for st in k.stages]
    typed = []
    for v in values:
        for x in walk(v):
            if isinstance(x, Op):
                typed.append(x.dtype.short)
    fields = ("a_strides", "b_strides", "acc_dtype", "batch", "m", "n", "k")
    extra = [f"{f}={getattr(k, f)}" for f in fields if hasattr(k, f)]
    return format_kernel(k) + "\n" + " ".join(typed) + "\n" + " ".join(extra) + f"\n{type(k).__name__}"
