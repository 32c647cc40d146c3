"""torch.optim's stateful interface over kiln's functional update kernels.

`optim.AdamW(model.parameters(), lr=1e-3)` (or a list of parameter-group dicts, each
with its own `lr`, `weight_decay`, `betas`, ...) keeps `param_groups` and a per-parameter
`state`, as torch does. `opt.step()` reads each parameter's `.grad` (filled by
`loss.backward()`), runs the same pure `update` that the functional API uses — one
parameter at a time, so every parameter keeps its own step count as in torch — and
writes the new value into the parameter in place (the handle is rebound, see
kiln/frontend/mutation.py), so the model, tied weights and the optimizer all see it.

    >>> opt = optim.AdamW([{"params": decay, "weight_decay": 0.1},
    ...                    {"params": no_decay, "weight_decay": 0.0}], lr=6e-4)
    >>> loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.errors import KilnArgumentError
from kiln.frontend.tensor import Tensor


def is_params_argument(value) -> bool:
    """Whether the first argument is torch's `params` (tensors or group dicts) rather
    than kiln's functional `lr` (a number or a schedule)."""
    if value is None or isinstance(value, (int, float)) or callable(value) and not \
            isinstance(value, (list, tuple)) and not hasattr(value, "__next__"):
        return False
    return True


