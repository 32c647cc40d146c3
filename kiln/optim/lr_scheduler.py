"""Learning-rate schedulers with torch.optim.lr_scheduler's names and arithmetic.

A scheduler wraps an optimizer built with parameters (`optim.AdamW(model.parameters(),
...)`) and sets each group's `lr` when `scheduler.step()` is called, once per epoch or
step as in torch. The formulas are torch's own — the recursive (chainable) forms where
torch uses them — so learning rates agree with torch step for step.

    >>> sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    >>> opt.step(); sched.step()

For a compiled training step, pass the value as data (`lr` as a tensor argument) or use
the functional optimizers' schedule functions; a changed Python float `lr` is a new
constant and compiles a new specialization.
"""

from __future__ import annotations

import abc
import math
from typing import Callable

from kiln.errors import KilnArgumentError


class LRScheduler(abc.ABC):
    """Base class: subclasses give `get_lr()` from `self.last_epoch` (torch's protocol)."""

    def __init__(self, optimizer, last_epoch: int = -1) -> None:
        groups = optimizer.param_groups  # raises for a functional optimizer
        self.optimizer = optimizer
        for g in groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs = [g["initial_lr"] for g in groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self.step()

    @abc.abstractmethod
    def get_lr(self) -> list:
        """The learning rates for `self.last_epoch`, one per parameter group."""

    def step(self, epoch=None) -> None:
        if epoch is not None:
            raise KilnArgumentError(f"{type(self).__name__}.step: the epoch argument is "
                                    "deprecated in torch and not supported; call step() once "
                                    "per epoch")
        self._step_count += 1
        self.last_epoch += 1
        for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer" and not callable(v)}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def _groups(s) -> list:
    return s.optimizer.param_groups


class LambdaLR(LRScheduler):
    """lr = initial_lr * lr_lambda(epoch) (one function, or one per group)."""

    def __init__(self, optimizer, lr_lambda: Callable | list, last_epoch: int = -1) -> None:
        n = len(optimizer.param_groups)
        self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n
        if len(self.lr_lambdas) != n:
            raise KilnArgumentError(f"LambdaLR: {len(self.lr_lambdas)} lambdas for {n} groups")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list:
        return [base * f(self.last_epoch) for f, base in zip(self.lr_lambdas, self.base_lrs)]


class StepLR(LRScheduler):
    """lr *= gamma every `step_size` epochs."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        if step_size <= 0:
            raise KilnArgumentError(f"StepLR: step_size must be positive, got {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [g["lr"] for g in _groups(self)]
        return [g["lr"] * self.gamma for g in _groups(self)]


class LinearLR(LRScheduler):
    """The factor goes linearly from start_factor to end_factor over total_iters."""

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1) -> None:
        if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
            raise KilnArgumentError("LinearLR: start_factor must be in (0, 1] and end_factor "
                                    "in [0, 1]")
        self.start_factor, self.end_factor = float(start_factor), float(end_factor)
        self.total_iters = int(total_iters)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list:
        if self.last_epoch == 0:
            return [g["lr"] * self.start_factor for g in _groups(self)]
        if self.last_epoch > self.total_iters:
            return [g["lr"] for g in _groups(self)]
        ratio = 1.0 + (self.end_factor - self.start_factor) / (
            self.total_iters * self.start_factor
            + (self.last_epoch - 1) * (self.end_factor - self.start_factor))
        return [g["lr"] * ratio for g in _groups(self)]


class CosineAnnealingLR(LRScheduler):
    """Cosine from the initial lr down to eta_min over T_max epochs (torch's recursion)."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max, self.eta_min = int(T_max), float(eta_min)
        if self.T_max <= 0:
            raise KilnArgumentError(f"CosineAnnealingLR: T_max must be positive, got {T_max}")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list:
        e, T, lo = self.last_epoch, self.T_max, self.eta_min
        groups = _groups(self)
        if e == 0:
            return [g["lr"] for g in groups]
        if self._step_count == 1 and e > 0:
            return [lo + (base - lo) * (1 + math.cos(e * math.pi / T)) / 2 for base in self.base_lrs]
        if (e - 1 - T) % (2 * T) == 0:
            return [g["lr"] + (base - lo) * (1 - math.cos(math.pi / T)) / 2
                    for base, g in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * e / T)) / (1 + math.cos(math.pi * (e - 1) / T))
                * (g["lr"] - lo) + lo for g in groups]


