"""A compiled function that changes its own arguments in place: written back after the call.

`kn.compile(lambda x: x.add_(1))` traces `x.add_(1)` as a pure `add` that rebinds the
traced handle of `x` (kiln/frontend/mutation.py); the caller's tensor would never see
it. torch.compile's functionalization returns every mutated input as an extra graph
output and copies it back into the input after the call ("input mutations"); kiln does
the same:

- the traced function is wrapped: after it returns, every argument handle that now holds
  a different graph value (`x.add_`, `x[mask] = v`, in place on a view of `x`, inside a
  `kn.cond`/`kn.while_loop` branch) is appended to the graph's results, and the
  specialization remembers which argument each extra result belongs to;
- after each call the new values are written back into the caller's objects: a
  kn.Tensor is rebound (so views of it, module attributes and lists see the write, as
  after an eager call), a numpy array is overwritten in place;
- a returned argument handle (`return x.add_(1)`, `return x`) is the caller's own tensor
  object, as in torch, not a copy;
- the same tensor object passed twice (`f(x, x)`) is one handle inside the trace (a
  write through one name is seen through the other) and the aliasing pattern is part
  of the cache key, so `f(x, y)` and `f(x, x)` are different specializations.

`kn.export` of a function that mutates an argument refuses with K450 naming it: an
exported program is a pure function of its inputs (its `.kir` signature has no way to
say "this input is updated"); return the new value instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kiln.errors import KilnError
from kiln.frontend import pytree
from kiln.frontend.tensor import Tensor
from kiln.frontend.tracing import _leaf


class KilnExportMutationError(KilnError):
    code = "K450"
    title = "an exported function mutates an argument"


class KilnWriteBackError(KilnError):
    code = "K451"
    title = "a compiled function's argument cannot take its new value"


@dataclass
class WriteBack:
    """What one specialization writes back: `mutated` leaf positions (their new values are
    the graph results after the first `user_outputs`), and `returned` user output index ->
    the argument leaf that output is."""

    user_outputs: int = 0
    out_spec: object = None
    mutated: tuple = ()
    returned: dict = field(default_factory=dict)

    @property
    def trivial(self) -> bool:
        return not self.mutated and not self.returned


def aliases(leaves) -> tuple:
    """(position, first position) of every tensor leaf that is the same object as an
    earlier one; () in the common case."""
    seen: dict = {}
    out: tuple = ()
    for i, leaf in enumerate(leaves):
        if leaf.__class__ is Tensor or leaf.__class__ is np.ndarray or isinstance(leaf, Tensor):
            j = seen.setdefault(id(leaf), i)
            if j != i:
                out += ((i, j),)
    return out


def tracing_wrapper(fn: Callable, alias_pairs: tuple, plan: WriteBack) -> Callable:
    """`fn` for tracing: aliased arguments share one handle; mutated argument handles are
    returned after fn's own result, and `plan` records where everything went."""
    alias_of = dict(alias_pairs)

    @functools.wraps(fn)
    def traced(*args):
        leaves, spec = pytree.flatten(tuple(args), _leaf)
        for i, j in alias_of.items():
            leaves[i] = leaves[j]
        args = pytree.unflatten(spec, leaves)
        inputs = [(k, leaf, leaf._x) for k, leaf in enumerate(leaves)
                  if isinstance(leaf, Tensor) and leaf.is_traced and k not in alias_of]
        result = fn(*args)
        out_leaves, out_spec = pytree.flatten(result, _leaf)
        handles = {id(leaf): k for k, leaf, _ in inputs}
        plan.user_outputs, plan.out_spec = len(out_leaves), out_spec
        plan.returned = {i: handles[id(o)] for i, o in enumerate(out_leaves)
                         if isinstance(o, Tensor) and id(o) in handles}
        changed = [(k, leaf) for k, leaf, x in inputs if leaf._x is not x]
        plan.mutated = tuple(k for k, _ in changed)
        return result, tuple(leaf for _, leaf in changed)

    traced.__name__ = getattr(fn, "__name__", "main")  # the graph's name (a partial has none)
    return traced


def write_back(plan: WriteBack, leaves, outputs: list, paths: Callable[[], list],
               device=None) -> list:
    """Write the mutated arguments' new values into the caller's objects; returns the
    user's outputs (as kn.Tensors, a returned argument as the caller's own object).
    `device`: the device the program ran on (its results are tensors there)."""
    from kiln.frontend.mutation import rebind
    from kiln.frontend.tape import no_grad

    n = plan.user_outputs
    if plan.mutated:
        with no_grad():
            for k, new in zip(plan.mutated, outputs[n:]):
                target = leaves[k]
                if isinstance(target, Tensor):
                    rebind(target, Tensor._make(new, None, device), "compiled write-back")
                elif not target.flags.writeable:
                    raise KilnWriteBackError(
                        f"the compiled function changed its argument `{paths()[k]}` in place, "
                        "but that numpy array is read-only, so it cannot take its new value",
                        hint="pass a writable array (np.array(a)) or a kn.Tensor, or return the "
                             "new value instead of changing the argument")
                else:
                    np.copyto(target, new)
    made = [Tensor._make(o, None, device) for o in outputs[:n]]
    for i, k in plan.returned.items():
        if isinstance(leaves[k], Tensor):
            made[i] = leaves[k]
    return made


def trace_for_export(fn: Callable, args: tuple, dynamic_shapes):
    """kn.export's trace of `fn` on `args`; K450 when it changes one of them in place."""
    from kiln.frontend.recompiles import leaf_paths
    from kiln.frontend.tracing import trace_function

    plan = WriteBack()
    traced = trace_function(tracing_wrapper(fn, (), plan), tuple(args), dynamic_shapes)
    if plan.mutated:
        leaves, spec = pytree.flatten(tuple(args), _leaf)
        paths = leaf_paths(fn, spec, len(leaves))
        names = ", ".join(f"`{paths[k]}`" for k in plan.mutated)
        raise KilnExportMutationError(
            f"export: {getattr(fn, '__name__', 'the function')} changes its argument {names} in "
            "place; an exported (or kn.capture'd) program is a pure function of its inputs and "
            "cannot update them",
            hint="return the new value (`return out, x`) and assign it after the call, or use "
                 "kn.compile, which writes mutated arguments back")
    traced.out_spec = plan.out_spec
    return traced
