"""Complex results written interleaved by the kernel that computes their parts.

After the `complex` pass a complex result is `complex(re, im)` of two float32 values that
one loop kernel computes. Packing them afterwards would be one more pass over memory;
instead the kernel stores `re` at element 2i and `im` at element 2i + 1 of one float32
(..., 2) buffer, which `view_as_complex` shows as the complex64 result without copying
(the interleaved layout of kiln/ir/ops/complex_view.py):

    %1, %2 = fused(...) {kind="loop"} : f32[N], f32[N]     store out0[2*i0] = re
    %3 = complex(%1, %2) : c64[N]                    ==>   store out0[2*i0 + 1] = im
                                                           %3 = view of out0 as c64[N]

`build_program` applies it where both parts are results of one loop kernel that nothing
else reads (kiln/codegen/build_program.py).
"""

from __future__ import annotations

from collections import Counter

from kiln.codegen.kernel_ir import BufferParam, Kernel, OUT, Store
from kiln.ir import dtypes as dt
from kiln.ir.graph import Graph


def interleaved_pairs(graph: Graph) -> dict[int, tuple[int, int, int]]:
    """Top-level loop kernels whose two results only a `complex` node reads: the fused
    node's index -> (the complex node's index, the real part's result position, the
    imaginary part's)."""
    nodes = graph.body.nodes
    uses: Counter = Counter()
    for node in graph.walk():
        uses.update(id(v) for v in node.operands)
        for region in node.regions:
            uses.update(id(v) for v in region.results)
    uses.update(id(v) for v in graph.body.results)
    made: dict[int, tuple[int, int]] = {}
    for index, node in enumerate(nodes):
        if node.op == "fused" and node.attrs.get("kind") == "loop" and not node.attrs.get("batch"):
            for position, r in enumerate(node.results):
                made[id(r)] = (index, position)
    found: dict[int, tuple[int, int, int]] = {}
    for index, node in enumerate(nodes):
        if node.op != "complex":
            continue
        re, im = node.operands
        a, b = made.get(id(re)), made.get(id(im))
        if (a is None or b is None or a[0] != b[0] or a[1] == b[1] or a[0] in found
                or uses[id(re)] != 1 or uses[id(im)] != 1):
            continue
        found[a[0]] = (index, a[1], b[1])
    return found


def interleave_stores(kernel: Kernel, re: int, im: int) -> Kernel:
    """`kernel` (a loop kernel) with outputs `re` and `im` (positions among its outputs)
    stored into ONE float32 buffer of their shape + (2,): element 2k + 0 and 2k + 1 for
    the flat position k each was stored at. The merged buffer takes `re`'s place in the
    argument list; `im`'s buffer is gone."""
    outs = [b for b in kernel.buffers if b.role == OUT]
    re_buf, im_buf = outs[re], outs[im]
    pair = BufferParam(re_buf.name, dt.float32, tuple(re_buf.shape) + (2,), OUT)
    buffers = tuple(pair if b is re_buf else b for b in kernel.buffers if b is not im_buf)
    stages = []
    for stage in kernel.stages:
        if isinstance(stage, Store) and stage.buffer in (re_buf.name, im_buf.name):
            k = 0 if stage.buffer == re_buf.name else 1
            stage = Store(pair.name, 2 * stage.index + k, stage.value, stage.loops)
        stages.append(stage)
    return Kernel(kernel.name, buffers, kernel.sizes, kernel.outer, tuple(stages))