class ParamGroups:
    """The torch-style state of an optimizer: groups, per-parameter state, and step."""

    def __init__(self, owner, params, defaults: dict) -> None:
        self.owner = owner
        self.defaults = dict(defaults)
        groups = list(params)
        if not groups:
            raise KilnArgumentError(f"{type(owner).__name__}: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups: list[dict] = []
        self.state: dict = {}
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group: dict) -> None:
        name = type(self.owner).__name__
        if not isinstance(group, dict) or "params" not in group:
            raise KilnArgumentError(f"{name}: a parameter group is a dict with a 'params' list")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if not isinstance(p, Tensor) or p.is_traced:
                raise KilnArgumentError(f"{name}: parameters must be concrete kn.Tensors, got "
                                        f"{type(p).__name__}")
            if not p.dtype.is_floating:
                raise KilnArgumentError(f"{name}: cannot optimize a {p.dtype} tensor")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params):
            raise KilnArgumentError(f"{name}: a parameter appears in more than one group")
        unknown = set(group) - set(self.defaults) - {"params", "initial_lr"}
        if unknown:
            raise KilnArgumentError(f"{name}: unknown group option(s) {sorted(unknown)}; the "
                                    f"options are {sorted(self.defaults)}")
        full = dict(self.defaults)
        full.update(group)
        full["params"] = params
        type(self.owner)(**{k: v for k, v in full.items() if k in self.defaults})  # validates
        self.param_groups.append(full)

    def step(self) -> None:
        """One update of every parameter with a `.grad`. The state is created concrete
        and then updated in place, and each group's lr is a tensor the optimizer declares,
        so a `kn.compile`d step lifts all of it into inputs (kiln/frontend/functionalize.py)."""
        from kiln.frontend.functionalize import outside_trace
        from kiln.frontend.mutation import rebind
        from kiln.frontend.tape import no_grad

        name = f"{type(self.owner).__name__}.step"
        with no_grad():
            if self._fused_step(name):
                return
            for i, group in enumerate(self.param_groups):
                kernel = type(self.owner)(**{k: group[k] for k in self.defaults})
                if not callable(group["lr"]):
                    kernel.lr = self._lr_tensor(i)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state.get(p)
                    if state is None:
                        with outside_trace():
                            state = _from_functional(kernel.init([p]))
                        self.state[p] = state
                    (new_p,), new_state = kernel.update([p.grad], _to_functional(state), [p])
                    for key, value in _from_functional(new_state).items():
                        rebind(state[key], value, name)
                    rebind(p, new_p, name)

    def _fused_step(self, name: str) -> bool:
        """Eager mode: every parameter's update in ONE compiled program (the multi-tensor
        kernel of `batch_updates`), not a few numpy ops per parameter. The same pure
        `update` per parameter is traced, each group's lr is an input (so changing it
        never recompiles), and the program is kept per group options and layout. False
        (the caller then updates parameter by parameter) inside a trace, for fewer than
        two parameters, a schedule given as a function, complex parameters or tensors on
        a device other than the CPU (kn.compile's default backend)."""
        from kiln.frontend.dispatch import current_builder
        from kiln.frontend.functionalize import active_tracker
        from kiln.frontend.mutation import rebind

        if current_builder() is not None or active_tracker() is not None:
            return False
        entries = [(i, p) for i, g in enumerate(self.param_groups) for p in g["params"]
                   if p.grad is not None]
        if len(entries) < 2 or any(callable(g["lr"]) for g in self.param_groups) or any(
                p._builder is not None or p.grad._builder is not None or p.dtype.is_complex
                or p.device.type != "cpu" or p.grad.device.type != "cpu" for _, p in entries):
            return False  # traced, complex or on another device: parameter by parameter
        for i, p in entries:
            if p not in self.state:
                self.state[p] = _from_functional(self._kernel(i).init([p]))
        options = tuple(tuple((k, repr(g[k])) for k in sorted(self.defaults) if k != "lr")
                        for g in self.param_groups)
        key = (options, tuple(i for i, _ in entries),
               tuple(tuple(sorted(self.state[p])) for _, p in entries))
        cache = self.__dict__.setdefault("_fused", {})
        program = cache.get(key)
        if program is None:
            from kiln.frontend.compile import compile as compile_program

            groups = [i for i, _ in entries]
            kernels = {i: self._kernel(i) for i in set(groups)}

            def update(lrs, params, grads, states):
                new_params, new_states = [], []
                for i, p, g, st in zip(groups, params, grads, states):
                    kernels[i].lr = lrs[i]
                    (new_p,), new_st = kernels[i].update([g], _to_functional(st), [p])
                    new_params.append(new_p)
                    new_states.append(_from_functional(new_st))
                return new_params, new_states

            program = cache[key] = compile_program(update)
        lrs = [Tensor._make(np.array(float(g["lr"]), np.float64)) for g in self.param_groups]
        params = [p for _, p in entries]
        new_params, new_states = program(lrs, params, [p.grad for p in params],
                                         [self.state[p] for p in params])
        for p, new_p, new_st in zip(params, new_params, new_states):
            for k, value in new_st.items():
                rebind(self.state[p][k], value, name)
            rebind(p, new_p, name)
        return True

    def _kernel(self, i: int):
        """The functional optimizer of group i (its options; lr set by the caller)."""
        group = self.param_groups[i]
        return type(self.owner)(**{k: group[k] for k in self.defaults})

    def _lr_tensor(self, i: int):
        """Group i's learning rate as a float64 scalar tensor (data, not a constant)."""
        import numpy as np

        from kiln.frontend.functionalize import declare_state

        lrs = self.__dict__.setdefault("_lrs", {})
        t = lrs.get(i)
        if t is None:
            t = lrs[i] = Tensor._make(np.array(float(self.param_groups[i]["lr"]), np.float64))
        self._sync_lrs()
        declare_state(t, self._sync_lrs)
        return t

    def _sync_lrs(self) -> None:
        import numpy as np

        for i, t in self.__dict__.get("_lrs", {}).items():
            lr = self.param_groups[i]["lr"] if i < len(self.param_groups) else None
            if t._builder is None and isinstance(lr, (int, float)) and float(t._x) != lr:
                t._x = np.array(float(lr), np.float64)

    def zero_grad(self, set_to_none: bool = True) -> None:
        from kiln.frontend.factories import zeros_like

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None if set_to_none else zeros_like(p.grad)

    def state_dict(self) -> dict:
        """{"state": {index: {name: tensor}}, "param_groups": [{options, "params": [index]}]}
        with parameters numbered across groups in order, as torch's."""
        index, groups = {}, []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        name = type(self.owner).__name__
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise KilnArgumentError(f"{name}.load_state_dict: the state dict has "
                                    f"{len(groups) if isinstance(groups, list) else 'no'} "
                                    f"parameter groups, the optimizer {len(self.param_groups)}")
        by_index = {}
        for saved, group in zip(groups, self.param_groups):
            if len(saved.get("params", ())) != len(group["params"]):
                raise KilnArgumentError(f"{name}.load_state_dict: a group's parameter count "
                                        "differs from the optimizer's")
            for i, p in zip(saved["params"], group["params"]):
                by_index[i] = p
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state = {}
        for i, s in state_dict.get("state", {}).items():
            p = by_index.get(int(i))
            if p is None:
                raise KilnArgumentError(f"{name}.load_state_dict: state for unknown parameter {i}")
            # copies, as torch's load_state_dict deep-copies: the state is updated in place
            self.state[p] = {k: Tensor(v.numpy() if isinstance(v, Tensor) else v)
                             for k, v in s.items()}


def _to_functional(state: dict) -> dict:
    """Per-parameter torch-style state -> the functional state of a one-leaf list."""
    return {k: (v if k == "step" else [v]) for k, v in state.items()}


def _from_functional(state: dict) -> dict:
    return {k: (v if k == "step" else v[0]) for k, v in state.items()}


def run_closure(closure: Callable | None) -> Any:
    if closure is None:
        return None
    from kiln.frontend.tape import enable_grad

    with enable_grad():
        return closure()
