"""Collectives on tensors: `kn.collectives.all_reduce(x)` and friends.

Each function returns a new tensor and works in both modes:

- eagerly, through the live process group (a nonblocking `Work`, waited for here);
  with no process group initialized the group is a world of one and every
  collective is the identity (the op's single-process reference);
- under `kn.trace` / `kn.compile` / `kn.export`, it records the IR op
  (`kiln/ir/ops/collective.py`) with the group's name and its static size, which the
  runtime resolves to the live group when the compiled program runs.

    >>> import kiln as kn, kiln.distributed as dist
    >>> pg = dist.init_process_group()                 # under `kiln launch --nproc 2`
    >>> @kn.compile
    ... def step(x, w):
    ...     return kn.collectives.all_reduce(x @ w, op="avg")
    >>> step(x, w)                                     # same result on every rank

The module also registers the `scheduled` stage of `kiln dump`: the optimized graph
after `schedule_collectives` split every collective into start and wait.
(It lives in the frontend, not in `kiln.distributed`, which never imports the
frontend: the distributed layer only runs what this module records.)
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.ir import registry
from kiln.ir.emitter import EAGER, is_python_scalar
from kiln.frontend.dispatch import current_builder, emitter_for, raw, to_array, wrap
from kiln.frontend.stages import register_stage

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
           "group_attrs"]


def group_attrs(group=None) -> dict:
    """{"group": name, "world_size": n} for `group`: None (the world group, or a world
    of one without a process group), a `ProcessGroup`, or a live group's name.

    >>> kn.collectives.group_attrs()        # no process group in this process
    {'group': 'world', 'world_size': 1}
    """
    if group is not None and not isinstance(group, str):
        name, size = getattr(group, "name", None), getattr(group, "world_size", None)
        if not isinstance(name, str) or not isinstance(size, int):
            raise KilnArgumentError(f"group must be None, a group name or a ProcessGroup, got "
                                    f"{type(group).__name__}")
        return {"group": name, "world_size": size}
    from kiln.distributed.graph_collectives import live_groups

    groups = live_groups()
    name = "world" if group is None else group
    if name in groups:
        return {"group": name, "world_size": groups[name].world_size}
    if not groups and name == "world":
        return {"group": "world", "world_size": 1}
    raise KilnArgumentError(f"no live process group named {name!r}; live groups: "
                            f"{', '.join(sorted(groups)) or 'none (no process group initialized)'}")


def _collective(name: str, x, attrs: dict):
    # inside a trace even a constant operand is communicated at run time, never at
    # trace time (its value may differ per rank and per call)
    em = emitter_for(x)
    if em is EAGER and current_builder() is not None:
        em = current_builder()
    if em is not EAGER:
        operand = raw(em, x)
        if is_python_scalar(operand):
            operand = em.constant(to_array(operand))
        return wrap(em, em.call(name, operand, **attrs))
    from kiln.distributed.graph_collectives import run

    array = to_array(x)
    opdef = registry.get(name)
    attrs = opdef.normalize_attrs(attrs)
    opdef.infer([EAGER.type_of(array)], attrs)  # bad input fails here, before any byte is sent
    return wrap(EAGER, run(name, array, attrs))


def all_reduce(x, op: str = "sum", group=None):
    """x reduced elementwise over the ranks of `group` with `op` (sum, prod, min, max,
    avg); every rank gets the result.

    >>> kn.collectives.all_reduce(grad, op="avg")
    """
    return _collective("all_reduce", x, {"reduce_op": op, **group_attrs(group)})


def all_gather(x, dim: int = 0, group=None):
    """Every rank's x, in rank order, concatenated along `dim`.

    >>> kn.collectives.all_gather(shard, dim=0)     # [n * k, ...] from [k, ...]
    """
    return _collective("all_gather", x, {"axis": dim, **group_attrs(group)})


def reduce_scatter(x, op: str = "sum", dim: int = 0, group=None):
    """x reduced over the group with `op`; rank r keeps chunk r of `dim` (split evenly).

    >>> kn.collectives.reduce_scatter(grad, op="sum", dim=0)   # [k, ...] from [n * k, ...]
    """
    return _collective("reduce_scatter", x, {"reduce_op": op, "axis": dim, **group_attrs(group)})


def broadcast(x, src: int = 0, group=None):
    """Rank `src`'s x, on every rank of the group.

    >>> kn.collectives.broadcast(weights, src=0)
    """
    return _collective("broadcast", x, {"src": src, **group_attrs(group)})


def all_to_all(x, split_dim: int = 0, concat_dim: int = 0, group=None):
    """x cut into equal chunks along `split_dim`; chunk j goes to rank j, and the chunks
    received are concatenated in rank order along `concat_dim`.

    >>> kn.collectives.all_to_all(x, split_dim=1, concat_dim=0)   # heads <-> sequence
    """
    return _collective("all_to_all", x, {"split_axis": split_dim, "concat_axis": concat_dim,
                                         **group_attrs(group)})


def scheduled_stage(graph, target: str = "cpu") -> str:
    """The text of `kiln dump --stage scheduled`: the optimized, fused graph with every
    collective split into `<op>_start` (issued early) and `collective_wait` (late)."""
    from kiln.passes.fusion import fuse
    from kiln.passes.pipeline import default_pipeline
    from kiln.passes.schedule_collectives import schedule_collectives

    pipeline = default_pipeline(extra=[("fuse", fuse),
                                       ("schedule_collectives", schedule_collectives)])
    return str(pipeline.run(graph))


register_stage("scheduled", scheduled_stage,
               "after fusion, collectives split into start/wait for compute overlap")
