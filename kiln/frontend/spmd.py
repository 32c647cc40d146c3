"""`kn.compile` of a function of DTensors: one SPMD program, run on every rank.

    @kn.compile
    def mlp(x, w1, w2):
        return kn.relu(x @ w1) @ w2

    mlp(x_rep, w1_cols, w2_rows)        # DTensors: Replicate, Shard(1), Shard(0)
    # -> a DTensor placed Partial('sum') (Megatron's column- then row-parallel MLP)

The function is traced once per (global shapes, dtypes, placements) on global shapes,
`kiln.passes.spmd` turns the graph into the local program (collectives inserted where
placements change), and the usual pipeline compiles it (its `schedule_collectives`
overlaps them with compute). Every rank runs the same program on its local blocks; the
results come back as DTensors on the operands' mesh. `out_placements=` (a placement,
or one per output) asks for results placed that way, e.g. `Replicate()`.

Arguments that are not DTensors (arrays, kn.Tensors) count as replicated. The mesh
must be 1-d (pass `mesh["tp"]`-style sub-meshes of larger meshes), and sharded dims
must divide by its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnArgumentError


@dataclass
class _Entry:
    compiled: object
    out_placements: list
    out_shapes: list
    takes_rank: bool
    single: bool


def call_spmd(cf, args: tuple, out_placements=None):
    """Run compiled function `cf` (a kn.compile result) on DTensor `args`."""
    from kiln.distributed.dtensor import DTensor
    from kiln.distributed.placements import Replicate
    from kiln.frontend.compile import compile_graph
    from kiln.frontend.tracing import trace_function
    from kiln.passes.spmd import spmd_partition

    meshes = {id(a.device_mesh): a.device_mesh for a in args if isinstance(a, DTensor)}
    if len(meshes) != 1:
        raise KilnArgumentError("compile: the DTensor arguments of %s live on %d meshes; put "
                                "them on one" % (getattr(cf.fn, "__name__", "fn"), len(meshes)))
    (mesh,) = meshes.values()
    if mesh.ndim != 1:
        raise KilnArgumentError("compile: SPMD programs run on a 1-d mesh, got %r; pass "
                                "DTensors on a sub-mesh such as mesh[%r]"
                                % (mesh, mesh.mesh_dim_names[-1]))
    args = tuple(a if isinstance(a, DTensor) else np.asarray(a.numpy() if hasattr(a, "numpy")
                                                             else a) for a in args)
    placements = [a.placements[0] if isinstance(a, DTensor) else Replicate() for a in args]
    wanted = out_placements if out_placements is not None else getattr(cf, "out_placements", None)
    key = tuple((tuple(a.shape), str(a.dtype), str(p)) for a, p in zip(args, placements))
    key += (str(wanted),)
    cache = cf.__dict__.setdefault("_spmd_cache", {})
    entry = cache.get(key)
    if entry is None:
        examples = [np.zeros(a.shape, a.dtype.np_dtype if isinstance(a, DTensor) else a.dtype)
                    for a in args]
        traced = trace_function(cf.fn, tuple(examples))
        graph = traced.graph
        n_out = len(graph.outputs)
        if wanted is not None and not isinstance(wanted, (list, tuple)):
            wanted = [wanted] * n_out
        group = mesh.group.name if mesh.group is not None else "world"
        res = spmd_partition(graph, placements, world_size=mesh.size(), group=group,
                             out_placements=list(wanted) if wanted is not None else None)
        compiled = compile_graph(res.graph, cf.backend, cf.mode)
        entry = _Entry(compiled, res.out_placements, [tuple(v.type.shape) for v in graph.outputs],
                       res.takes_rank, _single_output(traced, n_out))
        cache[key] = entry
        cf._compiles += 1
    else:
        cf._hits += 1
    arrays = [a.local_array() if isinstance(a, DTensor) else a for a in args]
    if entry.takes_rank:
        arrays.append(np.array(mesh.get_local_rank(0), np.int64))
    outs = entry.compiled.run(arrays)
    made = [DTensor(np.asarray(o), mesh, [p], s)
            for o, p, s in zip(outs, entry.out_placements, entry.out_shapes)]
    return made[0] if entry.single else tuple(made)


def _single_output(traced, n_out: int) -> bool:
    spec = getattr(traced, "out_spec", None)
    if spec is not None:
        return spec == "*"
    return n_out == 1


__all__ = ["call_spmd"]
