"""Autodiff: reverse-mode differentiation (vjp) as a graph transformation.

`vjp_graph(graph, wrt)` turns a graph `f: primals -> outputs` into two graphs:

- **forward**: `primals -> (outputs..., residuals...)`, a replay of `f` that also
  returns the intermediate values the backward needs;
- **backward**: `(residuals..., output cotangents...) -> input cotangents` for the
  inputs in `wrt`.

`joint()` fuses both into one graph `(primals..., cotangents...) -> (outputs...,
gradients...)`, which is what `kn.grad` compiles: forward and backward in one program
that fuses like any graph. The split is what `kn.vjp` needs (its pullback runs later).

How it works (JAX's `backward_pass`, on kiln's IR): composites without a vjp rule are
first decomposed; the forward nodes are replayed into a new graph; then the nodes are
visited in reverse and each op's registered `vjp` rule (beside its definition in
`kiln/ir/ops/`) emits the cotangents of its operands from those of its results,
summing where a value has several uses. Only *active* values (those that depend on a
differentiated input through float dtypes) get cotangents; `stop_gradient` and
non-differentiable ops (comparisons, argmax, integer arithmetic) end the flow.

Control flow:

- `cond`/`switch`: the backward is a `cond` on the same index whose branches are the
  backward of each branch (each recomputes its branch's forward, so only the taken
  branch runs, forward and backward).
- `while_loop`: differentiable when it has a trip bound (`max_trips`, set by
  `kn.while_loop(..., max_iterations=N)`): the forward loop also counts its trips and
  saves each trip's carried values into `[N, ...]` buffers; the backward loop runs the
  trips in reverse, each one the vjp of the body at its saved carry. Memory grows with
  N times the carried size (values passed through the body unchanged are not saved).
  An unbounded loop that a gradient reaches raises K170 naming the fix.

    graph @f(%x: f32[4]) -> f32[]          forward:  %x -> (%0 = sum(sin(%x)), %x)
      %0 = sin(%x) : f32[4]                backward: (%x, %ct) -> broadcast(%ct) * cos(%x)
      %1 = reduce_sum(%0) {axes=(0,)}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kiln.errors import KilnError, KilnGradientError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.ops.rules import zeros
from kiln.ir.registry import COMPOSITE, CONTROL
from kiln.ir.verifier import verify
from kiln.passes.dce import dce
from kiln.passes.decompose import decompose
from kiln.passes.licm import add_params, captured_values, free_values
from kiln.passes.rewrite import _copy_region, new_graph_like


def differentiable_dtype(dtype: dt.DType) -> bool:
    """Values of float and complex dtypes carry cotangents; integers and bools do not. A
    complex cotangent is dL/dRe + i dL/dIm, PyTorch's convention (the conjugate Wirtinger
    derivative times 2), which every complex vjp rule in kiln/ir/ops follows."""
    return dtype.is_floating or dtype.is_complex


# -- the result ---------------------------------------------------------------------------


@dataclass
class VJP:
    """The forward and backward graphs of one function (see the module docstring)."""

    forward: Graph  # primals -> outputs + residuals
    backward: Graph  # residuals + output cotangents -> cotangents of the wrt inputs
    num_outputs: int
    wrt: list[int]

    @property
    def num_residuals(self) -> int:
        return len(self.forward.outputs) - self.num_outputs

    def joint(self) -> Graph:
        """One graph: (primals..., output cotangents...) -> (outputs..., gradients...)."""
        b = GraphBuilder(new_graph_like(self.forward))
        primals = [b.add_input(v.type, v.name) for v in self.forward.inputs]
        cts = [b.add_input(v.type, "ct_%d" % i)
               for i, v in enumerate(self.backward.inputs[self.num_residuals:])]
        fwd = inline(b, self.forward, primals)
        grads = inline(b, self.backward, fwd[self.num_outputs:] + cts)
        b.graph.body.results = fwd[:self.num_outputs] + grads
        verify(b.graph)
        return b.graph


def vjp_graph(graph: Graph, wrt: Sequence[int] | None = None,
              num_differentiated: int | None = None) -> VJP:
    """Differentiate `graph` with respect to its inputs `wrt` (all float inputs if None).

    The backward takes one cotangent per *float* output among the first
    `num_differentiated` (all by default; later outputs are auxiliary values no
    gradient flows from) and returns one cotangent per entry of `wrt`, zeros where an
    input does not reach the outputs.

    >>> v = vjp_graph(kn.trace(lambda x: (x.sin() * x).sum(), kn.ones(4)))
    >>> print(v.joint())
    """
    inputs = graph.inputs
    if wrt is None:
        wrt = [i for i, v in enumerate(inputs) if differentiable_dtype(v.type.dtype)]
    wrt = list(wrt)
    for i in wrt:
        if not 0 <= i < len(inputs):
            raise KilnGradientError(f"grad: argument index {i} is out of range for a function "
                                    f"of {len(inputs)} tensor inputs")
        if not differentiable_dtype(inputs[i].type.dtype):
            raise KilnGradientError(
                f"grad: input {i} (%{inputs[i].name}) has dtype {inputs[i].type.dtype}; only "
                "float inputs can be differentiated",
                hint="convert it to a float dtype, or leave it out of argnums")
    graph = decompose(graph, keep=_kept_composites())

    b = GraphBuilder(new_graph_like(graph))
    primals = [b.add_input(v.type, v.name) for v in inputs]
    tape = _Tape(b)
    outs = tape.forward(graph.body, primals, [i in wrt for i in range(len(inputs))])
    split = len(b.region.nodes)
    limit = len(outs) if num_differentiated is None else num_differentiated
    seeds = [Value(v.type, "ct_%d" % i) if i < limit and differentiable_dtype(v.type.dtype)
             else None for i, v in enumerate(outs)]
    cts = [c for c in seeds if c is not None]
    grads = tape.backward(outs, seeds, [primals[i] for i in wrt])
    forward_nodes, backward_nodes = b.region.nodes[:split], b.region.nodes[split:]

    # residuals: the forward values (and primals) the backward reads
    residuals = free_values(Region(list(cts), backward_nodes, grads))
    forward = new_graph_like(b.graph)
    forward.body = Region(primals, forward_nodes, outs + residuals)
    backward = new_graph_like(b.graph)
    backward.body = Region([], backward_nodes, grads)
    backward.body.params = add_params(backward.body, residuals) + cts
    forward = dce(forward)  # outputs stay: the residuals keep lining up with the backward
    backward = dce(backward)
    verify(forward)
    verify(backward)
    return VJP(forward, backward, len(outs), wrt)


def _kept_composites() -> frozenset[str]:
    """Composites autodiff sees whole: those with their own rule, and those no gradient
    flows through (stop_gradient, random sampling); the rest are differentiated
    through their decompositions."""
    return frozenset(name for name, op in registry.all_ops().items()
                     if op.kind == COMPOSITE and (op.vjp is not None or not op.differentiable))


# -- the tape: forward replay, then the reverse sweep --------------------------------------


class _Tape:
    """Replays regions into the builder's current region, tracking which values are
    active, then emits the backward of what it replayed."""

    def __init__(self, b: GraphBuilder):
        self.b = b
        self.active: set[int] = set()
        self.nodes: list = []  # replayed nodes (or loop views), in program order
        self.saved: dict[int, "_SavedLoop"] = {}

    def forward(self, region: Region, args: Sequence[Value], wrt: Sequence[bool]) -> list[Value]:
        b = self.b
        vmap: dict[Value, Value] = {}
        for param, arg, w in zip(region.params, args, wrt):
            vmap[param] = arg
            if w and differentiable_dtype(arg.type.dtype):
                self.active.add(id(arg))
        for node in region.nodes:
            operands = [vmap[v] for v in node.operands]
            active = any(id(v) in self.active for v in operands)
            if node.op == "while_loop" and active and node.attrs.get("max_trips") is not None:
                results = self._saving_loop(node, operands)
            else:
                regions = [_copy_region(r, vmap, None) for r in node.regions]
                results = b.apply(node.op, operands, node.attrs, regions=regions or None)
                self.nodes.append(b.region.nodes[-1])
            if active and registry.get(node.op).differentiable:
                self.active.update(id(r) for r in results if differentiable_dtype(r.type.dtype))
            for old, new in zip(node.results, results):
                vmap[old] = new
        return [vmap[v] for v in region.results]

    def backward(self, outs: Sequence[Value], seeds: Sequence[Value | None],
                 wrt: Sequence[Value]) -> list[Value]:
        """Cotangents of `wrt` given the cotangents `seeds` of the replayed `outs`."""
        b = self.b
        ct: dict[int, Value] = {}

        def accumulate(value: Value, g: Value) -> None:
            if g.type != value.type:
                raise KilnError(f"internal: a vjp rule gave a cotangent of type {g.type} for a "
                                f"value of type {value.type}")
            prev = ct.get(id(value))
            ct[id(value)] = g if prev is None else b.add(prev, g)

        for value, seed in zip(outs, seeds):
            if seed is not None and id(value) in self.active:
                accumulate(value, seed)
        for node in reversed(self.nodes):
            cts = [ct.get(id(r)) for r in node.results]
            if all(c is None for c in cts) or not any(id(v) in self.active for v in node.operands):
                continue
            for operand, g in zip(node.operands, self._rule(node, cts)):
                if g is not None and id(operand) in self.active:
                    accumulate(operand, g)
        return [ct.get(id(v)) or zeros(b, v.type) for v in wrt]

    def _rule(self, node, cts: list[Value | None]) -> list:
        opdef = registry.get(node.op)
        if opdef.vjp is None:
            raise KilnGradientError(
                f"grad: op '{node.op}' has no vjp rule, so gradients cannot flow through it",
                hint="wrap its input in kn.stop_gradient if no gradient is needed through it")
        if opdef.kind == CONTROL:
            return opdef.vjp(self.b, cts, node.operands, node.results, regions=node.regions,
                             saved=self.saved.get(id(node)), **node.attrs)
        return opdef.vjp(self.b, cts, node.operands, node.results, **node.attrs)

    # -- while_loop: a forward that saves each trip's carry -----------------------------

    def _saving_loop(self, node: Node, operands: list[Value]) -> list[Value]:
        b = self.b
        trips = int(node.attrs["max_trips"])
        cond_region, body = node.regions
        n = len(operands)
        saved = [j for j in range(n) if body.results[j] is not body.params[j]]
        i32 = dt.int32
        histories = [zeros(b, operands[j].type.with_shape((trips,) + tuple(operands[j].shape)))
                     for j in saved]

        def cond_fn(t, *rest):
            below = b.lt(t, b.full(trips, i32))
            (user,) = inline_region(b, cond_region, rest[:n])
            return [b.call("and", below, user)]

        def body_fn(t, *rest):
            carry, hist = rest[:n], rest[n:]
            stored = []
            for h, j in zip(hist, saved):
                row = b.reshape(carry[j], shape=(1,) + tuple(carry[j].shape))
                at = [t] + [b.full(0, i32)] * carry[j].type.rank
                stored.append(b.dynamic_update_slice(h, row, *at))
            out = inline_region(b, body, carry)
            return [b.add(t, b.full(1, i32))] + out + stored

        results = emit_while(b, [b.full(0, i32)] + list(operands) + histories, cond_fn, body_fn,
                             dict(node.attrs))
        view = _LoopView(b.region.nodes[-1], node, n)
        self.nodes.append(view)
        self.saved[id(view)] = _SavedLoop(results[0], dict(zip(saved, results[n + 1:])),
                                          node.regions[1])
        return results[1:n + 1]


@dataclass
class _SavedLoop:
    trips: Value  # how many trips the forward loop ran
    histories: dict[int, Value]  # carried index -> [max_trips, ...] carry before each trip
    body: Region  # the user's loop body


class _LoopView:
    """What the reverse sweep sees of a saving loop: the user's loop (its carried
    operands and results), not the counter and history buffers around them."""

    op = "while_loop"

    def __init__(self, emitted: Node, original: Node, n: int):
        self.operands = emitted.operands[1:n + 1]
        self.results = emitted.results[1:n + 1]
        self.regions = original.regions
        self.attrs = original.attrs


# -- building control flow inside rules --------------------------------------------------


def inline_region(b: GraphBuilder, region: Region, args: Sequence[Value],
                  renamed: dict[str, str] | None = None) -> list[Value]:
    """Emit `region`'s nodes into the current region with its params bound to `args`;
    `renamed` maps constant names of another graph to their names in `b`'s."""
    vmap: dict[Value, Value] = dict(zip(region.params, args))
    for node in region.nodes:
        regions = [_copy_region(r, vmap, None) for r in node.regions]
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


