"""Tape autograd (`requires_grad`, `.backward()`, `.grad`, `kn.no_grad`) over the vjp rules.

PyTorch's reverse mode, built on kiln's functional one: while grad mode is on, every op
applied to a tensor that requires grad (a leaf marked `requires_grad=True`, or a result
computed from one) is recorded as a `TapeNode` beside the result, the way torch keeps
`grad_fn`. The tape is only a record: `loss.backward()` replays the nodes reachable from
`loss` into a graph whose inputs are the leaves (and the other operands the nodes read),
differentiates that graph with `kiln.passes.autodiff.vjp_graph` — the same pass and the
same per-op vjp rules as `kn.grad`; there is no second set of derivative rules — runs
it, and adds the results into each leaf's `.grad`.

The recording happens in `TapeEmitter`, which wraps the emitter an op would use anyway
(eager numpy, or the graph being traced), so a tape also forms inside `kn.compile`: there
`backward()` inlines the forward and backward graphs into the traced program.

Nodes hold their operands, so a tape lives exactly as long as the tensors computed from
it (torch's lifetime). As in torch, `backward()` frees nothing the user still holds; a
second `backward()` through the same tensors computes the same gradients again.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Sequence

from kiln.errors import KilnBackwardError
from kiln.ir import registry
from kiln.ir.emitter import EAGER, Emitter, GraphBuilder

_mode = threading.local()


def is_grad_enabled() -> bool:
    """Whether ops record a tape for tensors that require grad (torch.is_grad_enabled)."""
    return getattr(_mode, "enabled", True)


class set_grad_enabled(contextlib.ContextDecorator):
    """Turn recording on or off inside a `with` block or a decorated function
    (torch.set_grad_enabled); calling it outside `with` sets the mode."""

    def __init__(self, mode: bool) -> None:
        self.prev = is_grad_enabled()
        self.mode = bool(mode)
        _mode.enabled = self.mode

    def __enter__(self):
        _mode.enabled = self.mode
        return self

    def __exit__(self, *exc) -> bool:
        _mode.enabled = self.prev
        return False


class no_grad(contextlib.ContextDecorator):
    """No tape inside this block: results do not require grad (torch.no_grad).

    >>> with kn.no_grad():
    ...     val_loss = model(x).mean()
    """

    def __enter__(self):
        self.prev = is_grad_enabled()
        _mode.enabled = False
        return self

    def __exit__(self, *exc) -> bool:
        _mode.enabled = self.prev
        return False


class enable_grad(no_grad):
    """Recording on inside this block, also within `no_grad` (torch.enable_grad)."""

    def __enter__(self):
        self.prev = is_grad_enabled()
        _mode.enabled = True
        return self


inference_mode = no_grad


# -- the record ---------------------------------------------------------------------------


class LeafRef:
    """A leaf tensor as it was when an op read it (`primal` is its value then)."""

    __slots__ = ("tensor", "primal")

    def __init__(self, tensor, primal) -> None:
        self.tensor, self.primal = tensor, primal


class TapeNode:
    """One recorded op: its name, attributes and operands (refs or plain values)."""

    __slots__ = ("op", "attrs", "operands", "__weakref__")

    def __init__(self, op: str, attrs: dict, operands: list) -> None:
        self.op, self.attrs, self.operands = op, attrs, operands

    def name(self) -> str:
        return f"{self.op}Backward"

    def __repr__(self) -> str:
        return f"<{self.name()}>"


class NodeRef:
    """Result `index` of a recorded node."""

    __slots__ = ("node", "index")

    def __init__(self, node: TapeNode, index: int) -> None:
        self.node, self.index = node, index


class OpaqueNode(TapeNode):
    """A call whose backward is a function, not recorded ops: a compiled module's program
    (kiln/nn/compiled.py). `pullback(cotangents per output, None for zero)` returns one
    cotangent per operand (None where no gradient flows)."""

    __slots__ = ("pullback", "outputs")

    def __init__(self, name: str, operands: list, outputs: list, pullback) -> None:
        super().__init__(name, {}, operands)
        self.outputs, self.pullback = outputs, pullback


def record_opaque(name: str, operands: list, outputs: list, pullback) -> list:
    """Tape refs for the `outputs` (eager arrays) of an opaque call on `operands`
    (tensors); None when grad mode is off or no operand requires grad."""
    refs = [t._grad_ref() for t in operands] if is_grad_enabled() else []
    if not any(r is not None for r in refs):
        return [None] * len(outputs)
    node = OpaqueNode(name, refs, outputs, pullback)
    return [NodeRef(node, i) for i in range(len(outputs))]


class Dual:
    """An operand inside a TapeEmitter: the value the wrapped emitter computes with, and
    the tape reference gradients flow back through."""

    __slots__ = ("primal", "ref")

    def __init__(self, primal, ref) -> None:
        self.primal, self.ref = primal, ref


def _primal(x):
    return x.primal if isinstance(x, Dual) else x


class TapeEmitter(Emitter):
    """Computes with `base` (eager or a graph builder) and records a TapeNode for every
    differentiable op with a Dual operand."""

    def __init__(self, base: Emitter) -> None:
        self.base = base

    def type_of(self, x):
        return self.base.type_of(_primal(x))

    def constant(self, array):
        return self.base.constant(array)

    def apply(self, op: str, operands: Sequence[Any], attrs: dict[str, Any]) -> list:
        results = self.base.apply(op, [_primal(x) for x in operands], attrs)
        refs = [x.ref for x in operands if isinstance(x, Dual)]
        if not refs or not registry.get(op).differentiable:
            return results
        node = TapeNode(op, dict(attrs), [x.ref if isinstance(x, Dual) else x for x in operands])
        return [Dual(r, NodeRef(node, i)) for i, r in enumerate(results)]

    def dims_equal(self, a, b) -> bool:
        from kiln.ir.shapes import dims_equal

        return dims_equal(a, b)

    def same_shape(self, a, b) -> bool:
        from kiln.ir.shapes import shapes_equal

        return shapes_equal(self.type_of(a).shape, self.type_of(b).shape)


def taping(em: Emitter, args: Sequence) -> Emitter:
    """`em`, wrapped to record a tape when grad mode is on and an operand needs it."""
    from kiln.frontend.tensor import Tensor

    if not is_grad_enabled() or isinstance(em, TapeEmitter):
        return em
    for a in args:
        if isinstance(a, Tensor) and (a._node is not None or a._requires_grad):
            return TapeEmitter(em)
    return em


def builder_of(em: Emitter) -> GraphBuilder | None:
    base = em.base if isinstance(em, TapeEmitter) else em
    return base if isinstance(base, GraphBuilder) else None


# -- backward -----------------------------------------------------------------------------


def _walk(roots: list) -> list[TapeNode]:
    """The recorded op nodes the `roots` depend on, operands before users (iterative, no
    recursion limit on long tapes); the walk stops at opaque nodes."""
    order: list[TapeNode] = []
    seen: set = set()
    stack: list = [(r.node, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for ref in node.operands:
            if isinstance(ref, NodeRef) and id(ref.node) not in seen \
                    and not isinstance(ref.node, OpaqueNode):
                stack.append((ref.node, False))
    return order


def backward(tensor, gradient=None, inputs: Sequence | None = None) -> None:
    """Accumulate d(tensor)/d(leaf) into `leaf.grad` for every leaf `tensor` was computed
    from (torch.Tensor.backward / torch.autograd.backward)."""
    from kiln.frontend.tensor import Tensor
    from kiln.ir.ad import differentiable_dtype

    ref = tensor._grad_ref()
    if ref is None:
        raise KilnBackwardError(
            f"backward: this {tensor.dtype.short}{list(tensor.shape)} tensor does not require "
            "grad: it was not computed from a tensor with requires_grad=True while grad mode "
            "was on", hint="mark the leaves (w.requires_grad_() or nn.Parameter), and call "
                           "backward outside kn.no_grad()")
    if not differentiable_dtype(tensor.dtype):
        raise KilnBackwardError(f"backward: only float tensors have gradients, got {tensor.dtype}")
    if gradient is None:
        if tensor.numel() != 1:
            raise KilnBackwardError(
                f"backward: the gradient can be implied only for a tensor with one element, "
                f"this one is {tensor.dtype.short}{list(tensor.shape)}",
                hint="reduce it first (loss.sum()) or pass gradient= of its shape")
    traced = tensor._builder
    base = traced if traced is not None else EAGER
    if gradient is None:
        seed = base.full(1, tensor.dtype, tuple(tensor.shape))
    else:
        g = gradient if isinstance(gradient, Tensor) else Tensor(gradient)
        if tuple(g.shape) != tuple(tensor.shape):
            raise KilnBackwardError(f"backward: gradient is {g.dtype.short}{list(g.shape)} but "
                                    f"the tensor is {tensor.dtype.short}{list(tensor.shape)}")
        if traced is not None:
            data = g._x if g._builder is traced else traced.constant(g.numpy())
        else:
            data = g.numpy()
        seed = base.convert(data, tensor.dtype)
    wanted = None if inputs is None else {id(t) for t in inputs}
    _backprop([(ref, seed)], traced, wanted)


def _accumulate(leaf, g, traced) -> None:
    from kiln.frontend.tensor import Tensor

    from kiln.frontend.functionalize import active_tracker

    tracker = active_tracker()
    if tracker is not None and leaf._builder is None:
        tracker.record_grad(leaf)
    elif traced is not None and leaf._builder is None:
        from kiln.errors import KilnTracedStateError, user_location

        raise KilnTracedStateError(
            f"backward: inside a trace, the gradient reached a {leaf.dtype.short}"
            f"{list(leaf.shape)} leaf the function did not receive as an argument (a closed-over "
            "tensor or a module parameter); its .grad would hold a traced value after the trace",
            where=user_location(),
            hint="compile the module (kn.compile(model)) and call loss.backward() outside, or use "
                 "kn.grad / kn.value_and_grad inside the compiled function")

    if traced is None:  # on the leaf's device, counted there while it lives
        from kiln.runtime.placement import charge

        charge(g, leaf._device)
    grad = Tensor._make(g, traced, None if traced is not None else leaf._device)
    if leaf._grad is None:
        leaf._grad = grad
    else:
        from kiln.frontend.functional import add

        with no_grad():
            leaf._grad = add(leaf._grad, grad)


def _backprop(roots: list, traced, wanted) -> None:
    """Push cotangents `roots` [(ref, cotangent)] back to the leaves: one graph for the
    recorded ops (differentiated by vjp_graph), cut at opaque nodes, whose own pullbacks
    then continue the walk (gradients are linear, so the parts add up)."""
    from kiln.ir.graph import Graph
    from kiln.ir.interpret import run_graph
    from kiln.ir.ad import differentiable_dtype
    from kiln.passes.autodiff import inline, vjp_graph

    opaque_cts: dict = {}  # id(node) -> (node, {index: cotangent})

    def to_opaque(ref, ct):
        entry = opaque_cts.setdefault(id(ref.node), (ref.node, {}))[1]
        if ref.index in entry:
            ct = (traced or EAGER).binary("add", entry[ref.index], ct)
        entry[ref.index] = ct

    graph_roots = []
    for ref, ct in roots:
        if isinstance(ref, LeafRef):
            if wanted is None or id(ref.tensor) in wanted:
                _accumulate(ref.tensor, ct, traced)
        elif isinstance(ref.node, OpaqueNode):
            to_opaque(ref, ct)
        else:
            graph_roots.append((ref, ct))
    if graph_roots:
        nodes = _walk([r for r, _ in graph_roots])
        leaves: dict = {}
        cuts: dict = {}
        others: dict = {}
        for node in nodes:
            for x in node.operands:
                if isinstance(x, LeafRef):
                    leaves.setdefault((id(x.tensor), id(x.primal)), x)
                elif isinstance(x, NodeRef) and isinstance(x.node, OpaqueNode):
                    cuts.setdefault((id(x.node), x.index), x)
                elif not isinstance(x, NodeRef) and not _is_scalar(x):
                    others.setdefault(id(x), x)
        b = GraphBuilder(Graph("backward"))
        env: dict = {}
        inputs = list(leaves.values()) + list(cuts.values())
        for x in inputs:
            env[id(x)] = b.add_input(_type(_cut_primal(x)))
        for key, x in others.items():
            env[("v", key)] = b.add_input(_type(x))

        def value(x):
            if isinstance(x, LeafRef):
                return env[id(leaves[(id(x.tensor), id(x.primal))])]
            if isinstance(x, NodeRef):
                if isinstance(x.node, OpaqueNode):
                    return env[id(cuts[(id(x.node), x.index)])]
                return env[(id(x.node), x.index)]
            if _is_scalar(x):
                return x
            return env[("v", id(x))]

        for node in nodes:
            results = b.apply(node.op, [value(x) for x in node.operands], node.attrs)
            for i, r in enumerate(results):
                env[(id(node), i)] = r
        b.graph.body.results = [value(r) for r, _ in graph_roots]
        wrt = [i for i, x in enumerate(inputs)
               if differentiable_dtype(_type(_cut_primal(x)).dtype)
               and (not isinstance(x, LeafRef) or wanted is None or id(x.tensor) in wanted)]
        # traced: both halves are inlined into the trace, which is verified whole
        vjp = vjp_graph(b.graph, wrt, len(graph_roots), verify_result=traced is None)
        primals = [_cut_primal(x) for x in inputs] + list(others.values())
        seeds = [ct for _, ct in graph_roots]
        if traced is not None:
            import numpy as np

            prim = [traced.constant(p) if isinstance(p, np.ndarray) else p for p in primals]
            fwd = inline(traced, vjp.forward, prim)
            grads = inline(traced, vjp.backward, fwd[len(seeds):] + seeds)
        else:
            fwd = run_graph(vjp.forward, *primals)
            grads = run_graph(vjp.backward, *fwd[len(seeds):], *seeds)
        for i, g in zip(wrt, grads):
            x = inputs[i]
            if isinstance(x, LeafRef):
                _accumulate(x.tensor, g, traced)
            else:
                to_opaque(x, g)
    for node, cts in opaque_cts.values():
        operand_cts = node.pullback([cts.get(i) for i in range(len(node.outputs))])
        more = [(ref, ct) for ref, ct in zip(node.operands, operand_cts)
                if ct is not None and isinstance(ref, (LeafRef, NodeRef))]
        if more:
            _backprop(more, traced, wanted)


def _cut_primal(x):
    """The value a graph input of the backward stands for: a leaf's value when read, or
    an opaque node's output."""
    return x.primal if isinstance(x, LeafRef) else x.node.outputs[x.index]


def _type(x):
    from kiln.ir.graph import Value

    return x.type if isinstance(x, Value) else EAGER.type_of(x)


def _is_scalar(x) -> bool:
    from kiln.ir.emitter import is_python_scalar

    return is_python_scalar(x)
