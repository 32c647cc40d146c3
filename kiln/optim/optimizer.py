"""The optimizer protocol: pure updates on pytrees of tensors, plus an eager shortcut.

An optimizer is a set of hyperparameters and two pure functions (optax's shape):

    state = opt.init(params)                                  # zeros, step count 0
    new_params, new_state = opt.update(grads, state, params)  # one step

`params` and `grads` are pytrees of tensors with the same structure (usually the dict
`dict(model.named_parameters())` and what `kn.grad` returns for it); the state is a
pytree too, with the step count as an int64 scalar *tensor*. Everything is kiln ops,
so `update` traces: inside `kn.compile(train_step)` the step count is a graph input
and the bias corrections are computed from it, and one compiled program serves every
step. Hyperparameters that are Python floats (lr, betas, weight decay) are baked into
the compiled program; changing them means building a new optimizer (and compiling
again). A learning-rate *schedule* is a function of the step count tensor instead,
which compiles once.

For eager code, `opt.step(model, grads)` keeps the state itself and writes the new
parameters into the model, like torch's `optimizer.step()`.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any

import numpy as np

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.frontend import pytree
from kiln.frontend.tensor import Tensor


def is_leaf(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray))


def leaves_of(tree) -> tuple[list, Any]:
    """The tensors of a pytree (numpy arrays wrapped) and its structure."""
    from kiln.frontend.factories import asarray

    leaves, spec = pytree.flatten(tree, is_leaf)
    return [x if isinstance(x, Tensor) else asarray(x) for x in leaves], spec


def same_structure(op: str, spec, other_spec, a: str, b: str) -> None:
    """Raise naming the first difference when two pytrees differ in structure."""
    if spec == other_spec:
        return
    both_dicts = all(isinstance(s, dict) and "dict" in s for s in (spec, other_spec))
    if both_dicts:
        keys_a = [k for k, _ in spec["dict"]]
        keys_b = [k for k, _ in other_spec["dict"]]
        missing = [k for k in keys_a if k not in keys_b]
        extra = [k for k in keys_b if k not in keys_a]
        if missing or extra:
            raise KilnArgumentError(
                f"{op}: {b} and {a} have different keys: {b} lacks {missing}, has extra {extra}")
    raise KilnArgumentError(f"{op}: {b} and {a} must have the same structure "
                            f"(dicts with the same keys, lists of the same length)")


def align(op: str, params, grads) -> tuple[list, list, Any]:
    """Leaves of params and grads in the same order, and params' structure."""
    p, p_spec = leaves_of(params)
    if isinstance(params, dict) and isinstance(grads, dict) and list(params) != list(grads) \
            and set(params) == set(grads):
        grads = {k: grads[k] for k in params}
    g, g_spec = leaves_of(grads)
    same_structure(op, p_spec, g_spec, "params", "grads")
    for i, (a, b) in enumerate(zip(p, g)):
        if tuple(a.shape) != tuple(b.shape):
            from kiln.errors import KilnShapeError

            raise KilnShapeError(f"{op}: gradient leaf {i} is {b.dtype.short}{list(b.shape)} but "
                                 f"its parameter is {a.dtype.short}{list(a.shape)}")
    return p, g, p_spec


def step_count(state, op: str):
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, Tensor):
        raise KilnArgumentError(f"{op}: state must be what {op.split('.')[0]}.init(params) "
                                f"returned (a dict with a 'step' tensor)")
    return step


def learning_rate(lr, step):
    """`lr` itself, or the schedule `lr(step)` at the step count before this update."""
    return lr(step) if callable(lr) else lr


def check_lr(name: str, lr) -> None:
    if not callable(lr) and (not isinstance(lr, (int, float)) or lr < 0):
        raise KilnArgumentError(f"{name}: lr must be a number >= 0 or a schedule "
                                f"(a function of the step count tensor), got {lr!r}")


