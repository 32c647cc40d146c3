"""Sharding rules the op's kind does not decide: contractions (dot_general, matmul,
convolutions, grouped matmuls), normalizations, attention and the LAPACK calls.

Contractions follow Megatron's column/row parallelism:

    batch dim of both operands  Shard(b), Shard(b)      -> Shard(b)
    free dim of one operand     Shard(m), Replicate     -> Shard(m')   (column parallel)
    contracted dim of both      Shard(k), Shard(k)      -> Partial(sum) (row parallel)
    a Partial(sum) operand, the other Replicate         -> Partial(sum)

Normalizations and attention shard everything but the dims they reduce over (the
normalized dims; attention's key length and feature dims), and attention also the
query length when no causal mask ties positions together. LAPACK calls shard batch
dims; solve also the right-hand side's columns.
"""

from __future__ import annotations

from kiln.distributed.placements import Partial, Shard
from kiln.distributed.sharding.strategy import (
    R, OpSpec, Strategy, partial_through, rule, shard_dims,
)

P = Partial("sum")


def _linear(spec: OpSpec, operands=((0,), (1,))) -> list[Strategy]:
    if not all(d.is_inexact for d in spec.in_dtypes[:2]):
        return []
    return [partial_through(spec, "sum", ops) for ops in operands]


@rule("dot_general")
def dot_general(spec: OpSpec) -> list[Strategy]:
    a = spec.attrs
    lhs, rhs = spec.in_shapes
    lb, rb = tuple(a.get("lhs_batch") or ()), tuple(a.get("rhs_batch") or ())
    lc, rc = tuple(a["lhs_contracting"]), tuple(a["rhs_contracting"])
    lfree = [d for d in range(len(lhs)) if d not in lb and d not in lc]
    rfree = [d for d in range(len(rhs)) if d not in rb and d not in rc]
    found = [Strategy((Shard(x), Shard(y)), (Shard(i),)) for i, (x, y) in enumerate(zip(lb, rb))]
    found += [Strategy((Shard(d), R), (Shard(len(lb) + k),)) for k, d in enumerate(lfree)]
    found += [Strategy((R, Shard(d)), (Shard(len(lb) + len(lfree) + k),))
              for k, d in enumerate(rfree)]
    if spec.in_dtypes[0].is_inexact or spec.in_dtypes[0].is_integer:
        found += [Strategy((Shard(x), Shard(y)), (P,)) for x, y in zip(lc, rc)]
    return found + _linear(spec)


@rule("matmul")
def matmul(spec: OpSpec) -> list[Strategy]:
    """torch.matmul: [..., M, K] @ [..., K, N]; vectors drop their dim."""
    lhs, rhs = spec.in_shapes
    (out,) = spec.out_shapes
    found = []
    numeric = not spec.in_dtypes[0].is_bool
    if len(lhs) >= 2 and len(rhs) >= 2:
        nb_out = len(out) - 2
        for d in range(len(lhs) - 2):  # lhs batch dims (rhs broadcasts or matches)
            od = nb_out - (len(lhs) - 2) + d
            rd = d - (len(lhs) - len(rhs))
            if rd >= 0 and rhs[rd] == lhs[d]:
                found.append(Strategy((Shard(d), Shard(rd)), (Shard(od),)))
            elif rd < 0 or rhs[rd] == 1 and lhs[d] != 1:
                found.append(Strategy((Shard(d), R), (Shard(od),)))
        found.append(Strategy((Shard(len(lhs) - 2), R), (Shard(len(out) - 2),)))
        found.append(Strategy((R, Shard(len(rhs) - 1)), (Shard(len(out) - 1),)))
        if numeric:
            found.append(Strategy((Shard(len(lhs) - 1), Shard(len(rhs) - 2)), (P,)))
    elif len(lhs) == 1 and len(rhs) >= 2:  # [K] @ [..., K, N] -> [..., N]
        found.append(Strategy((R, Shard(len(rhs) - 1)), (Shard(len(out) - 1),)))
        if numeric:
            found.append(Strategy((Shard(0), Shard(len(rhs) - 2)), (P,)))
    elif len(rhs) == 1 and len(lhs) >= 2:  # [..., M, K] @ [K] -> [..., M]
        found += [Strategy((Shard(d), R), (Shard(d),)) for d in range(len(lhs) - 1)]
        if numeric:
            found.append(Strategy((Shard(len(lhs) - 1), Shard(0)), (P,)))
    elif numeric:  # dot of two vectors
        found.append(Strategy((Shard(0), Shard(0)), (P,)))
    return found + _linear(spec)


