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


def _walk(root: NodeRef) -> list[TapeNode]:
    """The nodes `root` depends on, operands before users (iterative, no recursion
    limit on long tapes)."""
    order: list[TapeNode] = []
    seen: set = set()
    stack: list = [(root.node, False)]
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
            if isinstance(ref, NodeRef) and id(ref.node) not in seen:
                stack.append((ref.node, False))
    return order


def backward(tensor, gradient=None, inputs: Sequence | None = None) -> None:
    """Accumulate d(tensor)/d(leaf) into `leaf.grad` for every leaf `tensor` was computed
    from (torch.Tensor.backward / torch.autograd.backward)."""
    from kiln.frontend.tensor import Tensor
    from kiln.ir.graph import Graph
    from kiln.ir.interpret import run_graph
    from kiln.passes.autodiff import differentiable_dtype, inline, vjp_graph

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
    if isinstance(ref, LeafRef):  # backward of a leaf itself: d leaf / d leaf
        nodes = []
    else:
        nodes = _walk(ref)
    # graph inputs: leaves first (the wrt set), then every other operand the nodes read
    leaves: dict = {}
    others: dict = {}

    def visit(x):
        if isinstance(x, LeafRef):
            leaves.setdefault((id(x.tensor), id(x.primal)), x)
        elif not isinstance(x, NodeRef) and not _is_scalar(x):
            others.setdefault(id(x), x)

    visit(ref)
    for node in nodes:
        for x in node.operands:
            visit(x)
    wanted = None if inputs is None else {id(t) for t in inputs}
    leaf_list = [lf for lf in leaves.values() if wanted is None or id(lf.tensor) in wanted]
    leaf_list += [lf for lf in leaves.values() if lf not in leaf_list]
    base = traced if traced is not None else EAGER
    b = GraphBuilder(Graph("backward"))
    env: dict = {}
    for lf in leaf_list:
        env[id(lf)] = b.add_input(_type(lf.primal))
    for key, x in others.items():
        env[("v", key)] = b.add_input(_type(x))

    def value(x):
        if isinstance(x, LeafRef):
            return env[id(leaves[(id(x.tensor), id(x.primal))])]
        if isinstance(x, NodeRef):
            return env[(id(x.node), x.index)]
        if _is_scalar(x):
            return x
        return env[("v", id(x))]

    for node in nodes:
        results = b.apply(node.op, [value(x) for x in node.operands], node.attrs)
        for i, r in enumerate(results):
            env[(id(node), i)] = r
    b.graph.body.results = [value(ref)]
    wrt = [i for i, lf in enumerate(leaf_list) if differentiable_dtype(lf.tensor.dtype)
           and (wanted is None or id(lf.tensor) in wanted)]
    vjp = vjp_graph(b.graph, wrt, 1)
    primals = [lf.primal for lf in leaf_list] + list(others.values())
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
    if traced is not None:
        import numpy as np

        prim = [traced.constant(p) if isinstance(p, np.ndarray) else p for p in primals]
        fwd = inline(traced, vjp.forward, prim)
        grads = inline(traced, vjp.backward, fwd[1:] + [seed])
    else:
        fwd = run_graph(vjp.forward, *primals)
        grads = run_graph(vjp.backward, *fwd[1:], seed)
    for i, g in zip(wrt, grads):
        leaf = leaf_list[i].tensor
        grad = Tensor._make(g, traced)
        if leaf._grad is None:
            leaf._grad = grad
        else:
            from kiln.frontend.functional import add

            with no_grad():
                leaf._grad = add(leaf._grad, grad)


def _type(x):
    from kiln.ir.graph import Value

    return x.type if isinstance(x, Value) else EAGER.type_of(x)


def _is_scalar(x) -> bool:
    from kiln.ir.emitter import is_python_scalar

    return is_python_scalar(x)
