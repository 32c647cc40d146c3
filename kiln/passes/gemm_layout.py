"""Which matrix products the GEMM template takes, and their layout.

`gemm_layout(node)` maps a `matmul` or `dot_general` node whose operands are
contiguous row-major buffers onto out[b, i, j] = sum_k a[b, i, k] * b[b, k, j] with
element strides, collapsing contiguous batch and row dims. Products it cannot map
(broadcast batch dims, several contracting dims, ...) return None and run as an
extern call instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.graph import Node
from kiln.ir.shapes import Dim, dim, numel


@dataclass(frozen=True)
class GemmLayout:
    batch: Dim
    m: Dim
    n: Dim
    k: Dim
    a_strides: tuple  # (batch, row, k)
    b_strides: tuple  # (batch, k, col)
    out_groups: tuple  # how many result dims are batch, row and column dims


def row_major_strides(shape) -> list:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc = dim(acc * d) if not isinstance(acc * d, int) else acc * d
    return list(reversed(strides))


def _collapse(dims_idx, shape, strides):
    """(size, stride) of consecutive row-major dims merged into one, or None."""
    if not dims_idx:
        return 1, 0
    if list(dims_idx) != list(range(dims_idx[0], dims_idx[0] + len(dims_idx))):
        return None
    return numel([shape[i] for i in dims_idx]), strides[dims_idx[-1]]


def gemm_layout(node: Node) -> GemmLayout | None:
    a, b = node.operands
    if a.type.dtype != b.type.dtype or not (a.type.dtype.is_floating):
        return None
    if node.op == "matmul":
        return _matmul_layout(a.shape, b.shape)
    attrs = node.attrs
    ra, rb = len(a.shape), len(b.shape)
    lc = [i % ra for i in attrs["lhs_contracting"]]
    rc = [i % rb for i in attrs["rhs_contracting"]]
    if not lc or len(lc) != len(rc):
        return None
    return _dot_layout(a.shape, b.shape, [i % ra for i in attrs["lhs_batch"]],
                       [i % rb for i in attrs["rhs_batch"]], lc, rc)


def _dot_layout(sa, sb, lb, rb, lc, rc):
    """Several contracting dims collapse into one k when they are consecutive, in the
    same order, in both operands (a Linear's weight gradient over [B, T, C] inputs
    contracts B and T: one GEMM with k = B*T)."""
    ta, tb = row_major_strides(sa), row_major_strides(sb)
    lfree = [i for i in range(len(sa)) if i not in lb and i not in lc]
    rfree = [i for i in range(len(sb)) if i not in rb and i not in rc]
    if len(rfree) > 1:
        return None
    batch_a, batch_b = _collapse(list(lb), sa, ta), _collapse(list(rb), sb, tb)
    rows = _collapse(lfree, sa, ta)
    ka, kb = _collapse(list(lc), sa, ta), _collapse(list(rc), sb, tb)
    if batch_a is None or batch_b is None or rows is None or ka is None or kb is None:
        return None
    n, n_stride = (sb[rfree[0]], tb[rfree[0]]) if rfree else (1, 0)
    return GemmLayout(batch_a[0], rows[0], n, ka[0], (batch_a[1], rows[1], ka[1]),
                      (batch_b[1], kb[1], n_stride), (len(lb), len(lfree), len(rfree)))


def _matmul_layout(sa, sb):
    if len(sa) < 2 or len(sb) < 2:
        return None
    ta, tb = row_major_strides(sa), row_major_strides(sb)
    if len(sb) == 2:  # a's batch dims fold into its rows
        return GemmLayout(1, numel(sa[:-1]), sb[1], sa[-1], (0, ta[-2], 1), (0, tb[0], 1),
                          (0, len(sa) - 1, 1))
    if len(sa) != len(sb) or any(str(x) != str(y) for x, y in zip(sa[:-2], sb[:-2])):
        return None
    batch = numel(sa[:-2])
    return GemmLayout(batch, sa[-2], sb[-1], sa[-1], (ta[-3], ta[-2], 1), (tb[-3], tb[-2], 1),
                      (len(sa) - 2, 1, 1))
