"""Running one op on DTensors: plan with the op's sharding rule, move, compute locally.

    plan("matmul", [((8, 4), f32), ((4, 6), f32)], [(Shard(1),), (Shard(0),)], {}, (4,))
    # -> Plan(inputs=[(Shard(1),), (Shard(0),)], outputs=[(Partial('sum'),)], bytes=0.0)

`plan` is pure (no process group): the SPMD pass and the tests use it as is.
`run_op` redistributes each operand to the planned placements, runs the op's numpy
reference on the local blocks (with size attributes made local) and wraps the results.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.distributed.errors import PlacementError, ShardingRuleError
from kiln.distributed.placements import local_shape
from kiln.distributed.sharding.strategy import LOCAL_ATTRS, OpSpec, choose
from kiln.ir import registry
from kiln.ir.types import TensorType


@dataclass
class Plan:
    """Per operand and per result: one placement per mesh dim; `bytes`: the estimated
    bytes this rank sends to redistribute the operands."""

    inputs: list
    outputs: list
    bytes: float
    out_types: list


def plan(op: str, operands: list, placements: list, attrs: dict, mesh_shape: tuple) -> Plan:
    """Choose a strategy per mesh dim for `op` over operands given as (shape, dtype)
    with their current placements (a tuple per operand)."""
    opdef = registry.get(op)
    attrs = opdef.normalize_attrs(attrs)
    types = [TensorType(dtype, tuple(shape)) for shape, dtype in operands]
    out_types = opdef.infer(types, attrs)
    in_shapes = tuple(tuple(int(s) for s in t.shape) for t in types)
    out_shapes = tuple(tuple(int(s) for s in t.shape) for t in out_types)
    n_in = len(types)
    ins = [[None] * len(mesh_shape) for _ in range(n_in)]
    outs = [[None] * len(mesh_shape) for _ in out_types]
    cut = [set() for _ in range(n_in + len(out_types))]
    total = 0.0
    for i, n in enumerate(mesh_shape):
        spec = OpSpec(op, in_shapes, tuple(t.dtype for t in types), out_shapes, attrs, n)
        current = tuple(p[i] for p in placements)
        forbidden = tuple(frozenset(c) for c in cut)
        strategy, cost = choose(spec, current, forbidden)
        if strategy is None:
            raise ShardingRuleError("%s: no sharding strategy for operands %s placed %s"
                                    % (op, [str(t) for t in types], list(placements)))
        total += cost
        for k, p in enumerate(strategy.inputs + strategy.outputs):
            if p.is_shard():
                cut[k].add(p.dim)
        for k, p in enumerate(strategy.inputs):
            ins[k][i] = p
        for k, p in enumerate(strategy.outputs):
            outs[k][i] = p
    return Plan([tuple(p) for p in ins], [tuple(p) for p in outs], total, out_types)


def run_op(op: str, operands: list, attrs: dict, mesh=None) -> list:
    """`op` on DTensor operands; a list of DTensor results. An op without operands
    (full, iota) needs `mesh`; its results are replicated."""
    from kiln.distributed.dtensor import DTensor

    if (not operands and mesh is None) or not all(isinstance(x, DTensor) for x in operands):
        raise PlacementError("%s on DTensors: every operand must be a DTensor, got %s; wrap "
                             "local values with distribute_tensor" % (
                                 op, [type(x).__name__ for x in operands]))
    mesh = operands[0].device_mesh if operands else mesh
    for x in operands:
        if x.device_mesh != mesh:
            raise PlacementError("%s: operands live on different meshes (%r and %r)"
                                 % (op, mesh, x.device_mesh))
    opdef = registry.get(op)
    attrs = opdef.normalize_attrs(attrs)
    p = plan(op, [(x.shape, x.dtype) for x in operands], [x.placements for x in operands],
             attrs, mesh.shape)
    moved = [x.redistribute(mesh, want) for x, want in zip(operands, p.inputs)]
    coord = mesh.get_coordinate()
    out_global = [tuple(int(s) for s in t.shape) for t in p.out_types]
    out_local = [local_shape(s, pl, mesh.shape, coord) for s, pl in zip(out_global, p.outputs)]
    local_attrs = attrs
    if op in LOCAL_ATTRS:
        local_attrs = LOCAL_ATTRS[op](attrs, [x.shape for x in moved],
                                      [x._local.shape for x in moved], out_global,
                                      out_local)
    # the blocks, read only (local_array() would unshare one an async checkpoint holds)
    result = opdef.reference(*[x._local for x in moved], **local_attrs)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    return [DTensor(r, mesh, pl, s) for r, pl, s in zip(results, p.outputs, out_global)]


__all__ = ["Plan", "plan", "run_op"]