def _build_region(b: GraphBuilder, types, fn) -> Region:
    region = Region([Value(t) for t in types])
    b.regions.append(region)
    try:
        region.results = list(fn(*region.params))
    finally:
        b.regions.pop()
    return region


def emit_while(b: GraphBuilder, carried: Sequence[Value], cond_fn, body_fn,
               attrs: dict | None = None) -> list[Value]:
    """A while_loop built from Python callbacks over region parameters; values the
    callbacks use from outside become extra carried values the body passes on."""
    types = [v.type for v in carried]
    cond_region = _build_region(b, types, cond_fn)
    body = _build_region(b, types, body_fn)
    captured = captured_values([cond_region, body])
    add_params(cond_region, captured)
    body.results = body.results + add_params(body, captured)
    results = b.apply("while_loop", list(carried) + captured, attrs or {},
                      regions=[cond_region, body])
    return results[:len(carried)]


def emit_cond(b: GraphBuilder, index: Value, operands: Sequence[Value], branch_fns) -> list[Value]:
    """A cond built from Python callbacks; captured values become explicit operands."""
    types = [v.type for v in operands]
    regions = [_build_region(b, types, fn) for fn in branch_fns]
    captured = captured_values(regions)
    for region in regions:
        add_params(region, captured)
    return b.apply("cond", [index] + list(operands) + captured, {}, regions=regions)


