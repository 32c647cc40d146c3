"""Region helpers: what a region reads from outside, closing it over those values,
copying it, inlining it, and building control-flow regions from Python callbacks.

They sit in the IR layer, below the ops, because everyone that handles regions needs
them: the tracer (closing a traced branch over the tensors it captured), the control-flow
vjp rules beside the ops (kiln/ir/ad.py), and the passes (licm, fusion, rewriting).

    >>> captured = captured_values([branch0, branch1])   # values the branches read
    >>> for r in (branch0, branch1):
    ...     add_params(r, captured)                      # now each is self-contained
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from kiln.errors import KilnError
from kiln.ir.graph import Node, Region, Value
from kiln.ir.types import TensorType

if TYPE_CHECKING:  # for the hints only
    from kiln.ir.emitter import GraphBuilder

# -- what a region reads, and closing it over that ------------------------------------------


def free_values(region: Region) -> list[Value]:
    """Values `region` (or a region nested in it) reads but does not define, in use order."""
    defined: set[int] = set()
    free: dict[int, Value] = {}

    def use(v: Value) -> None:
        if id(v) not in defined:
            free.setdefault(id(v), v)

    def visit(r: Region) -> None:
        defined.update(id(p) for p in r.params)
        for node in r.nodes:
            for v in node.operands:
                use(v)
            for sub in node.regions:
                visit(sub)
            defined.update(id(v) for v in node.results)
        for v in r.results:
            use(v)

    visit(region)
    return list(free.values())


def captured_values(regions: Sequence[Region]) -> list[Value]:
    """The values any of `regions` reads from outside, each once, in first-use order."""
    seen: dict[int, Value] = {}
    for region in regions:
        for v in free_values(region):
            seen.setdefault(id(v), v)
    return list(seen.values())


def replace_uses(region: Region, mapping: dict[int, Value]) -> None:
    """Make every use of a value in `mapping` (keyed by `id`) inside `region`, nested
    regions included, use its replacement instead."""
    for node in region.nodes:
        node.operands = [mapping.get(id(v), v) for v in node.operands]
        for sub in node.regions:
            replace_uses(sub, mapping)
    region.results = [mapping.get(id(v), v) for v in region.results]


def add_params(region: Region, values: list[Value]) -> list[Value]:
    """New parameters of `region` that stand for `values` inside it (and nested regions).

    >>> add_params(branch, [outer_sum])   # the branch now reads its own parameter
    """
    params = [Value(v.type, v.name) for v in values]
    region.params.extend(params)
    replace_uses(region, {id(v): p for v, p in zip(values, params)})
    return params


def pass_through(node: Node, values: list[Value]) -> list[Value]:
    """Make `values` extra carried values of while_loop `node` that its body yields
    unchanged; returns the body's parameters that stand for them."""
    cond_region, body = node.regions
    add_params(cond_region, values)
    params = add_params(body, values)
    body.results = body.results + params
    node.operands = node.operands + list(values)
    for v in values:
        node.results.append(Value(v.type, None, node, len(node.results)))
    return params


# -- copying ------------------------------------------------------------------------------------


def copy_region(region: Region, vmap: dict[Value, Value],
                keep: Callable[[Node], bool] | None = None) -> Region:
    """A deep copy of `region` (new parameters, nodes, nested regions); `vmap` maps the
    values it reads from outside and is filled with old -> new for everything copied.
    `keep(node)` False leaves a node out (its results must then be unused)."""
    new = Region([Value(p.type, p.name) for p in region.params])
    for a, b in zip(region.params, new.params):
        vmap[a] = b
    copy_region_into(region, new, vmap, keep)
    return new


def copy_region_into(old: Region, new: Region, vmap: dict[Value, Value],
                     keep: Callable[[Node], bool] | None = None) -> None:
    """Append copies of `old`'s nodes to `new` and set `new`'s results (see copy_region)."""
    for node in old.nodes:
        if keep is not None and not keep(node):
            continue
        regions = [copy_region(r, vmap, keep) for r in node.regions]
        clone = Node(node.op, [lookup(vmap, v, node.op) for v in node.operands], node.attrs,
                     [r.type for r in node.results], regions)
        for a, b in zip(node.results, clone.results):
            b.name = a.name
            vmap[a] = b
        new.nodes.append(clone)
    new.results = [lookup(vmap, v, "yield") for v in old.results]


def lookup(vmap: dict[Value, Value], value: Value, where: str) -> Value:
    """`vmap[value]`, or an internal error naming `where` the undefined value is used."""
    try:
        return vmap[value]
    except KeyError:
        raise KilnError(f"internal: {where} uses a value that is not defined before it "
                        f"({value!r}); the graph does not verify") from None


# -- emitting regions through a builder -----------------------------------------------------------


def inline_region(b: GraphBuilder, region: Region, args: Sequence[Value],
                  renamed: dict[str, str] | None = None) -> list[Value]:
    """Emit `region`'s nodes into `b`'s current region with its params bound to `args`;
    `renamed` maps constant names of another graph to their names in `b`'s. Returns the
    values of the region's results."""
    vmap: dict[Value, Value] = dict(zip(region.params, args))
    for node in region.nodes:
        regions = [copy_region(r, vmap) for r in node.regions]
        attrs = node.attrs
        if renamed:
            attrs = _renamed(node, renamed)
            for inner in (n for r in regions for n in r.walk()):
                inner.attrs = _renamed(inner, renamed)
        results = b.apply(node.op, [vmap[v] for v in node.operands], attrs,
                          regions=regions or None)
        for old, new in zip(node.results, results):
            vmap[old] = new
    return [vmap[v] for v in region.results]


def _renamed(node: Node, renamed: dict[str, str]) -> dict:
    if node.op != "constant":
        return node.attrs
    return dict(node.attrs, name=renamed[node.attrs["name"]])


def build_region(b: GraphBuilder, types: Sequence[TensorType], fn: Callable) -> Region:
    """A region with parameters of `types` whose nodes `fn(*params)` emits through `b`
    and whose results are what `fn` returns."""
    region = Region([Value(t) for t in types])
    with b.entering(region):
        region.results = list(fn(*region.params))
    return region


def emit_while(b: GraphBuilder, carried: Sequence[Value], cond_fn: Callable,
               body_fn: Callable, attrs: dict | None = None) -> list[Value]:
    """A while_loop built from Python callbacks over region parameters; values the
    callbacks use from outside become extra carried values the body passes on."""
    types = [v.type for v in carried]
    cond_region = build_region(b, types, cond_fn)
    body = build_region(b, types, body_fn)
    captured = captured_values([cond_region, body])
    add_params(cond_region, captured)
    body.results = body.results + add_params(body, captured)
    results = b.apply("while_loop", list(carried) + captured, attrs or {},
                      regions=[cond_region, body])
    return results[:len(carried)]


def emit_cond(b: GraphBuilder, index: Value, operands: Sequence[Value],
              branch_fns: Sequence[Callable]) -> list[Value]:
    """A cond built from Python callbacks; captured values become explicit operands."""
    types = [v.type for v in operands]
    regions = [build_region(b, types, fn) for fn in branch_fns]
    captured = captured_values(regions)
    for region in regions:
        add_params(region, captured)
    return b.apply("cond", [index] + list(operands) + captured, {}, regions=regions)