class OneCycleLR(LRScheduler):
    """The 1cycle policy: warm up to max_lr, then anneal (cosine or linear), as torch."""

    def __init__(self, optimizer, max_lr, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1, **_) -> None:
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise KilnArgumentError("OneCycleLR: give total_steps, or epochs and steps_per_epoch")
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0 or anneal_strategy not in ("cos", "linear"):
            raise KilnArgumentError("OneCycleLR: total_steps must be positive and "
                                    "anneal_strategy 'cos' or 'linear'")
        self.total_steps = int(total_steps)
        n = len(optimizer.param_groups)
        max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * n
        for g, m in zip(optimizer.param_groups, max_lrs):
            g["initial_lr"] = m / div_factor
            g["max_lr"] = m
            g["min_lr"] = g["initial_lr"] / final_div_factor
        ends = ([float(pct_start * total_steps) - 1, float(2 * pct_start * total_steps) - 2,
                 total_steps - 1.0] if three_phase else
                [float(pct_start * total_steps) - 1, total_steps - 1.0])
        keys = ([("initial_lr", "max_lr"), ("max_lr", "initial_lr"), ("initial_lr", "min_lr")]
                if three_phase else [("initial_lr", "max_lr"), ("max_lr", "min_lr")])
        self._phases = list(zip(ends, keys))
        self._cos = anneal_strategy == "cos"
        super().__init__(optimizer, last_epoch)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self._cos:
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> list:
        step = self.last_epoch
        if step >= self.total_steps:
            raise KilnArgumentError(f"OneCycleLR: stepped {step + 1} times with total_steps="
                                    f"{self.total_steps}")
        lrs = []
        for g in _groups(self):
            start_step = 0.0
            for i, (end, (a, b)) in enumerate(self._phases):
                if step <= end or i == len(self._phases) - 1:
                    lrs.append(self._anneal(g[a], g[b], (step - start_step) / (end - start_step)))
                    break
                start_step = end
        return lrs


class SequentialLR(LRScheduler):
    """Run `schedulers[i]` until `milestones[i]`, then the next one (torch's semantics)."""

    def __init__(self, optimizer, schedulers: list, milestones: list, last_epoch: int = -1) -> None:
        if len(milestones) != len(schedulers) - 1:
            raise KilnArgumentError(f"SequentialLR: {len(schedulers)} schedulers need "
                                    f"{len(schedulers) - 1} milestones, got {len(milestones)}")
        self.optimizer, self._schedulers, self._milestones = optimizer, list(schedulers), list(milestones)
        self.last_epoch = last_epoch + 1
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]
        for s in self._schedulers[::-1]:  # undo the constructors' initial steps
            s.last_epoch -= 1
        self._schedulers[0]._step_count = 0
        self._schedulers[0].step()
        self._last_lr = self._schedulers[0].get_last_lr()

    def step(self, epoch=None) -> None:
        import bisect

        self.last_epoch += 1
        idx = bisect.bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            # torch's scheduler.step(0): the closed form at epoch 0, from the base lrs
            for g, base in zip(self.optimizer.param_groups, scheduler.base_lrs):
                g["lr"] = base
            scheduler.last_epoch = -1
            scheduler._step_count = 0
            scheduler.step()
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def get_lr(self) -> list:
        """The rates the scheduler in charge at `last_epoch` set."""
        return list(self._last_lr)