def region_vjp(b: GraphBuilder, region: Region, args: Sequence[Value],
               cts: Sequence[Value | None], wrt: Sequence[bool]) -> list[Value]:
    """Emit the forward of `region` on `args` and its backward for output cotangents
    `cts` (None: zero); returns the cotangents of the args marked in `wrt`."""
    tape = _Tape(b)
    outs = tape.forward(region, args, wrt)
    return tape.backward(outs, cts, [a for a, w in zip(args, wrt) if w])


# -- the control-flow vjp rules (registered beside the ops in kiln/ir/ops/control.py) ------


def cond_vjp(b: GraphBuilder, cts, xs, ys, *, regions, **_) -> list:
    """Backward of cond: a cond on the same index over the branches' backwards."""
    index, operands = xs[0], list(xs[1:])
    wrt = [differentiable_dtype(v.type.dtype) for v in operands]
    if not any(wrt):
        return [None] * len(xs)
    float_out = [differentiable_dtype(y.type.dtype) for y in ys]
    seeds = [c if c is not None else zeros(b, y.type) for c, y, f in zip(cts, ys, float_out) if f]

    def branch(region):
        def fn(*params):
            args, ct_params = params[:len(operands)], iter(params[len(operands):])
            return region_vjp(b, region, args, [next(ct_params) if f else None
                                                for f in float_out], wrt)
        return fn

    grads = iter(emit_cond(b, index, operands + seeds, [branch(r) for r in regions]))
    return [None] + [next(grads) if w else None for w in wrt]


