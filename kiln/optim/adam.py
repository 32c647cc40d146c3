"""Adam and AdamW, as torch.optim.Adam / AdamW, functional.

The bias corrections `1 - beta ** t` are computed from the step count *tensor* (in
float64, as torch computes them in Python floats), so a compiled training step never
bakes the step in and one program serves every step.
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.frontend import pytree
from kiln.optim.leaf_replay import map_leaves
from kiln.optim.stateful import is_params_argument
from kiln.optim.optimizer import (
    Optimizer, align, check_lr, learning_rate, leaves_of, new_step, scalar, step_count,
    tree_leaves, zeros_tree,
)


class Adam(Optimizer):
    """Adam (Kingma & Ba) with torch's update, functional. `weight_decay` here is L2
    added to the gradient (torch.optim.Adam); `AdamW` decouples it.

        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        param -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    `amsgrad=True` divides by the running maximum of v instead.
    """

    decoupled = False

    def __init__(self, params=None, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 maximize: bool = False, *, foreach=None, fused=None,
                 capturable: bool = False, differentiable: bool = False) -> None:
        super().__init__()
        if not is_params_argument(params):  # kiln's functional form: Adam(lr) or Adam(lr=...)
            params, lr = None, (lr if params is None else params)
        name = type(self).__name__
        check_lr(name, lr)
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise KilnArgumentError(f"{name}: betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise KilnArgumentError(f"{name}: eps ({eps}) and weight_decay ({weight_decay}) must "
                                    "be >= 0")
        self.lr, self.betas = lr, (float(beta1), float(beta2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.amsgrad, self.maximize = bool(amsgrad), bool(maximize)
        self._attach(params, dict(self.hyperparameters(), maximize=self.maximize))

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay, "amsgrad": self.amsgrad}

    def init(self, params) -> dict:
        """{"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros[, "max_exp_avg_sq": zeros]}."""
        leaves, spec = leaves_of(params)
        state = {"step": new_step(), "exp_avg": zeros_tree(leaves, spec),
                 "exp_avg_sq": zeros_tree(leaves, spec)}
        if self.amsgrad:
            state["max_exp_avg_sq"] = zeros_tree(leaves, spec)
        return state

    def update(self, grads, state, params):
        """(new_params, new_state): one step, pure (traces and compiles)."""
        from kiln.frontend.functional import maximum, sqrt, to

        op = f"{type(self).__name__}.update"
        p_leaves, g_leaves, spec = align(op, params, grads)
        step = step_count(state, op)
        lr = learning_rate(self.lr, step)
        ms = tree_leaves(state["exp_avg"], spec, op, "exp_avg")
        vs = tree_leaves(state["exp_avg_sq"], spec, op, "exp_avg_sq")
        vmaxes = tree_leaves(state["max_exp_avg_sq"], spec, op, "max_exp_avg_sq") \
            if self.amsgrad else [None] * len(p_leaves)
        beta1, beta2 = self.betas
        t = to(step + 1, dt.float64)
        bias1 = 1.0 - beta1 ** t
        bias2_sqrt = sqrt(1.0 - beta2 ** t)
        step_size = scalar(lr, dt.float64) / bias1

        def leaf(p, g, m, v, vmax):
            g = to(g, p.dtype)
            if self.maximize:
                g = -g
            if self.weight_decay:
                if self.decoupled:
                    p = p * (1.0 - scalar(lr, p.dtype) * self.weight_decay)
                else:
                    g = g + p * self.weight_decay
            m = m + (g - m) * (1.0 - beta1)  # torch's lerp
            v = v * beta2 + g * g * (1.0 - beta2)
            if self.amsgrad:
                vmax = maximum(vmax, v)
            denom = sqrt(vmax if self.amsgrad else v) / to(bias2_sqrt, p.dtype) + self.eps
            return p - to(step_size, p.dtype) * m / denom, m, v, vmax

        # traced: each (dtype, shape) of parameter traced once, its nodes replayed
        done = map_leaves(leaf, list(zip(p_leaves, g_leaves, ms, vs, vmaxes)))
        new_p, new_m, new_v, new_vmax = (list(column) for column in zip(*done)) if done \
            else ([], [], [], [])
        new_state = {"step": step + 1, "exp_avg": pytree.unflatten(spec, new_m),
                     "exp_avg_sq": pytree.unflatten(spec, new_v)}
        if self.amsgrad:
            new_state["max_exp_avg_sq"] = pytree.unflatten(spec, new_vmax)
        return pytree.unflatten(spec, new_p), new_state


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), torch.optim.AdamW's
    update: `param *= 1 - lr * weight_decay` before the Adam step.

    >>> opt = optim.AdamW(lr=1e-3, weight_decay=1e-2)
    >>> state = opt.init(params)
    >>> params, state = opt.update(grads, state, params)
    """

    decoupled = True

    def __init__(self, params=None, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False,
                 maximize: bool = False, *, foreach=None, fused=None,
                 capturable: bool = False, differentiable: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize)