class Optimizer(abc.ABC):
    """Base class: subclasses define `init(params)` and `update(grads, state, params)`."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._groups = None  # torch-style ParamGroups when built with params

    def _attach(self, params, defaults: dict) -> None:
        """Keep torch-style parameter groups (kiln/optim/stateful.py)."""
        if params is not None:
            from kiln.optim.stateful import ParamGroups

            self._groups = ParamGroups(self, params, defaults)

    @property
    def param_groups(self) -> list:
        return self._torch("param_groups").param_groups

    @property
    def state(self) -> dict:
        return self._torch("state").state

    @property
    def defaults(self) -> dict:
        return self._torch("defaults").defaults

    def _torch(self, what: str):
        if self._groups is None:
            raise KilnArgumentError(
                f"{type(self).__name__}.{what}: this optimizer was built without parameters "
                "(the functional form); build it as torch does to use it: "
                f"{type(self).__name__}(model.parameters(), lr=...)")
        return self._groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear `.grad` of every parameter (torch.optim.Optimizer.zero_grad)."""
        self._torch("zero_grad").zero_grad(set_to_none)

    def add_param_group(self, group: dict) -> None:
        self._torch("add_param_group").add_param_group(group)

    def state_dict(self) -> dict:
        return self._torch("state_dict").state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._torch("load_state_dict").load_state_dict(state_dict)

    @abc.abstractmethod
    def init(self, params) -> dict:
        """The optimizer state for `params` (step count 0)."""

    @abc.abstractmethod
    def update(self, grads, state, params):
        """(new params, new state) after one step: pure, traceable kiln ops."""

    def step(self, *args, **kwargs):
        """torch's `opt.step()` / `opt.step(closure)` for an optimizer built with
        parameters (reads each `.grad`, updates in place, returns the closure's loss);
        kiln's `opt.step(module, grads)` for a functional one (see `step_module`)."""
        if self._groups is not None and (not args or callable(args[0])) and \
                set(kwargs) <= {"closure"}:
            from kiln.optim.stateful import run_closure

            loss = run_closure(args[0] if args else kwargs.get("closure"))
            self._groups.step()
            return loss
        return self.step_module(*args, **kwargs)

    def step_module(self, module, grads: dict) -> None:
        """One eager update of `module`'s parameters from `grads` (dotted name -> tensor,
        e.g. `kn.grad` of a loss of `dict(module.named_parameters())`). The optimizer
        keeps the state for each module it has stepped; parameters absent from `grads`
        are left alone (the set of names must stay the same from step to step)."""
        if not isinstance(grads, dict):
            raise KilnArgumentError(f"{type(self).__name__}.step: grads must be a dict of "
                                    f"parameter name -> tensor, got {type(grads).__name__}")
        named = dict(module.named_parameters())
        unknown = [k for k in grads if k not in named]
        if unknown:
            raise KilnArgumentError(f"{type(self).__name__}.step: {type(module).__name__} has no "
                                    f"parameter(s) {unknown}",
                                    hint=f"its parameters are {list(named)}")
        params = {k: named[k] for k in named if k in grads}
        entry = self._states.get(module)
        if entry is None:
            entry = (tuple(params), self.init(params))
        elif entry[0] != tuple(params):
            raise KilnArgumentError(
                f"{type(self).__name__}.step: this step updates {list(params)} but the state "
                f"was made for {list(entry[0])}",
                hint="pass gradients for the same parameters every step, or use a new optimizer")
        new_params, new_state = self.update(grads, entry[1], params)
        self._states[module] = (entry[0], new_state)
        module._set_tensors(new_params)

    def state_of(self, module):
        """The state `step` keeps for `module` (None before its first step)."""
        entry = self._states.get(module)
        return None if entry is None else entry[1]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({fields})"

    def hyperparameters(self) -> dict:
        return {}


def zeros_tree(leaves: list, spec):
    from kiln.frontend.factories import zeros_like

    return pytree.unflatten(spec, [zeros_like(p) for p in leaves])


def new_step():
    from kiln.frontend.factories import zeros

    return zeros((), dtype=dt.int64)


def tree_leaves(tree, spec, op: str, name: str) -> list:
    leaves, got = leaves_of(tree)
    if got != spec:
        raise KilnArgumentError(f"{op}: the state's {name!r} does not have the structure of the "
                                "params; was the state made by init() for these params?")
    return leaves


def scalar(value, dtype):
    """A Python number stays (weakly typed); a tensor (a schedule's value) is converted."""
    if isinstance(value, Tensor):
        from kiln.frontend.functional import to

        return to(value, dtype)
    return value


