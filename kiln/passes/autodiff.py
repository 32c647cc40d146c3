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
non-differentiable ops (comparisons, argmax, integer arithmetic) end the flow. The tape
and the control-flow vjp rules live below the ops, in kiln/ir/ad.py; this pass adds the
decomposition, the forward/backward split and dead-code elimination.

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

from kiln.errors import KilnGradientError
from kiln.ir import registry
from kiln.ir.ad import Tape, differentiable_dtype
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Region, Value
from kiln.ir.registry import COMPOSITE
from kiln.ir.regions import add_params, free_values, inline_region
from kiln.ir.verifier import verify
from kiln.passes.dce import dce
from kiln.passes.decompose import decompose
from kiln.passes.rewrite import new_graph_like

__all__ = ["VJP", "differentiable_dtype", "inline", "vjp_graph"]


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
              num_differentiated: int | None = None, *, verify_result: bool = True) -> VJP:
    """Differentiate `graph` with respect to its inputs `wrt` (all float inputs if None).

    The backward takes one cotangent per *float* output among the first
    `num_differentiated` (all by default; later outputs are auxiliary values no
    gradient flows from) and returns one cotangent per entry of `wrt`, zeros where an
    input does not reach the outputs.

    `verify_result=False`: the caller inlines both graphs into a graph that is verified
    as a whole (a trace: its builder re-infers every node's type as it is inlined, and
    the traced graph is verified before it compiles), so verifying them here would
    check the same nodes twice (~3 ms of a GPT training step's 30 ms trace).

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
    tape = Tape(b)
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
    if verify_result:
        verify(forward)
        verify(backward)
    return VJP(forward, backward, len(outs), wrt)


def _kept_composites() -> frozenset[str]:
    """Composites autodiff sees whole: those with their own rule, and those no gradient
    flows through (stop_gradient, random sampling); the rest are differentiated
    through their decompositions."""
    return frozenset(name for name, op in registry.all_ops().items()
                     if op.kind == COMPOSITE and (op.vjp is not None or not op.differentiable))


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
