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

Arguments that are not DTensors (arrays, kn.Tensors) count as replicated. On an n-d
mesh (say `DeviceMesh((2, 2), ("dp", "tp"))`) each DTensor has one placement per mesh
dim and the program is partitioned mesh dim by mesh dim (`spmd_partition_nd`):
data parallel over "dp" and tensor parallel over "tp" in one program, each collective
over its mesh dim's group. Sharded dims must divide by the mesh dims that cut them.
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
    rank_dims: list  # mesh dims whose coordinate the program takes, in input order
    single: bool


def call_spmd(cf, args: tuple, out_placements=None):
    """Run compiled function `cf` (a kn.compile result) on DTensor `args`."""
    from kiln.distributed.dtensor import DTensor
    from kiln.distributed.placements import Replicate
    from kiln.frontend.compile import compile_graph
    from kiln.frontend.tracing import trace_function
    from kiln.passes.spmd import spmd_partition_nd

    meshes = {id(a.device_mesh): a.device_mesh for a in args if isinstance(a, DTensor)}
    if len(meshes) != 1:
        raise KilnArgumentError("compile: the DTensor arguments of %s live on %d meshes; put "
                                "them on one" % (getattr(cf.fn, "__name__", "fn"), len(meshes)))
    (mesh,) = meshes.values()
    args = tuple(a if isinstance(a, DTensor) else np.asarray(a.numpy() if hasattr(a, "numpy")
                                                             else a) for a in args)
    whole = (Replicate(),) * mesh.ndim
    placements = [tuple(a.placements) if isinstance(a, DTensor) else whole for a in args]
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
        res = spmd_partition_nd(graph, placements, mesh_shape=mesh.shape,
                                groups=_group_names(mesh),
                                out_placements=_wanted(wanted, n_out, mesh.ndim))
        compiled = compile_graph(res.graph, cf.backend, cf.mode)
        entry = _Entry(compiled, res.out_placements, [tuple(v.type.shape) for v in graph.outputs],
                       res.rank_dims, _single_output(traced, n_out))
        cache[key] = entry
        cf._compiles += 1
    else:
        cf._hits += 1
    # the blocks, read only (local_array() would unshare one an async checkpoint holds)
    arrays = [a._local if isinstance(a, DTensor) else a for a in args]
    coord = mesh.get_coordinate()
    arrays += [np.array(coord[i], np.int64) for i in entry.rank_dims]
    outs = entry.compiled.run(arrays)
    made = [DTensor(np.asarray(o), mesh, p, s)
            for o, p, s in zip(outs, entry.out_placements, entry.out_shapes)]
    return made[0] if entry.single else tuple(made)


def _group_names(mesh) -> list[str]:
    """The process group name of each mesh dim (one rank without a group: a name per
    dim, so each dim's collectives stay distinct; they run as the identity)."""
    names = []
    for i in range(mesh.ndim):
        group = mesh.get_group(i)
        names.append(group.name if group is not None else
                     ("world" if mesh.ndim == 1 else "world.%s" % mesh.mesh_dim_names[i]))
    return names


def _wanted(wanted, n_out: int, ndim: int) -> list | None:
    """`out_placements` as one tuple of placements per output: a single placement means
    that placement on every mesh dim of every output, a tuple/list of placements (on a
    mesh of that many dims) the same for every output, else one entry per output."""
    from kiln.distributed.placements import Placement

    if wanted is None:
        return None
    if isinstance(wanted, Placement):
        return [(wanted,) * ndim] * n_out
    wanted = list(wanted)
    if ndim > 1 and len(wanted) == ndim and all(isinstance(p, Placement) for p in wanted) \
            and n_out != ndim:
        return [tuple(wanted)] * n_out
    if len(wanted) != n_out:
        raise KilnArgumentError("compile: out_placements gives %d entries for %d outputs"
                                % (len(wanted), n_out))
    return [(p,) * ndim if isinstance(p, Placement) else tuple(p) for p in wanted]


def _single_output(traced, n_out: int) -> bool:
    spec = getattr(traced, "out_spec", None)
    if spec is not None:
        return spec == "*"
    return n_out == 1


__all__ = ["call_spmd"]
