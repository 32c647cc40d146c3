"""Fold transposes into matrix products: GEMMs read transposed operands in place.

A `transpose` feeding a `dot_general` (or a `matmul`) is absorbed into the product's
dimension numbers, so the GEMM template sees the untransposed buffer with swapped
strides and hands BLAS (or kiln's micro-kernel) a transpose flag instead of a copy.
This is what
`x @ w.T` (every `Linear`) and the backward GEMMs (`g.T @ x`, `g @ w`) need: without
it each step materializes a transposed copy of every weight (XLA's algebraic
simplifier and Inductor's `mm` lowering fold the same way).

A fold is made only when the product's result keeps its dim order (the permuted free
dims stay in order) and the folded product still maps onto the GEMM template
(`gemm_layout`); otherwise the graph is left as it was.

    %0 = transpose(%w) {permutation=(1, 0)} : f32[512, 1024]
    %1 = dot_general(%x, %0) {lhs_contracting=(1,), rhs_contracting=(0,)}
        ==>
    %1 = dot_general(%x, %w) {lhs_contracting=(1,), rhs_contracting=(1,)}
"""

from __future__ import annotations

from kiln.ir.graph import Graph, Node, Value
from kiln.passes.gemm_layout import gemm_layout
from kiln.passes.rewrite import RewriteBuilder, producer_op, rebuild


def fold_transpose(graph: Graph) -> Graph:
    """`graph` with transposes folded into the matrix products that read them.

    >>> fold_transpose(parse_graph(text))   # dot_general(x, transpose(w)) -> dot_general(x, w)
    """
    def rule(b: RewriteBuilder, node: Node):
        if node.op == "dot_general":
            return _fold_operands(b, node, _dims(node))
        if node.op == "matmul":
            dims = _matmul_dims(node)
            if dims is None or not any(producer_op(x) == "transpose" for x in node.operands):
                return None
            return _fold_operands(b, node, dims)
        return None

    return rebuild(graph, rule)


def _dims(node: Node) -> tuple:
    a, c = node.attrs, node.operands
    ra, rb = c[0].type.rank, c[1].type.rank
    return (tuple(i % ra for i in a["lhs_contracting"]), tuple(i % rb for i in a["rhs_contracting"]),
            tuple(i % ra for i in a["lhs_batch"]), tuple(i % rb for i in a["rhs_batch"]))


def _matmul_dims(node: Node):
    """`matmul`'s dimension numbers as a dot_general, for the cases that are one: both
    operands of rank >= 2 with the same batch dims, or a 2-D right operand."""
    a, b = (x.type for x in node.operands)
    if a.rank < 2 or b.rank < 2:
        return None
    if b.rank == 2:
        return (a.rank - 1,), (0,), (), ()
    if a.rank != b.rank or any(str(x) != str(y) for x, y in zip(a.shape[:-2], b.shape[:-2])):
        return None
    batch = tuple(range(a.rank - 2))
    return (a.rank - 1,), (b.rank - 2,), batch, batch


def _through(x: Value, contracting: tuple, batch: tuple):
    """(source, contracting, batch) of `x` seen through its producing transpose, or None
    when there is none or folding it would reorder the product's free dims."""
    if producer_op(x) != "transpose":
        return None
    perm = tuple(x.producer.attrs["permutation"])
    free = [perm[i] for i in range(len(perm)) if i not in contracting and i not in batch]
    if free != sorted(free):
        return None
    return x.producer.operands[0], tuple(perm[i] for i in contracting), tuple(perm[i] for i in batch)


def _fold_operands(b: RewriteBuilder, node: Node, dims: tuple):
    lc, rc, lb, rb = dims
    lhs, rhs = node.operands
    changed = False
    folded = _through(lhs, lc, lb)
    if folded is not None:
        lhs, lc, lb = folded
        changed = True
    folded = _through(rhs, rc, rb)
    if folded is not None:
        rhs, rc, rb = folded
        changed = True
    if not changed:
        return None
    return _product(b, node, lhs, rhs, lc, rc, lb, rb)


def _product(b: RewriteBuilder, node: Node, lhs, rhs, lc, rc, lb, rb):
    """dot_general(lhs, rhs) with these dims if it still maps onto the GEMM template
    (and has `node`'s result type), else None."""
    attrs = {"lhs_contracting": tuple(lc), "rhs_contracting": tuple(rc),
             "lhs_batch": tuple(lb), "rhs_batch": tuple(rb)}
    new = b.make_node("dot_general", [lhs, rhs], attrs)
    if str(new.results[0].type) != str(node.results[0].type) or gemm_layout(new) is None:
        return None
    return b.emit(new)

