"""SPMD partitioning: a global graph plus input placements -> the per-rank local graph.

Given the placement of every input on a 1-d mesh of n ranks (a process group), the
pass walks the graph in order and, for each node, asks the op's sharding rule
(`kiln.distributed.sharding`) for the cheapest strategy given its operands' current
placements, inserts the collectives that move each operand there, and emits the node
on local types (size attributes made local):

    Shard(a) -> Replicate      all_gather(axis=a)
    Partial  -> Replicate      all_reduce
    Partial  -> Shard(d)       reduce_scatter(axis=d)
    Shard(a) -> Shard(b)       all_to_all(split_axis=b, concat_axis=a)
    Replicate -> Shard(d)      dynamic_slice at rank * chunk (a `full` is re-emitted local)
    Replicate -> Partial(sum)  the value on rank 0, zeros elsewhere

    graph @f(%x: f32[8, 4], %w: f32[4, 6])       x: Shard(0), w: Replicate
      %0 = matmul(%x, %w) : f32[8, 6]        ==>  %0 = matmul(%x, %w) : f32[2, 6]
      %1 = reduce_sum(%0) {axes=(0,)}             %1 = reduce_sum(%0) {axes=(0,)} : f32[6]
      return %1                                   %2 = all_reduce(%1) {reduce_op="sum"}
                                                  return %2        (out: Replicate)

The collectives are ordinary graph nodes, so the compile pipeline's
`schedule_collectives` pass overlaps them with compute afterwards. Every sharded dim
must divide by n (one static local shape on every rank); the rank enters as an extra
i64[] input when a replicated value must be cut locally. Nodes with regions
(cond, while_loop) must see replicated operands and may not read sharded outer values.

An n-d mesh is partitioned one mesh dim at a time, outermost first (`spmd_partition_nd`):
the local graph of mesh dim 0 is the global graph of mesh dim 1, and so on, which is
exactly how placements nest (a later mesh dim cuts the block of the earlier ones).
Collectives an earlier mesh dim inserted run over another group: for this mesh dim they
are ops like any other, which keep a Shard of a dim they do not move and pass a Partial
sum through (`_foreign`), so a gradient sharded over tp is all-reduced over dp in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.distributed.errors import ShardingRuleError
from kiln.distributed.placements import Partial, Replicate, Shard
from kiln.distributed.sharding.strategy import LOCAL_ATTRS, OpSpec, choose
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Value
from kiln.ir.types import TensorType
from kiln.passes.rewrite import copy_graph

R = Replicate()


@dataclass
class SpmdResult:
    """The local graph; the placement of each output; whether the graph's last input is
    this rank's index (i64[]), to be passed by the caller."""

    graph: Graph
    out_placements: list
    takes_rank: bool


def _static(op: str, shape) -> tuple:
    if not all(isinstance(s, int) for s in shape):
        raise ShardingRuleError("SPMD: %s has symbolic shape %s; sharded programs need static "
                                "shapes" % (op, list(shape)))
    return tuple(shape)


# what a collective over ANOTHER group does to this mesh dim's placements: the tensor
# dims it moves (which must be whole here) and the Partial reductions it passes through
_MOVED_DIMS = {
    "all_reduce": lambda a: (),
    "broadcast": lambda a: (),
    "all_gather": lambda a: (a["axis"],),
    "reduce_scatter": lambda a: (a["axis"],),
    "all_to_all": lambda a: (a["split_axis"], a["concat_axis"]),
}


def _passes_partial(op: str, attrs: dict, p) -> bool:
    """A Partial(p) operand of a collective over another group gives a Partial(p) result:
    the collective is linear (sum, avg) or monotone in the same op (max, min), or moves
    values without combining them."""
    if op in ("all_gather", "all_to_all", "broadcast"):
        return True
    red = attrs.get("reduce_op", "sum")
    return (p.reduce_op == "sum" and red in ("sum", "avg")) or (
        p.reduce_op in ("max", "min") and red == p.reduce_op)