def while_loop_vjp(b: GraphBuilder, cts, xs, ys, *, regions, saved=None, max_trips=None, **_) -> list:
    """Backward of a bounded while_loop: the trips in reverse, each the vjp of the body
    at the carry that trip started from (saved by the forward)."""
    if saved is None:
        raise KilnGradientError(
            "grad: a gradient reaches a while_loop without a trip bound, so its trips cannot "
            "be replayed backwards",
            hint="pass max_iterations=N to kn.while_loop (the loop then stops after at most N "
                 "trips and saves each trip's carried values for the backward)")
    i32 = dt.int32
    wrt = [differentiable_dtype(v.type.dtype) for v in xs]
    seeds = [c if c is not None else zeros(b, y.type) for c, y, w in zip(cts, ys, wrt) if w]

    def cond_fn(k, *_cts):
        return [b.gt(k, b.full(0, i32))]

    def body_fn(k, *ct_in):
        k1 = b.sub(k, b.full(1, i32))
        carry = []
        for j, x in enumerate(xs):
            h = saved.histories.get(j)
            if h is None:  # passed through the body unchanged: the loop's operand
                carry.append(x)
                continue
            shape = tuple(x.type.shape)
            at = [k1] + [b.full(0, i32)] * len(shape)
            row = b.dynamic_slice(h, *at, sizes=(1,) + shape)
            carry.append(b.reshape(row, shape=shape))
        it = iter(ct_in)
        grads = region_vjp(b, saved.body, carry, [next(it) if w else None for w in wrt], wrt)
        return [k1] + grads

    out = emit_while(b, [saved.trips] + seeds, cond_fn, body_fn)
    grads = iter(out[1:])
    return [next(grads) if w else None for w in wrt]


# -- inlining a graph -----------------------------------------------------------------


def inline(b: GraphBuilder, graph: Graph, args: Sequence[Value]) -> list[Value]:
    """Emit `graph`'s nodes into `b`'s current region with its inputs bound to `args`;
    returns the values of its outputs. Constants are carried over (renamed on a clash)."""
    renamed: dict[str, str] = {}
    for name, array in graph.constants.items():
        new = name
        while new in b.graph.constants and b.graph.constants[new] is not array:
            new += "_"
        b.graph.constants[new] = array
        renamed[name] = new
    for name, var in graph.shape_vars.items():
        b.graph.shape_vars.setdefault(name, var)
    return inline_region(b, graph.body, args, renamed)
