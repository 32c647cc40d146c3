"""A compiled function that changes state it does not receive: functionalized.

`kn.compile(step)` where `step` runs `loss.backward(); opt.step(); opt.zero_grad()` reads
and writes tensors that are not its arguments: the parameters (rebound in place by the
optimizer), their `.grad`, the optimizer's state and learning rates. torch.compile
handles this by lifting that state into graph inputs and writing the mutations back
after the call; kiln does the same, in two steps:

1. Discovery: the first trace that would change outside state (K302 otherwise) runs
   again under a `StateTracker`, which records every outside tensor the function
   rebinds in place, every leaf whose `.grad` it sets, and the tensors stateful objects
   declare as inputs (an optimizer's per-group learning rates); afterwards everything
   is put back as it was.
2. A pure function `pure(state, grads, *args) -> (result, new_state, new_grads)` is
   compiled with the same options: inside its trace the recorded handles hold the
   traced inputs (so reads and in-place writes are graph values), and after each call
   the new values are written back into the same handles (ties, module attributes and
   the optimizer's lists all see them) and the `.grad` slots are set.

One compiled program thus runs forward, backward and the optimizer update, and a new
learning rate from a scheduler is new data, not a recompile.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

_local = threading.local()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


class StateTracker:
    """Records the outside tensors a traced function touches, and restores them."""

    def __init__(self) -> None:
        self.handles: dict = {}  # id -> (tensor, (x, builder, node, version))
        self.grads: dict = {}  # id -> (leaf, its grad before)
        self.hooks: list = []  # callables run before each compiled call (sync inputs)

    def record(self, t) -> None:
        if id(t) not in self.handles:
            self.handles[id(t)] = (t, (t._x, t._builder, t._node, t._version))

    def record_grad(self, leaf) -> None:
        if id(leaf) not in self.grads:
            self.grads[id(leaf)] = (leaf, leaf._grad)

    def declare(self, t, hook=None) -> None:
        """A stateful object's tensor that must be an input (read, maybe not written)."""
        self.record(t)
        if hook is not None and hook not in self.hooks:
            self.hooks.append(hook)

    def restore(self) -> None:
        for t, (x, builder, node, version) in self.handles.values():
            t._x, t._builder, t._node, t._version = x, builder, node, version
        for leaf, grad in self.grads.values():
            leaf._grad = grad


def active_tracker() -> StateTracker | None:
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def tracking(tracker: StateTracker):
    _stack().append(tracker)
    try:
        yield tracker
    finally:
        _stack().pop()


def declare_state(t, hook=None) -> None:
    """Called by stateful objects (optimizers) for tensors a compiled step must take as
    inputs; a no-op outside discovery."""
    tracker = active_tracker()
    if tracker is not None:
        tracker.declare(t, hook)


@contextlib.contextmanager
def outside_trace():
    """Make concrete tensors even while tracing (an optimizer's initial zero state)."""
    from kiln.frontend.dispatch import trace_stack

    stack = trace_stack()
    saved = stack[:]
    stack.clear()
    try:
        yield
    finally:
        stack.extend(saved)


class Functionalized:
    """What a CompiledFunction runs once its function turned out to change outside state."""

    def __init__(self, compiled, args: tuple) -> None:
        from kiln.frontend.compile import CompiledFunction
        from kiln.frontend.tracing import trace_function

        self.fn = compiled.fn
        tracker = StateTracker()
        try:
            with tracking(tracker):
                trace_function(self.fn, tuple(args), compiled.dynamic_shapes)
        finally:
            tracker.restore()
        self.handles = [t for t, _ in tracker.handles.values()]
        self.leaves = [leaf for leaf, _ in tracker.grads.values()]
        self.hooks = list(tracker.hooks)
        fn, handles, leaves = self.fn, self.handles, self.leaves

        def pure(state, grads, *args):
            saved = [(t, t._x, t._builder, t._node, t._version) for t in handles]
            saved_grads = [(leaf, leaf._grad) for leaf in leaves]
            try:
                for t, v in zip(handles, state):
                    t._x, t._builder, t._node = v._x, v._builder, None
                for leaf, g in zip(leaves, grads):
                    leaf._grad = g
                result = fn(*args)
                new_state = [_value_of(t) for t in handles]
                new_grads = [leaf._grad for leaf in leaves]
            finally:
                for t, x, builder, node, version in saved:
                    t._x, t._builder, t._node, t._version = x, builder, node, version
                for leaf, g in saved_grads:
                    leaf._grad = g
            return result, new_state, new_grads

        pure.__name__ = getattr(self.fn, "__name__", "step")
        try:
            names = [p for p in inspect.signature(self.fn).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            own = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY)
                   for n in ("functionalized_state", "functionalized_grads")]
            pure.__signature__ = inspect.Signature(
                own + [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_ONLY) for p in names])
        except (TypeError, ValueError):
            pass
        dynamic_shapes = compiled.dynamic_shapes
        if isinstance(dynamic_shapes, (list, tuple)):
            dynamic_shapes = (None, None) + tuple(dynamic_shapes)
        self.inner = CompiledFunction(pure, compiled.backend, compiled.mode, compiled.fullgraph,
                                      dynamic_shapes, compiled.recompile_limit)
        self.inner.dynamic, self.inner.explain = compiled.dynamic, compiled.explain
        self.inner.strict = compiled.strict
        # the CompiledFunction the user holds reports what actually compiles
        compiled.stats, compiled.compiled_graphs = self.inner.stats, self.inner.compiled_graphs

    def __call__(self, *args):
        from kiln.frontend.mutation import rebind
        from kiln.frontend.tape import no_grad

        for hook in self.hooks:
            hook()
        grads = [leaf._grad for leaf in self.leaves]
        result, new_state, new_grads = self.inner(list(self.handles), grads, *args)
        with no_grad():
            for t, v in zip(self.handles, new_state):
                if v is not None and v._x is not t._x:
                    rebind(t, v, "compiled write-back")
        for leaf, g in zip(self.leaves, new_grads):
            leaf._grad = g
        return result

    def stats(self) -> dict:
        return self.inner.stats()


def _value_of(t):
    from kiln.frontend.tensor import Tensor

    return Tensor._make(t._x, t._builder)