class _Partitioner:
    def __init__(self, graph: Graph, n: int, group: str, rank_name: str = "rank"):
        self.g, self.n, self.group, self.rank_name = graph, n, group, rank_name
        self.b = GraphBuilder(Graph(graph.name, shape_vars=graph.shape_vars,
                                    constants=graph.constants))
        self.local: dict[Value, Value] = {}
        self.place: dict[Value, object] = {}
        self.rank_input: Value | None = None
        self.producer: dict[Value, object] = {}  # global value -> the node that made it
        self.moved: dict[tuple, Value] = {}  # (global value, placement) -> local value

    # -- collectives and local cuts ---------------------------------------------------
    def _coll(self, op: str, v: Value, **attrs) -> Value:
        return self.b.call(op, v, group=self.group, world_size=self.n, **attrs)

    def _rank(self) -> Value:
        if self.rank_input is None:
            self.rank_input = Value(TensorType(dt.int64, ()), self.rank_name)
        return self.rank_input

    def _cut(self, gv: Value, v: Value, d: int) -> Value:
        t = v.type
        local = tuple(s // self.n if i == d else s for i, s in enumerate(t.shape))
        node = self.producer.get(gv)
        if node is not None and node.op == "full":  # a constant fill: make it local
            return self.b.call("full", value=node.attrs["value"], dtype=node.attrs["dtype"],
                               shape=local)
        chunk = self.b.call("full", value=local[d], dtype=dt.int64, shape=())
        start = self.b.call("mul", self._rank(), chunk)
        zero = self.b.call("full", value=0, dtype=dt.int64, shape=())
        starts = [start if i == d else zero for i in range(len(local))]
        return self.b.call("dynamic_slice", v, *starts, sizes=local)

    def _partition(self, v: Value, op: str) -> Value:
        if op in ("avg", "max", "min"):
            return v
        t = v.type
        first = self.b.call("eq", self._rank(), self.b.call("full", value=0, dtype=dt.int64,
                                                            shape=()))
        pred = self.b.call("broadcast_in_dim", first, shape=tuple(t.shape),
                           broadcast_dimensions=())
        other = self.b.call("full", value=0 if op == "sum" else 1, dtype=t.dtype,
                            shape=tuple(t.shape))
        return self.b.call("select", pred, v, other)

    def move(self, gv: Value, want) -> Value:
        """The local value of global `gv` under placement `want` (inserting nodes once:
        later uses of the same move reuse its result)."""
        v, cur = self.local[gv], self.place[gv]
        if cur == want:
            return v
        key = (gv, want)
        if key not in self.moved:
            self.moved[key] = self._move(gv, v, cur, want)
        return self.moved[key]

    def _move(self, gv: Value, v: Value, cur, want) -> Value:
        node = self.producer.get(gv)
        if node is not None and node.op == "broadcast_in_dim" and not want.is_partial():
            return self._rebroadcast(node, want)
        if cur.is_partial():
            if want.is_shard():
                return self._coll("reduce_scatter", v, reduce_op=cur.reduce_op, axis=want.dim)
            v = self._coll("all_reduce", v, reduce_op=cur.reduce_op)
            return self._partition(v, want.reduce_op) if want.is_partial() else v
        if cur.is_shard():
            if want.is_shard():
                return self._coll("all_to_all", v, split_axis=want.dim, concat_axis=cur.dim)
            v = self._coll("all_gather", v, axis=cur.dim)
            return self._partition(v, want.reduce_op) if want.is_partial() else v
        if want.is_shard():
            return self._cut(gv, v, want.dim)
        return self._partition(v, want.reduce_op)

    def _rebroadcast(self, node, want) -> Value:
        """A broadcast's result under `want`, made by moving its (smaller) input and
        broadcasting again locally, instead of moving the broadcast copies."""
        src, dims = node.operands[0], tuple(node.attrs["broadcast_dimensions"])
        shape = tuple(node.attrs["shape"])
        src_want = R
        if want.is_shard() and want.dim in dims:
            i = dims.index(want.dim)
            if src.type.shape[i] == shape[want.dim]:
                src_want = Shard(i)
        lv = self.move(src, src_want)
        local = tuple(s // self.n if want.is_shard(d) else s for d, s in enumerate(shape))
        return self.b.call("broadcast_in_dim", lv, shape=local, broadcast_dimensions=dims)

    # -- the walk ---------------------------------------------------------------------
    def _uneven(self, shapes) -> tuple:
        return tuple(frozenset(d for d, s in enumerate(shape) if s % self.n) for shape in shapes)

    def run(self, placements: list, out_placements: list | None) -> SpmdResult:
        for gv, p in zip(self.g.inputs, placements):
            shape = _static("input %" + str(gv.name), gv.type.shape)
            if p.is_shard() and shape[p.dim] % self.n:
                raise ShardingRuleError(
                    "SPMD: input %%%s of shape %s is Shard(%d) over %d ranks; sharded dims must "
                    "divide evenly" % (gv.name, list(shape), p.dim, self.n))
            local = gv.type.with_shape(tuple(s // self.n if p.is_shard(i) else s
                                             for i, s in enumerate(shape)))
            self.local[gv] = self.b.add_input(local, gv.name)
            self.place[gv] = p
        for node in self.g.nodes:
            self._node(node)
        outs, final = [], []
        for k, gv in enumerate(self.g.outputs):
            want = out_placements[k] if out_placements is not None else self.place[gv]
            if want.is_shard() and _static("output", gv.type.shape)[want.dim] % self.n:
                raise ShardingRuleError("SPMD: output %d cannot be Shard(%d): size %d does not "
                                        "divide over %d ranks" % (k, want.dim,
                                                                  gv.type.shape[want.dim], self.n))
            outs.append(self.move(gv, want))
            final.append(want)
        self.b.graph.body.results = outs
        takes_rank = self.rank_input is not None
        if takes_rank:
            self.b.graph.body.params.append(self.rank_input)
        return SpmdResult(self.b.graph, final, takes_rank)

    def _node(self, node) -> None:
        if node.regions:
            self._whole(node)
            return
        if node.op in _MOVED_DIMS and node.attrs.get("group") != self.group:
            self._foreign(node)
            return
        in_shapes = tuple(_static(node.op, v.type.shape) for v in node.operands)
        out_shapes = tuple(_static(node.op, r.type.shape) for r in node.results)
        spec = OpSpec(node.op, in_shapes, tuple(v.type.dtype for v in node.operands),
                      out_shapes, dict(node.attrs), self.n)
        current = tuple(self.place[v] for v in node.operands)
        strategy, _ = choose(spec, current, self._uneven(in_shapes + out_shapes))
        operands = [self.move(v, p) for v, p in zip(node.operands, strategy.inputs)]
        attrs = dict(node.attrs)
        if node.op in LOCAL_ATTRS:
            out_local = [tuple(s // self.n if p.is_shard(i) else s for i, s in enumerate(shape))
                         for shape, p in zip(out_shapes, strategy.outputs)]
            attrs = LOCAL_ATTRS[node.op](attrs, in_shapes, [v.type.shape for v in operands],
                                         out_shapes, out_local)
        results = self.b.apply(node.op, operands, attrs)
        for gv, lv, p in zip(node.results, results, strategy.outputs):
            self.local[gv], self.place[gv] = lv, p
            self.producer[gv] = node
        _check_local(node, results, strategy.outputs, self.n)

    def _foreign(self, node) -> None:
        """A collective over another mesh dim's group: it keeps this mesh dim's placement
        of its operand when it neither moves the sharded dim nor combines a Partial it
        cannot pass through; else the operand is made whole here first."""
        (gv,) = node.operands
        cur = self.place[gv]
        rank = len(gv.type.shape)
        moved = {d % rank for d in _MOVED_DIMS[node.op](node.attrs)} if rank else set()
        keep = (cur.is_replicate() or (cur.is_shard() and cur.dim not in moved)
                or (cur.is_partial() and _passes_partial(node.op, node.attrs, cur)))
        want = cur if keep else R
        (result,) = self.b.apply(node.op, [self.move(gv, want)], dict(node.attrs))
        (out,) = node.results
        self.local[out], self.place[out], self.producer[out] = result, want, node
        _check_local(node, [result], [want], self.n)

    def _whole(self, node) -> None:
        """A node with regions runs replicated; its regions may read replicated outer
        values only (they are used as they are)."""
        operands = [self.move(v, R) for v in node.operands]
        for region in node.regions:
            for inner in region.walk():
                for k, v in enumerate(inner.operands):
                    if v in self.place:  # an outer value: its replicated local value
                        if not self.place[v].is_replicate():
                            raise ShardingRuleError(
                                "SPMD: a %s region reads a value placed %s; only replicated "
                                "outer values can enter regions" % (node.op, self.place[v]))
                        inner.operands[k] = self.local[v]
            region.results = [self.local.get(v, v) if v in self.place else v
                              for v in region.results]
        results = self.b.apply(node.op, operands, dict(node.attrs), regions=node.regions)
        for gv, lv in zip(node.results, results):
            self.local[gv], self.place[gv] = lv, R


def _check_local(node, results, placements, n: int) -> None:
    for gv_type, lv, p in zip([r.type for r in node.results], results, placements):
        want = tuple(s // n if p.is_shard(i) else s for i, s in enumerate(gv_type.shape))
        if tuple(lv.type.shape) != want:
            raise ShardingRuleError("SPMD: %s gave a local result %s under %s, expected %s"
                                    % (node.op, lv.type, p, list(want)))


def spmd_partition(graph: Graph, placements: list, *, world_size: int, group: str = "world",
                   out_placements: list | None = None, rank_name: str = "rank") -> SpmdResult:
    """The local graph of `graph` whose inputs are placed by `placements` (one Placement
    per input, a 1-d mesh of `world_size` ranks over process group `group`).

        >>> res = spmd_partition(g, [Shard(0), Replicate()], world_size=4)
        >>> res.graph, res.out_placements      # local graph, e.g. [Partial('sum')]
    """
    if len(placements) != len(graph.inputs):
        raise ShardingRuleError("SPMD: %d placements for %d graph inputs"
                                % (len(placements), len(graph.inputs)))
    if out_placements is not None and len(out_placements) != len(graph.outputs):
        raise ShardingRuleError("SPMD: %d output placements for %d outputs"
                                % (len(out_placements), len(graph.outputs)))
    graph = copy_graph(graph)  # regions are re-homed into the local graph
    return _Partitioner(graph, world_size, group, rank_name).run(list(placements),
                                                                 out_placements)


@dataclass
class SpmdResultNd:
    """The local graph on an n-d mesh; each output's placements (one per mesh dim); for
    each mesh dim whose coordinate the graph takes as an extra i64[] input, in the order
    of those inputs after the graph's own (`rank_dims`)."""

    graph: Graph
    out_placements: list
    rank_dims: list


def spmd_partition_nd(graph: Graph, placements: list, *, mesh_shape: tuple, groups: list,
                      out_placements: list | None = None) -> SpmdResultNd:
    """The local graph of `graph` on a mesh of `mesh_shape`: `placements[k]` is input
    k's tuple of placements (one per mesh dim), `groups[i]` the name of mesh dim i's
    process group, `out_placements[k]` (optional) output k's wanted tuple. Mesh dims
    are partitioned outermost first, each on the previous one's local graph.

        >>> res = spmd_partition_nd(g, [(Shard(0), R), (R, Shard(1))], mesh_shape=(2, 2),
        ...                         groups=["dp", "tp"])
        >>> res.out_placements      # e.g. [(Partial('sum'), Shard(1))]
    """
    nd = len(mesh_shape)
    if len(groups) != nd or len(set(groups)) != nd:
        raise ShardingRuleError("SPMD: %d distinct group names needed for a mesh of shape "
                                "%s, got %r" % (nd, list(mesh_shape), list(groups)))
    for p in list(placements) + list(out_placements or []):
        if len(p) != nd:
            raise ShardingRuleError("SPMD: placements %r give %d mesh dim(s) for a mesh of "
                                    "shape %s" % (list(p), len(p), list(mesh_shape)))
    rank_dims: list = []
    outs: list = [[] for _ in graph.outputs]
    for i in range(nd):
        # the coordinates earlier mesh dims take are inputs too, replicated here
        place = [p[i] for p in placements] + [R] * len(rank_dims)
        want = [p[i] for p in out_placements] if out_placements is not None else None
        res = spmd_partition(graph, place, world_size=mesh_shape[i], group=groups[i],
                             out_placements=want, rank_name="rank%d" % i)
        graph = res.graph
        if res.takes_rank:
            rank_dims.append(i)
        for k, p in enumerate(res.out_placements):
            outs[k].append(p)
    return SpmdResultNd(graph, [tuple(p) for p in outs], rank_dims)


__all__ = ["Partial", "Replicate", "Shard", "SpmdResult", "SpmdResultNd", "spmd_partition",
           "spmd_partition_nd"]
