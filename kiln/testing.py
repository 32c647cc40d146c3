"""Gradient checking against central finite differences (float64), for tests and for
users who write their own vjp rules.

- `check_vjp_rule(op, inputs, attrs)` runs one op's registered vjp rule eagerly (on the
  `EagerEmitter`, so no graph is built) and compares it with finite differences of the
  op's numpy reference.
- `check_grads(fn, *args)` checks `kn.vjp` of a whole function the same way, through
  the autodiff graph transformation.

Both compare directional derivatives: for random directions v and cotangents c,
<vjp(c), v> must equal (<c, f(x + eps v)> - <c, f(x - eps v)>) / 2 eps. That checks every
entry of the gradient at a cost of two evaluations per direction; for small inputs
every coordinate direction is checked as well.

    >>> check_vjp_rule("tanh", [np.linspace(-2, 2, 5)])
    >>> check_grads(lambda x: (x.sin() * x).sum(), kn.randn(3, 4, dtype=kn.float64))
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir import registry
from kiln.ir.emitter import EAGER


class GradientMismatch(AssertionError):
    """The analytical gradient disagrees with finite differences."""


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind in "fc" and a.dtype.itemsize >= 4


def _random(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    x = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def _directions(x: np.ndarray, rng: np.random.Generator, count: int, coordinates: int):
    # complex inputs are also moved along i*v: that checks the imaginary part of the
    # cotangent (PyTorch's convention: dL/dRe + i dL/dIm)
    phases = (1, 1j) if x.dtype.kind == "c" else (1,)
    for _ in range(count):
        for phase in phases:
            yield (phase * rng.standard_normal(x.shape)).astype(x.dtype)
    if x.size <= coordinates:
        for j in range(x.size):
            for phase in phases:
                e = np.zeros(x.size, x.dtype)
                e[j] = phase
                yield e.reshape(x.shape)


def _compare(what: str, analytic: float, numeric: float, rtol: float, atol: float) -> None:
    if not np.isclose(analytic, numeric, rtol=rtol, atol=atol):
        raise GradientMismatch(f"{what}: gradient gives {analytic!r}, finite differences "
                               f"{numeric!r} (rtol {rtol}, atol {atol})")


def check_vjp_rule(op: str, inputs: Sequence[np.ndarray], attrs: dict | None = None, *,
                   wrt: Sequence[int] | None = None, eps: float = 1e-6, rtol: float = 1e-5,
                   atol: float = 1e-7, seed: int = 0, directions: int = 3,
                   coordinates: int = 16) -> list:
    """Check `op`'s vjp rule at `inputs` (float64 arrays for tight tolerances).

    Returns the rule's cotangents. Raises `GradientMismatch` on disagreement, and
    AssertionError when a cotangent's dtype or shape is not its operand's.
    """
    opdef = registry.get(op)
    if opdef.vjp is None:
        raise KilnError(f"{op} has no vjp rule")
    attrs = opdef.normalize_attrs(dict(attrs or {}))
    inputs = [np.asarray(x) for x in inputs]
    results = EAGER.apply(op, inputs, attrs)
    rng = np.random.default_rng(seed)
    cts = [_random(rng, r.shape, r.dtype) if _is_float(r) else None for r in results]
    grads = opdef.vjp(EAGER, cts, list(inputs), list(results), **attrs)
    if len(grads) != len(inputs):
        raise AssertionError(f"{op}: vjp returned {len(grads)} cotangents for "
                             f"{len(inputs)} operands")
    wrt = [i for i, x in enumerate(inputs) if _is_float(x)] if wrt is None else list(wrt)

    def objective(xs) -> float:
        ys = EAGER.apply(op, xs, attrs)
        return float(sum(np.vdot(c, y).real for c, y in zip(cts, ys) if c is not None))

    for i in wrt:
        g = grads[i]
        if g is None:
            raise AssertionError(f"{op}: vjp gives no cotangent for operand {i}")
        g = np.asarray(g)
        if g.dtype != inputs[i].dtype or g.shape != inputs[i].shape:
            raise AssertionError(f"{op}: cotangent {i} is {g.dtype}{list(g.shape)}, operand is "
                                 f"{inputs[i].dtype}{list(inputs[i].shape)}")
        for k, v in enumerate(_directions(inputs[i], rng, directions, coordinates)):
            plus = list(inputs)
            minus = list(inputs)
            plus[i] = inputs[i] + eps * v
            minus[i] = inputs[i] - eps * v
            numeric = (objective(plus) - objective(minus)) / (2 * eps)
            _compare(f"{op} operand {i} direction {k}", float(np.vdot(v, g).real), numeric,
                     rtol, atol)
    return grads


def check_grads(fn: Callable, *args, argnums=0, eps: float = 1e-6, rtol: float = 1e-5,
                atol: float = 1e-7, seed: int = 0, directions: int = 3,
                coordinates: int = 16) -> None:
    """Check `vjp(fn, *args)` against finite differences for the tensors in `argnums`.

    `fn` returns a tensor or a pytree of tensors; `args` should be float64 tensors.
    """
    from kiln.frontend import pytree
    from kiln.frontend.autodiff import vjp
    from kiln.frontend.factories import asarray
    from kiln.frontend.tensor import Tensor

    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    args = tuple(asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    out, pullback = vjp(fn, *args)
    leaf = lambda x: isinstance(x, Tensor)  # noqa: E731
    out_leaves, out_spec = pytree.flatten(out, leaf)
    rng = np.random.default_rng(seed)
    cts = [rng.standard_normal(o.shape).astype(o.numpy().dtype) for o in out_leaves]
    grads = pullback(pytree.unflatten(out_spec, [asarray(c) for c in cts]))

    def objective(values) -> float:
        ys = pytree.flatten(fn(*values), leaf)[0]
        return float(sum(np.vdot(c, y.numpy()) for c, y in zip(cts, ys)))

    for n in argnums:
        g_leaves = pytree.flatten(grads[n], leaf)[0]
        x_leaves, x_spec = pytree.flatten(args[n], leaf)
        for j, (x, g) in enumerate(zip(x_leaves, g_leaves)):
            x, g = x.numpy(), g.numpy()
            for k, v in enumerate(_directions(x, rng, directions, coordinates)):
                values = []
                for sign in (1, -1):
                    leaves = list(x_leaves)
                    leaves[j] = asarray(x + sign * eps * v)
                    new = list(args)
                    new[n] = pytree.unflatten(x_spec, leaves)
                    values.append(objective(new))
                numeric = (values[0] - values[1]) / (2 * eps)
                _compare(f"argument {n} leaf {j} direction {k}", float(np.vdot(v, g)), numeric,
                         rtol, atol)
