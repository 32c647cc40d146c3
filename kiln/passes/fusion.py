"""Fusion: partition a graph's nodes into groups that one kernel each computes.

Decisions, in order (TorchInductor's and XLA's rules, simplified):

1. *Materialize* a value (give it a buffer) when the graph returns it, a non-fusible
   node (gemm operand, sort, gather, control flow, ...) reads it, or several
   consumers read it and recomputing it is not trivially cheap. Everything else that
   is pointwise is inlined into its consumers (recomputed where needed).
2. A *reduction group* holds the reductions over one domain (same input shape, same
   axes) with their pointwise producers and the materialized pointwise consumers that
   read the reduced values only as whole rows (broadcast back over the reduced axes):
   softmax and layer_norm become one kernel.
3. A *gemm group* takes the pointwise epilogue (bias, activation, scale, residual,
   cast) that follows a matmul into the GEMM template.
4. Remaining materialized pointwise values form *loop groups*; loop groups of one
   shape share a kernel unless one waits on the other through a third kernel or an
   unfused node: independent ones (horizontal fusion: one launch, one pass over common
   inputs) and one that reads another's value directly (a multi-output kernel, where
   that value becomes a register unless something outside still reads it).

Every merge is checked on the group dependency graph (graphlib): a merge that would
make a cycle is undone. The result is the same graph with each group replaced by a
`fused` node whose region holds the group's nodes.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import graphlib

from kiln.errors import KilnError
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.shapes import shapes_equal

from kiln.passes.fusion_analysis import (
    CHEAP, CONTROL_FLOW, STRUCTURAL, _Analysis, _cone, _reads_reduction_as_rows, is_gemm,
    is_pointwise, is_reduction, is_unit_reshape, row_shaped,
)


def _domain_key(node: Node) -> str:
    return f"{node.operands[0].shape}|{tuple(sorted(node.attrs['axes']))}"


class _Materialized(set):
    """The ids of materialized values: a set that counts its changes (`version`), so a
    group's node list can be remembered until the set changes (planning the GPT training
    step asked for group node lists ~11k times, a few hundred distinct ones)."""

    version = 0


def _counted(name: str):
    """`set.<name>`, counting the change in `version` first."""
    method = getattr(set, name)

    def changed(self, *args):
        self.version += 1
        return method(self, *args)

    changed.__name__ = name
    return changed


for _name in ("add", "discard", "remove", "pop", "clear", "update", "difference_update",
              "intersection_update", "symmetric_difference_update", "__ior__", "__isub__",
              "__iand__", "__ixor__"):
    setattr(_Materialized, _name, _counted(_name))


class _Group:
    def __init__(self, kind: str):
        self.kind = kind
        self.values: list[Value] = []  # what the group materializes, in order
        self.reduces: list[Node] = []
        self.root: Value | None = None  # a gemm's own result
        self._memo: tuple | None = None  # (analysis, mat, its version, members, nodes)

    def nodes(self, analysis: _Analysis, mat: set[int]) -> list[Node]:
        """Every node the group's kernel computes, in program order (the same list object
        while neither the group nor a `_Materialized` mat changes: do not modify it)."""
        version = getattr(mat, "version", None)
        members = (tuple(id(v) for v in self.values), tuple(id(r) for r in self.reduces),
                   id(self.root) if self.root is not None else None)
        memo = self._memo
        if version is not None and memo is not None and memo[0] is analysis and memo[1] is mat \
                and memo[2] == version and memo[3] == members:
            return memo[4]
        found = self._walk(analysis, mat)
        if version is not None:
            mat.version = version  # the walk put back every id it took out
            self._memo = (analysis, mat, version, members, found)
        return found

    def _walk(self, analysis: _Analysis, mat: set[int]) -> list[Node]:
        # the cones stop at `mat` less the group's own values: taken out of `mat` for the
        # walk and put back (not a copy of `mat` per call: planning asks ~10k times)
        own = [i for i in {id(v) for v in self.values} if i in mat]
        mat.difference_update(own)
        try:
            found: dict[int, Node] = {}
            starts = list(self.values) + [r.results[0] for r in self.reduces]
            for v in starts:
                for n in _cone(v, analysis, mat):
                    found[id(n)] = n
            if self.root is not None:
                found[id(self.root.producer)] = self.root.producer
                root = id(self.root)
                added = root not in mat
                mat.add(root)
                try:
                    for v in self.values:
                        for n in _cone(v, analysis, mat):
                            found[id(n)] = n
                finally:
                    if added:
                        mat.discard(root)
        finally:
            mat.update(own)
        return sorted(found.values(), key=lambda n: analysis.position[id(n)])


def _assign(analysis: _Analysis, mat: set[int]) -> list[_Group]:
    """Groups for a given set of materialized values (steps 2-4 of the module doc)."""
    groups: list[_Group] = []
    by_key: dict[str, _Group] = {}
    reduce_group: dict[int, _Group] = {}
    for node in analysis.region.nodes:
        if is_reduction(node):
            key = _domain_key(node)
            if key not in by_key:
                by_key[key] = _Group("reduction")
                groups.append(by_key[key])
            group = by_key[key]
            group.reduces.append(node)
            reduce_group[id(node.results[0])] = group
            if id(node.results[0]) in mat:
                group.values.append(node.results[0])
        elif is_gemm(node):
            group = _Group("gemm")
            group.root = node.results[0]
            group.values.append(node.results[0])
            groups.append(group)
    taken = {id(v) for g in groups for v in g.values}
    for node in analysis.region.nodes:
        v = node.results[0] if node.results else None
        if v is None or not is_pointwise(node) or id(v) not in mat or id(v) in taken:
            continue
        cone = _cone(v, analysis, mat - {id(v)})
        read = {id(reduce_group[id(n.results[0])]): reduce_group[id(n.results[0])]
                for n in cone if id(n.results[0]) in reduce_group}
        if len(read) == 1:
            (group,) = read.values()
            first = group.reduces[0]
            domain = first.operands[0].shape
            row = tuple(d for i, d in enumerate(domain) if i not in first.attrs["axes"])
            if (shapes_equal(v.shape, domain) or row_shaped(v.shape, row)) and all(
                    _reads_reduction_as_rows(n, cone, analysis) for n in cone if is_reduction(n)):
                group.values.append(v)
                continue
        loop = _Group("loop")
        loop.values.append(v)
        groups.append(loop)
    _absorb_epilogues(groups, analysis, mat)
    return groups


def _absorb_epilogues(groups: list[_Group], analysis: _Analysis, mat: set[int]) -> None:
    """A gemm whose result only one loop kernel reads, elementwise at its own position,
    with no reduction and no other gemm in that kernel, takes the kernel as its
    epilogue. (A gemm that takes none gets a buffer in `plan_groups`.)"""
    # each group's nodes and the ids of their operands, computed once (a gemm that
    # absorbs a loop is recomputed)
    cached: dict[int, list[Node]] = {}
    operand_ids: dict[int, set[int]] = {}

    def nodes_of(g: _Group) -> list[Node]:
        if id(g) not in cached:
            cached[id(g)] = g.nodes(analysis, mat)
        return cached[id(g)]

    def reads(g: _Group, value: Value) -> bool:
        if id(g) not in operand_ids:
            operand_ids[id(g)] = {id(o) for n in nodes_of(g) for o in n.operands}
        return id(value) in operand_ids[id(g)]

    for gemm in [g for g in groups if g.root is not None]:
        root = gemm.root
        users = analysis.consumers[id(root)]
        if id(root) in analysis.outputs or not users:
            continue
        readers = [g for g in groups if g is not gemm and reads(g, root)]
        if len(readers) != 1 or readers[0].kind != "loop" or len(readers[0].values) != 1:
            continue
        loop = readers[0]
        nodes = nodes_of(loop)
        members = {id(n) for n in nodes}
        other_gemms = [o for n in nodes for o in n.operands
                       if o is not root and id(o) not in mat and o.producer is not None
                       and is_gemm(o.producer)]
        if (shapes_equal(loop.values[0].shape, root.shape) and not other_gemms
                and all(id(u) in members and is_pointwise(u) and u.op not in STRUCTURAL
                        and not is_unit_reshape(u) for u in users)):
            gemm.values = list(loop.values)
            groups.remove(loop)
            cached.pop(id(gemm), None)
            operand_ids.pop(id(gemm), None)


def plan_groups(region: Region) -> tuple[list[_Group], set[int]]:
    """Groups in dependence order, and the ids of materialized values."""
    analysis = _Analysis(region)
    mat = _Materialized(analysis.boundary())
    while True:
        groups = _assign(analysis, mat)
        grown = set()
        owners: dict[int, set] = defaultdict(set)
        for k, g in enumerate(groups):
            for n in g.nodes(analysis, mat):
                owners[id(n)].add(k)
        shared = [node for node in region.nodes if analysis.fusible(node) and len(owners[id(node)]) >= 2
                  and id(node.results[0]) not in mat]
        # computed by several kernels: a reduction must then be stored, and an expensive
        # pointwise value is stored rather than recomputed. Reductions first: a kernel
        # that reads a reduction stored by another no longer computes the reduction's
        # producers, so they are judged again on the next round (a loss's mean over
        # row-reduced values made every producer of the row reductions look shared,
        # and a (4096, 1000) cross entropy wrote three [4096, 1000] intermediates)
        grown = {id(n.results[0]) for n in shared if is_reduction(n)} or \
            {id(n.results[0]) for n in shared if n.op not in CHEAP}
        if not grown:
            break
        mat |= grown
    for g in groups:  # a gemm that took no epilogue writes its result to a buffer
        if g.root is not None and g.values[0] is g.root:
            mat.add(id(g.root))
    _prune(groups, analysis, mat)
    groups = [g for g in groups if g.values]
    if SPLIT_BEFORE_MERGE:
        groups = _order(groups, analysis, mat)
    groups = _merge_horizontal(groups, analysis, mat)
    _prune(groups, analysis, mat)  # a value only its merged kernel reads is a register now
    return _order(groups, analysis, mat), mat


# Split the groups a cycle runs through (`_order`) before merging loops: an over-merged
# reduction group (a forward layer_norm's statistics beside the backward's reductions of
# the same domain) makes every later loop seem to wait on every earlier one, so a GPT
# step's exact GELU stayed four loop kernels per layer. And a split's halves share the
# reductions they both need through a buffer (the softmax backward reads the forward's
# row max and sum). Off: the earlier plan, measured by benchmarks/bench_gpt_step.py.
SPLIT_BEFORE_MERGE = True

# Horizontal fusion (step 4): loop kernels over one iteration space share one kernel when
# neither waits on the other through a third kernel or an unfused node. A benchmark flips
# this off to measure what it saves (benchmarks/bench_horizontal.py).
MERGE_INDEPENDENT = True


def _merge_horizontal(groups: list[_Group], analysis: _Analysis, mat: set[int]) -> list[_Group]:
    """Loop groups of one shape share a kernel (one launch, one pass over the domain):
    independent ones (horizontal fusion, as XLA's), and one that reads another's value
    directly (a multi-output kernel computes both; the read becomes a register). Never
    when one reaches the other through a third kernel or an unfused node: that merge
    would make a cycle. Without MERGE_INDEPENDENT, only loops that read a common buffer
    and do not depend on each other merge (the earlier rule)."""
    reads: dict[int, set[int]] = {}
    for g in groups:
        nodes = g.nodes(analysis, mat)
        made = {id(r) for n in nodes for r in n.results}
        reads[id(g)] = {id(o) for n in nodes for o in n.operands if id(o) not in made}
    owner = {id(v): g for g in groups for v in g.values}
    sources: dict[int, list] = {}  # value id -> the groups making it, until the next merge

    def source_groups(vid: int) -> list:
        if vid not in sources:
            sources[vid] = _source_groups({vid}, owner, analysis)
        return sources[vid]

    upstream: dict[int, list] = {}  # group id -> the groups its reads come from, until the next merge

    def sources_of(h: _Group) -> list:
        got = upstream.get(id(h))
        if got is None:
            got, ids = [], set()
            for vid in reads[id(h)]:
                for g in source_groups(vid):
                    if id(g) not in ids:
                        ids.add(id(g))
                        got.append(g)
            upstream[id(h)] = got
        return got

    def depends(a: _Group, b: _Group, direct_ok: bool = False) -> bool:
        """Does `a` read, through other groups or unfused nodes (a loop, a library call),
        a value `b` makes? With `direct_ok`, `a` reading `b`'s buffer itself does not count.
        (A walk over the groups each group reads from, kept until the next merge: the
        ~700 questions of a training step's plan walk the same few hundred lists.)"""
        if direct_ok:
            first = [g for vid in reads[id(a)] if owner.get(vid) is not b for g in source_groups(vid)]
        else:
            first = sources_of(a)
        stack, seen = [a], {id(a)}
        while stack:
            current = stack.pop()
            for g in first if current is a else sources_of(current):
                if g is b:
                    return True
                if id(g) not in seen:
                    seen.add(id(g))
                    stack.append(g)
        return False

    def mergeable(h: _Group, g: _Group) -> bool:
        if h.kind != "loop" or g.kind != "loop" or not shapes_equal(h.values[0].shape, g.values[0].shape):
            return False
        if not MERGE_INDEPENDENT:
            return bool(reads[id(h)] & reads[id(g)]) and not depends(g, h) and not depends(h, g)
        return not depends(g, h, direct_ok=True) and not depends(h, g)

    # only loop groups of one shape can merge: the hosts are looked up by shape (static
    # shapes by value, symbolic ones always tried), in `out` order as a scan would
    out: list[_Group] = []
    by_shape: dict[tuple, list] = defaultdict(list)  # static shape -> [(position, host)]
    symbolic: list = []
    for g in groups:
        host = None
        if g.kind == "loop":
            shape = g.values[0].shape
            static = all(isinstance(d, int) for d in shape)
            found = heapq.merge(by_shape[shape], symbolic) if static else \
                [(k, h) for k, h in enumerate(out) if h.kind == "loop"]
            host = next((h for _, h in found if mergeable(h, g)), None)
        if host is None:
            if g.kind == "loop":
                shape = g.values[0].shape
                entry = (len(out), g)
                (by_shape[shape] if all(isinstance(d, int) for d in shape) else symbolic).append(entry)
            out.append(g)
            continue
        host.values += g.values
        reads[id(host)] |= reads[id(g)]
        reads[id(host)] -= {id(v) for v in host.values}
        for v in g.values:
            owner[id(v)] = host
        # the same ids are owned as before, `g`'s by `host` now: what a value comes from
        # is what it came from with `g` read as `host` (host's own reads changed: redone)
        for table in (sources, upstream):
            for key, found in table.items():
                if any(x is g for x in found):
                    found = [host if x is g else x for x in found]
                    table[key] = found if table is sources else list({id(x): x for x in found}.values())
        upstream.pop(id(host), None)
        upstream.pop(id(g), None)
    return out


def _source_groups(values: set[int], owner: dict, analysis: _Analysis) -> list:
    """The groups that make `values`, looking through nodes no group owns (control
    flow, externs, collectives) to the groups their operands come from."""
    found, stack, seen = [], list(values), set(values)
    while stack:
        v = stack.pop()
        g = owner.get(v)
        if g is not None:
            found.append(g)
            continue
        node = analysis.producer.get(v)
        if node is None:
            continue
        for o in analysis.inputs[id(node)]:
            if id(o) not in seen:
                seen.add(id(o))
                stack.append(id(o))
    return found


def _prune(groups: list[_Group], analysis: _Analysis, mat: set[int]) -> None:
    """A value only its own kernel reads needs no buffer (it is recomputed inline). A
    reduction whose reader another kernel computes too stays stored (the rule of
    plan_groups: a reduction several kernels need is computed once)."""
    computed: dict[int, int] = defaultdict(int)  # node id -> how many kernels compute it
    for g in groups:
        for n in g.nodes(analysis, mat):
            computed[id(n)] += 1
    for g in groups:
        members = {id(n) for n in g.nodes(analysis, mat)}
        keep = []
        for v in g.values:
            shared = SPLIT_BEFORE_MERGE and is_reduction(v.producer) and any(
                computed[id(u)] > 1 for u in analysis.consumers[id(v)])
            outside = [u for u in analysis.consumers[id(v)] if id(u) not in members or shared]
            if id(v) in analysis.outputs or outside or (g.kind == "gemm"):
                keep.append(v)
            else:
                mat.discard(id(v))
        if g.kind == "reduction" and not keep and g.values:
            keep = g.values[:1]
        g.values = keep


def _order(groups: list[_Group], analysis: _Analysis, mat: set[int]) -> list[_Group]:
    """Groups in dependence order; merges that would make a cycle are undone.

    A group depends on the groups whose buffers its kernel reads, and, through every
    node no group owns (control flow, library calls, collectives, and the values their
    regions capture), on the groups those nodes read. A group may so depend on itself:
    `cond(x.sum() > 0, ...).sum()` groups both sums (one domain), but the second reads
    the `cond`, which reads the first. The standard library's graphlib sorts the small
    group graph and reports one cycle at a time; each group on it is split into the
    values that do not wait on the group and those that do (or, failing that, one group
    per value), until no cycle is left."""
    # each group's operand ids and the ids its kernel computes, kept while its node list
    # is the same (a round splits a few groups; the others' cones stay as they were)
    operands_of: dict[int, tuple] = {}
    while True:
        deps: dict[int, set[int]] = {k: set() for k in range(len(groups))}
        owner = {id(v): k for k, g in enumerate(groups) for v in g.values}
        by_group = {vid: groups[k] for vid, k in owner.items()}
        index = {id(g): k for k, g in enumerate(groups)}
        sources: dict[int, list] = {}  # this round's groups behind an unfused node's value
        for k, g in enumerate(groups):
            nodes = g.nodes(analysis, mat)
            known = operands_of.get(id(g))
            if known is None or known[0] is not nodes:
                known = operands_of[id(g)] = (nodes, {id(r) for n in nodes for r in n.results},
                                              {id(o) for n in nodes for o in n.operands})
            _, made, operands = known  # made: computed inside the kernel
            for vid in operands:
                j = owner.get(vid)
                if j is not None:
                    if j != k and vid in mat:
                        deps[k].add(j)
                elif vid not in made:  # made by an unfused node: depend on what it reads
                    found = sources.get(vid)
                    if found is None:
                        found = sources[vid] = _source_groups({vid}, by_group, analysis)
                    deps[k].update(index[id(h)] for h in found)
        try:
            order = list(graphlib.TopologicalSorter(deps).static_order())
            return [groups[k] for k in order]
        except graphlib.CycleError as exc:
            cyclic = set(exc.args[1])
        split: list[_Group] = []
        reads: dict = {}  # what each group reads, shared by this round's splits (`_split`)
        for k, g in enumerate(groups):
            split.extend(_split(g, analysis, mat, by_group, reads) if k in cyclic else [g])
        if len(split) == len(groups):
            raise KilnError("internal: fusion groups depend on each other in a cycle")
        groups = split


def _split(g: _Group, analysis: _Analysis, mat: set[int], owner: dict,
           reads: dict | None = None) -> list[_Group]:
    """`g` as two groups: the values that wait (through other groups or unfused nodes)
    on a value of `g`, and the rest, which then run first. Values that only the split
    leaves read from outside their new kernel get buffers."""
    own = {id(v) for v in g.values}
    group_inputs: dict[int, set[int]] = {}  # mat is fixed while splitting: each group once

    shared = {} if reads is None else reads

    def inputs_of(h: _Group) -> set[int]:
        # what `h` reads from outside its kernel, the values it computes inside that a
        # group owns, and those of `g`'s values it computes inside: its other inner values
        # lead only back to these (their producers are `h`'s nodes), so walking them finds
        # nothing more. The part that does not depend on `g` is kept for the other splits
        # of the round (`reads`, keyed by the group and its node list: a round's `owner`
        # is fixed, and a changed cone is a new list)
        if id(h) not in group_inputs:
            nodes = h.nodes(analysis, mat)
            known = shared.get(id(h))
            if known is None or known[0] is not nodes:
                made = {id(r) for n in nodes for r in n.results}
                operands = {id(o) for n in nodes for o in n.operands}
                known = shared[id(h)] = (nodes, {i for i in operands if i not in made or i in owner},
                                         operands & made)
            inner = [i for i in own if i in known[2]]
            group_inputs[id(h)] = known[1] | set(inner) if inner else known[1]
        return group_inputs[id(h)]

    def waits(v: Value) -> bool:
        stop = mat - {id(v)}
        if g.root is not None:
            stop = stop | {id(g.root)}
        cone = _cone(v, analysis, stop)
        made = {id(r) for n in cone for r in n.results}
        outside = {id(o) for n in cone for o in n.operands if id(o) not in made}
        stack, seen = list(outside), set(outside)
        while stack:
            vid = stack.pop()
            if vid in own and vid != id(v):
                return True
            h = owner.get(vid)
            if h is g:
                continue  # a value of `g` itself read directly: `own` decided above
            if h is not None:
                inputs = inputs_of(h)
            else:
                node = analysis.producer.get(vid)
                inputs = {id(o) for o in analysis.inputs[id(node)]} if node is not None else set()
            for i in inputs - seen:
                seen.add(i)
                stack.append(i)
        return False

    late = [v for v in g.values if v is not g.root and waits(v)]
    early = [v for v in g.values if all(v is not w for w in late)]
    if late and early:
        partition = [early, late]
    elif g.root is None and len(g.values) > 1:
        # the cycle runs through nodes only the kernel's reductions read: one group
        # per value, each computing only the reductions its value needs
        partition = [[v] for v in g.values]
    else:
        return [g]
    parts = []
    for values in partition:
        part = _Group(g.kind if any(v is g.root for v in values) else "loop")
        part.values = list(values)
        if g.root is not None and any(v is g.root for v in values):
            part.root = g.root
        for v in values:
            for n in _cone(v, analysis, mat - {id(v)}):
                if is_reduction(n) and all(n is not r for r in part.reduces):
                    part.reduces.append(n)
        if part.reduces and part.root is None:
            part.kind = "reduction"
        parts.append(part)
    if SPLIT_BEFORE_MERGE and late and early and g.root is None:
        _store_shared_reductions(parts[0], parts[1], analysis, mat)
    if g.root is not None:
        mat.add(id(g.root))  # the epilogue that waited now reads the GEMM's buffer
        if all(v is not g.root for v in early):
            parts[0].values.insert(0, g.root)
            parts[0].root, parts[0].kind = g.root, "gemm"
    return parts


def _store_shared_reductions(early: _Group, late: _Group, analysis: _Analysis,
                             mat: set[int]) -> None:
    """The reductions both halves of a split group compute are stored by the early half
    and read by the late one (plan_groups' rule: a reduction several kernels compute gets
    a buffer): a training step's softmax backward then reads the forward's row max and
    sum instead of recomputing them with an exp per element. The early half does not
    wait on the late one, so this adds no cycle."""
    shared = [r for r in early.reduces if any(r is q for q in late.reduces)]
    if not shared:
        return
    for r in shared:
        mat.add(id(r.results[0]))
        if all(v is not r.results[0] for v in early.values):
            early.values.append(r.results[0])
    late.reduces = []
    for v in late.values:
        for n in _cone(v, analysis, mat - {id(v)}):
            if is_reduction(n) and all(n is not r for r in late.reduces):
                late.reduces.append(n)
    late.kind = "reduction" if late.reduces else "loop"


def fuse(graph: Graph) -> Graph:
    """The graph with each fusion group replaced by a `fused` node (see module doc),
    inside the branches and loop bodies of control flow too.

    >>> fuse(g)   # exp(x) * 2 + 1 becomes one `fused` node of kind "loop"
    """
    builder = GraphBuilder(Graph(graph.name, shape_vars=graph.shape_vars, constants=graph.constants))
    env: dict[int, Value] = {}
    for old in graph.inputs:
        env[id(old)] = builder.add_input(old.type, old.name)
    builder.graph.body.results = _fuse_region(graph.body, builder, env)
    return builder.graph


def _fuse_nested(region: Region, builder: GraphBuilder, env: dict[int, Value]) -> Region:
    """A branch or loop body fused on its own: each trip runs the region's kernels."""
    new = Region([Value(p.type, p.name) for p in region.params])
    inner = dict(env)  # a region may read values of the regions around it
    inner.update({id(old): p for old, p in zip(region.params, new.params)})
    with builder.entering(new):
        new.results = _fuse_region(region, builder, inner)
    return new


def _fuse_region(region: Region, builder: GraphBuilder, env: dict[int, Value]) -> list[Value]:
    """Emit `region`'s nodes, grouped, into the builder's current region; its results."""
    groups, mat = plan_groups(region)
    analysis = _Analysis(region)
    group_of = {id(v): k for k, g in enumerate(groups) for v in g.values}
    emitted: set[int] = set()

    def emit_group(k: int):
        if k in emitted:
            return
        emitted.add(k)
        g = groups[k]
        nodes = g.nodes(analysis, mat)
        inside = {id(r) for n in nodes for r in n.results}
        external: list[Value] = []
        for n in nodes:
            for operand in n.operands:
                if id(operand) not in inside and all(operand is not e for e in external):
                    external.append(operand)
        operands = [resolve(e) for e in external]
        region = Region([Value(e.type) for e in external])
        local = {id(e): p for e, p in zip(external, region.params)}
        for n in nodes:
            copy = Node(n.op, [local[id(o)] for o in n.operands], n.attrs,
                        [r.type for r in n.results], n.regions)
            region.nodes.append(copy)
            for old_r, new_r in zip(n.results, copy.results):
                local[id(old_r)] = new_r
        region.results = [local[id(v)] for v in g.values]
        kind = "gemm" if g.root is not None else (
            "reduction" if any(is_reduction(n) for n in nodes) else "loop")
        results = builder.apply("fused", operands, {"kind": kind}, regions=[region])
        for v, r in zip(g.values, results):
            env[id(v)] = r

    def resolve(v: Value) -> Value:
        if id(v) in env:
            return env[id(v)]
        if id(v) in group_of:
            emit_group(group_of[id(v)])
            return env[id(v)]
        node = analysis.producer.get(id(v))
        if node is None:  # defined in an enclosing region
            return v
        operands = [resolve(o) for o in node.operands]
        for captured in analysis.inputs[id(node)][len(node.operands):]:
            resolve(captured)  # emitted before the regions that read it are fused
        regions = [_fuse_nested(r, builder, env) for r in node.regions] \
            if node.op in CONTROL_FLOW else node.regions
        copy = Node(node.op, operands, node.attrs,
                    [r.type for r in node.results], regions)
        builder.append(copy)
        for old_r, new_r in zip(node.results, copy.results):
            env[id(old_r)] = new_r
        return env[id(v)]

    for k in range(len(groups)):
        emit_group(k)
    return [resolve(v) for v in region.results]
