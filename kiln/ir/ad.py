"""The reverse-mode machinery beneath the ops (JAX's `interpreters/ad.py`): a tape that
replays a region and emits its backward through each op's `vjp` rule, and the vjp rules
of the region-carrying ops (`cond`, `while_loop`, `fused`) that need it.

It lives in the IR layer so that those ops carry their vjp rule beside their definition
without reaching up into the passes; the autodiff *pass* (kiln/passes/autodiff.py:
`vjp_graph`, decomposition first, dead code after) is built on it.

Only *active* values (those that depend on a differentiated input through float or
complex dtypes) get cotangents; `stop_gradient` and non-differentiable ops end the flow.

- `cond`/`switch`: the backward is a `cond` on the same index whose branches are the
  backward of each branch (each recomputes its branch's forward, so only the taken
  branch runs, forward and backward).
- `while_loop`: differentiable when it has a trip bound (`max_trips`): the forward loop
  also counts its trips and saves each trip's carried values into `[N, ...]` buffers; the
  backward loop runs the trips in reverse, each one the vjp of the body at its saved carry.

    >>> b = GraphBuilder(); x = b.add_input(f32_4)
    >>> (gx,) = region_vjp(b, region, [x], [ct], [True])   # d(region)/dx applied to ct
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kiln.errors import KilnError, KilnGradientError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.graph import Node, Region, Value
from kiln.ir.ops.rules import zeros
from kiln.ir.registry import CONTROL
from kiln.ir.regions import copy_region, emit_cond, emit_while, inline_region

if TYPE_CHECKING:
    from kiln.ir.emitter import GraphBuilder


def differentiable_dtype(dtype: dt.DType) -> bool:
    """Values of float and complex dtypes carry cotangents; integers and bools do not. A
    complex cotangent is dL/dRe + i dL/dIm, PyTorch's convention (the conjugate Wirtinger
    derivative times 2), which every complex vjp rule in kiln/ir/ops follows."""
    return dtype.is_floating or dtype.is_complex


class Tape:
    """Replays regions into the builder's current region, tracking which values are
    active, then emits the backward of what it replayed.

    >>> tape = Tape(b)
    >>> outs = tape.forward(graph.body, primals, [True] * len(primals))
    >>> grads = tape.backward(outs, seeds, primals)
    """

    def __init__(self, b: GraphBuilder):
        self.b = b
        self.active: set[int] = set()
        self.nodes: list = []  # replayed nodes (or loop views), in program order
        self.saved: dict[int, "_SavedLoop"] = {}

    def forward(self, region: Region, args: Sequence[Value], wrt: Sequence[bool]) -> list[Value]:
        """Replay `region` on `args`; the args marked in `wrt` (of a differentiable dtype)
        start the active set. Returns the replayed results."""
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
                regions = [copy_region(r, vmap) for r in node.regions]
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


def region_vjp(b: GraphBuilder, region: Region, args: Sequence[Value],
               cts: Sequence[Value | None], wrt: Sequence[bool]) -> list[Value]:
    """Emit the forward of `region` on `args` and its backward for output cotangents
    `cts` (None: zero); returns the cotangents of the args marked in `wrt`."""
    tape = Tape(b)
    outs = tape.forward(region, args, wrt)
    return tape.backward(outs, cts, [a for a, w in zip(args, wrt) if w])


# -- the region ops' vjp rules (registered beside the ops in kiln/ir/ops/) -------------------


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


def while_loop_vjp(b: GraphBuilder, cts, xs, ys, *, regions, saved=None, max_trips=None,
                   **_) -> list:
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


def fused_vjp(b: GraphBuilder, cts, xs, ys, *, regions, **_) -> list:
    """Backward of a fusion group: its region differentiated like the function it is."""
    wrt = [differentiable_dtype(x.type.dtype) for x in xs]
    grads = iter(region_vjp(b, regions[0], xs, cts, wrt))
    return [next(grads) if w else None for w in wrt]