@rule("convolution")
def convolution(spec: OpSpec) -> list[Strategy]:
    groups = spec.attrs.get("feature_group_count") or 1
    found = [Strategy((Shard(0), R), (Shard(0),))]  # batch
    if groups == 1:
        found += [Strategy((R, Shard(0)), (Shard(1),)),  # output channels
                  Strategy((Shard(1), Shard(1)), (P,))]  # input channels (contracted)
    return found + _linear(spec)


@rule("conv2d")
def conv2d(spec: OpSpec) -> list[Strategy]:
    groups, bias = spec.attrs.get("groups") or 1, spec.attrs.get("has_bias")
    b = (R,) if bias else ()
    found = [Strategy((Shard(0), R) + b, (Shard(0),))]
    if groups == 1:
        found.append(Strategy((R, Shard(0)) + ((Shard(0),) if bias else ()), (Shard(1),)))
        if not bias:
            found.append(Strategy((Shard(1), Shard(1)), (P,)))
    if not bias:
        found += _linear(spec)
    return found


@rule("grouped_matmul")
def grouped_matmul(spec: OpSpec) -> list[Strategy]:
    """x [T, K] by w [E, K, N] ([E, N, K] transposed), group sizes [E] replicated."""
    t = spec.attrs.get("transpose_rhs")
    n_dim, k_dim = (1, 2) if t else (2, 1)
    found = [Strategy((R, Shard(n_dim), R), (Shard(1),))]
    if spec.in_dtypes[0].is_inexact:
        found += [Strategy((Shard(1), Shard(k_dim), R), (P,)),
                  Strategy((P, R, R), (P,)), Strategy((R, P, R), (P,))]
    return found


@rule("grouped_matmul_dw")
def grouped_matmul_dw(spec: OpSpec) -> list[Strategy]:
    """x [T, K], y [T, N] -> [E, K, N]: K and N split freely; tokens stay whole."""
    found = [Strategy((Shard(1), R, R), (Shard(1),)), Strategy((R, Shard(1), R), (Shard(2),))]
    if spec.in_dtypes[0].is_inexact:
        found += [Strategy((P, R, R), (P,)), Strategy((R, P, R), (P,))]
    return found


@rule("layer_norm", "rms_norm")
def norm(spec: OpSpec) -> list[Strategy]:
    """x and the result shard the leading dims; weight and bias stay replicated."""
    keep = spec.ndim - spec.attrs["normalized_ndim"]
    return shard_dims(spec, range(keep), operands=(0,))


@rule("scaled_dot_product_attention")
def attention(spec: OpSpec) -> list[Strategy]:
    q, k, v = spec.in_shapes[:3]
    mask = spec.in_shapes[3] if len(spec.in_shapes) > 3 else None
    nd = len(q)

    def mask_placement(d: int):
        if mask is None:
            return ()
        md = d - (nd - len(mask))
        if md < 0 or mask[md] == 1 and q[d] != 1:
            return (R,)
        return (Shard(md),) if mask[md] == q[d] else None

    found = []
    for d in range(nd - 2):  # batch and head dims
        m = mask_placement(d)
        if m is not None and len(k) == nd and len(v) == nd and k[d] == q[d] == v[d]:
            found.append(Strategy((Shard(d),) * 3 + m, (Shard(d),)))
    if not spec.attrs.get("is_causal"):  # query positions are independent
        m = mask_placement(nd - 2)
        if m is not None:
            found.append(Strategy((Shard(nd - 2), R, R) + m, (Shard(nd - 2),)))
    return found


@rule("cholesky", "eigh", "qr", "svd")
def batched_lapack(spec: OpSpec) -> list[Strategy]:
    return shard_dims(spec, range(spec.ndim - 2))


@rule("solve", "triangular_solve")
def solve(spec: OpSpec) -> list[Strategy]:
    a, b = spec.in_shapes
    found = []
    if len(a) == len(b):
        found = shard_dims(spec, [d for d in range(len(a) - 2) if a[d] == b[d]])
    found.append(Strategy((R, Shard(len(b) - 1)), (Shard(len(spec.out_shapes[0]) - 1),)))
    if spec.in_dtypes[1].is_inexact:
        found.append(partial_through(spec, "sum", (1,)))
    return found


__all__ = ["attention", "dot_general", "matmul"]
