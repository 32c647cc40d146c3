"""SGD with momentum, Nesterov momentum, dampening and weight decay, as torch.optim.SGD."""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.frontend import pytree
from kiln.optim.leaf_replay import map_leaves
from kiln.optim.stateful import is_params_argument
from kiln.optim.optimizer import (
    Optimizer, align, check_lr, learning_rate, leaves_of, new_step, scalar, step_count,
    tree_leaves, zeros_tree,
)


class SGD(Optimizer):
    """Stochastic gradient descent (torch.optim.SGD's update, functional):

        g = grad + weight_decay * param
        buf = g at the first step, then momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf          (when momentum != 0)
        param = param - lr * g

    >>> opt = optim.SGD(lr=0.1, momentum=0.9)
    >>> state = opt.init(params)
    >>> params, state = opt.update(grads, state, params)
    """

    def __init__(self, params=None, lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, dampening: float = 0.0,
                 maximize: bool = False, *, foreach=None, fused=None,
                 differentiable: bool = False) -> None:
        super().__init__()
        if not is_params_argument(params):  # kiln's functional form: SGD(lr) or SGD(lr=...)
            params, lr = None, (lr if params is None else params)
        check_lr("SGD", lr)
        if momentum < 0 or weight_decay < 0:
            raise KilnArgumentError(f"SGD: momentum ({momentum}) and weight_decay ({weight_decay}) "
                                    "must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise KilnArgumentError("SGD: nesterov momentum needs momentum > 0 and dampening 0")
        self.lr, self.momentum, self.weight_decay = lr, float(momentum), float(weight_decay)
        self.nesterov, self.dampening, self.maximize = bool(nesterov), float(dampening), bool(maximize)
        self._attach(params, dict(self.hyperparameters(), maximize=self.maximize))

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": self.nesterov, "dampening": self.dampening}

    def init(self, params) -> dict:
        """{"step": 0, "momentum_buffer": zeros like params} (no buffer without momentum)."""
        leaves, spec = leaves_of(params)
        state = {"step": new_step()}
        if self.momentum:
            state["momentum_buffer"] = zeros_tree(leaves, spec)
        return state

    def update(self, grads, state, params):
        """(new_params, new_state): one SGD step, pure (traces and compiles)."""
        from kiln.frontend.functional import eq, to, where

        p_leaves, g_leaves, spec = align("SGD.update", params, grads)
        step = step_count(state, "SGD.update")
        lr = learning_rate(self.lr, step)
        bufs = tree_leaves(state["momentum_buffer"], spec, "SGD.update", "momentum_buffer") \
            if self.momentum else [None] * len(p_leaves)

        def leaf(p, g, buf):
            g = to(g, p.dtype)
            if self.maximize:
                g = -g
            if self.weight_decay:
                g = g + p * self.weight_decay
            if self.momentum:
                if self.dampening:  # the first step takes the gradient undamped, as torch
                    coef = to(where(eq(step, 0), 1.0, 1.0 - self.dampening), p.dtype)
                    buf = buf * self.momentum + g * coef
                else:
                    buf = buf * self.momentum + g
                g = g + buf * self.momentum if self.nesterov else buf
            return p - g * scalar(lr, p.dtype), buf

        # traced: each (dtype, shape) of parameter traced once, its nodes replayed
        done = map_leaves(leaf, list(zip(p_leaves, g_leaves, bufs)))
        new_p, new_b = [p for p, _ in done], [b for _, b in done]
        new_state = {"step": step + 1}
        if self.momentum:
            new_state["momentum_buffer"] = pytree.unflatten(spec, new_b)
        return pytree.unflatten(spec, new_p), new_state

