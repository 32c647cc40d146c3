"""What fusion reads off a region before it groups anything: which ops are pointwise,
reductions or GEMMs, each value's users and whether it must be materialized, the
pointwise cone that computes a value inside a kernel, and whether a consumer reads a
reduction only as whole rows (the softmax / layer_norm pattern).

fusion.py groups nodes using these facts; codegen/lower.py asks `fused_cone` the same
question when it checks a split reduction.
"""

from __future__ import annotations

from collections import defaultdict

from kiln.ir import registry
from kiln.ir.graph import Node, Region, Value
from kiln.ir.registry import ELEMENTWISE
from kiln.ir.regions import captured_values
from kiln.ir.shapes import shapes_equal


STRUCTURAL = {"full", "iota", "broadcast_in_dim", "transpose", "slice", "reverse", "pad"}
CHEAP = STRUCTURAL | {"convert", "reshape"}
REDUCTIONS = {"reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and", "reduce_or"}
GEMMS = {"matmul", "dot_general"}
CONTROL_FLOW = {"cond", "while_loop"}  # their regions are fused recursively


def is_unit_reshape(node: Node) -> bool:
    """A reshape that only inserts or removes size-1 dims is an index remap."""
    if node.op != "reshape":
        return False
    before = [d for d in node.operands[0].shape if not (isinstance(d, int) and d == 1)]
    after = [d for d in node.results[0].shape if not (isinstance(d, int) and d == 1)]
    return shapes_equal(tuple(before), tuple(after))


def is_pointwise(node: Node) -> bool:
    if any(v.type.dtype.is_complex for v in node.results + node.operands):
        return False  # backends compute complex64 through its real and imaginary parts
    if node.op in STRUCTURAL or is_unit_reshape(node):
        return True
    return registry.get(node.op).kind == ELEMENTWISE


def is_reduction(node: Node) -> bool:
    return node.op in REDUCTIONS and not node.results[0].type.dtype.is_complex


def is_gemm(node: Node) -> bool:
    if node.op not in GEMMS or node.results[0].type.dtype.is_complex:
        return False
    from kiln.passes.gemm_layout import gemm_layout

    return gemm_layout(node) is not None


class _Analysis:
    """Producers and consumers of one region's values. A node's *inputs* are its
    operands and the values its regions read from this one (a `cond` branch or loop body
    that was not closed reads them directly): both are dependencies."""

    def __init__(self, region: Region):
        self.region = region
        self.consumers: dict[int, list[Node]] = defaultdict(list)
        self.producer: dict[int, Node] = {}
        self.inputs: dict[int, list[Value]] = {}
        self.position = {id(n): i for i, n in enumerate(region.nodes)}
        for node in region.nodes:
            inputs = list(node.operands)
            if node.regions:
                inputs += [v for v in captured_values(node.regions)
                           if all(v is not o for o in node.operands)]
            self.inputs[id(node)] = inputs
            for v in inputs:
                self.consumers[id(v)].append(node)
            for r in node.results:
                self.producer[id(r)] = node
        self.outputs = {id(v) for v in region.results}
        self._fusible: dict[int, bool] = {}

    def fusible(self, node: Node) -> bool:
        # asked for every node of every cone, many times per plan: memoized per node
        known = self._fusible.get(id(node))
        if known is None:
            known = self._fusible[id(node)] = is_pointwise(node) or is_reduction(node)
        return known

    def boundary(self) -> set[int]:
        """Values that need a buffer whatever the grouping: outputs, and the operands
        and results of nodes no kernel template takes (gemm results may be fused)."""
        mat = set(self.outputs)
        for node in self.region.nodes:
            if not self.fusible(node):
                mat.update(id(v) for v in self.inputs[id(node)])
                if not is_gemm(node):
                    mat.update(id(r) for r in node.results)
        return mat


def _cone(value: Value, analysis: _Analysis, stop: set[int]) -> list[Node]:
    """Pointwise and reduce nodes computing `value`, stopping at ids in `stop`: each node
    after its operands' nodes (a depth-first post-order, operands in order).

    Fusion planning asks for tens of thousands of cones (the GPT training step: 16k), so
    this is a loop over an explicit stack, not a recursive closure."""
    producer, fusible, known = analysis.producer, analysis.fusible, analysis._fusible
    out: list[Node] = []
    seen: set[int] = set()
    node = producer.get(id(value))
    if node is None or not fusible(node):
        return out
    seen.add(id(node))
    stack = [(node, iter(node.operands))]
    while stack:
        node, operands = stack[-1]
        for operand in operands:
            if id(operand) in stop:
                continue
            child = producer.get(id(operand))
            if child is None or id(child) in seen:
                continue
            ok = known.get(id(child))
            if not (fusible(child) if ok is None else ok):
                continue
            seen.add(id(child))
            stack.append((child, iter(child.operands)))
            break
        else:
            stack.pop()
            out.append(node)
    return out


def fused_cone(value: Value, region: Region) -> list[Node]:
    """The pointwise and reduce nodes of `region` one kernel computes `value` from, in
    dependency order: `[n.op for n in fused_cone(var, region)]` -> ['reduce_sum', ...]."""
    return _cone(value, _Analysis(region), set())


def _reads_reduction_as_rows(reduce_node: Node, cone: list[Node], analysis: _Analysis) -> bool:
    """Does every use of the reduction inside `cone` see it as a whole row?

    Inside the kernel a reduced value is one scalar per outer point. It may flow through
    pointwise ops as a row (reduced dims dropped) or in keepdim form (reduced dims kept
    as size 1, after a unit reshape, as `x / x.sum(1, keepdim=True)` writes it), and reach
    the full domain only through a broadcast that puts every kept dim back in place."""
    axes = set(reduce_node.attrs["axes"])
    full = reduce_node.operands[0].shape
    rank = len(full)
    kept = tuple(i for i in range(rank) if i not in axes)
    keep_shape = tuple(1 if i in axes else d for i, d in enumerate(full))
    members = {id(n) for n in cone}
    seen: set[tuple[int, str]] = set()

    def ok(value: Value, form: str) -> bool:
        if (id(value), form) in seen:
            return True
        seen.add((id(value), form))
        for user in analysis.consumers[id(value)]:
            if id(user) not in members:
                continue
            out = user.results[0]
            if user.op == "broadcast_in_dim":
                dims = tuple(user.attrs["broadcast_dimensions"])
                if not (shapes_equal(out.shape, full)
                        and dims == (kept if form == "row" else tuple(range(rank)))):
                    return False
            elif is_unit_reshape(user):
                target = "keep" if form == "row" else "row"
                wanted = keep_shape if target == "keep" else tuple(full[i] for i in kept)
                if not shapes_equal(out.shape, wanted) or not ok(out, target):
                    return False
            elif is_pointwise(user) and user.op not in STRUCTURAL:
                if not ok(out, form):
                    return False
            else:
                return False
        return True

    return ok(reduce_node.results[0], "row")


def _drop_units(shape) -> tuple:
    return tuple(d for d in shape if not (isinstance(d, int) and d == 1))


def row_shaped(shape, row) -> bool:
    """Is `shape` a reduction's row, possibly with the size-1 dims keepdim=True leaves?"""
    if shapes_equal(shape, row):
        return True
    return len(_drop_units(row)) == len(row) and shapes_equal(_drop_units(shape), row)
