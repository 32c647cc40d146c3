"""`kn.compile(module)`: the module's forward, compiled, with its parameters and buffers
passed in as graph inputs on every call.

Because the weights are inputs and not constants, an optimizer step, `load_state_dict`
or any reassignment of a parameter takes effect on the next call without recompiling.
The guard of each specialization also holds the train/eval mode of every submodule, so
`model.eval()` compiles (once) a second program. Layers that draw randomness (Dropout
in training mode) get their key as an input too: a fresh one per call from kiln's
global stream, or, inside `with nn.rng(key):`, the same keys an eager call would draw.
"""

from __future__ import annotations

import inspect

from kiln.frontend.compile import compile
from kiln.frontend.tensor import Tensor
from kiln.nn import random
from kiln.nn.module import Module, functional_call

_OWN_ARGS = ("module_state", "module_modes", "rng_key", "forward_kwargs")


class CompiledModule:
    """What `kn.compile(module)` returns: call it like the module.

    >>> fast = kn.compile(model)
    >>> fast(x)                      # compiled on the first call
    >>> model.load_state_dict(sd)    # new weights: the same compiled program runs them
    >>> fast.stats()["compiles"]
    1
    """

    def __init__(self, module: Module, backend: str = "cpu", mode: str = "default",
                 fullgraph: bool = True, dynamic_shapes=None, recompile_limit: int = 8,
                 trace_dir: str | None = None, dynamic: bool | None = None,
                 explain: bool = False, strict: bool = False) -> None:
        self.__dict__["module"] = module
        forward = module.forward
        if dynamic_shapes is None:
            dynamic_shapes = getattr(forward, "__kiln_dynamic_spec__", None)
        if isinstance(dynamic_shapes, (list, tuple)):  # by position of forward's arguments
            dynamic_shapes = (None,) * len(_OWN_ARGS) + tuple(dynamic_shapes)

        def run(module_state, module_modes, rng_key, forward_kwargs, *args):
            """(forward's result, the state tensors forward changed in place, the number
            of random draws): mutation is functionalized, and __call__ writes it back."""
            before = {k: (v._x if isinstance(v, Tensor) else None) for k, v in module_state.items()}
            draws = 0
            if rng_key is None:
                out = functional_call(module, module_state, *args, **forward_kwargs)
            else:
                key, *start = rng_key  # (key,) or (key, the caller's stream position)
                with random.rng(key, start[0] if start else 0) as stream:
                    out = functional_call(module, module_state, *args, **forward_kwargs)
                draws = stream.draws  # how far the caller's stream moves
            changed = {k: v for k, v in module_state.items()
                       if isinstance(v, Tensor) and v._x is not before[k]}
            return out, changed, draws

        def grad_run(module_state, module_modes, rng_key, forward_kwargs, cotangents, *args):
            """The pullback of `run` (forward recomputed, then its vjp), for tape autograd
            through the compiled module: one cotangent per state tensor and argument."""
            from kiln.frontend.autodiff import vjp

            def forward_of(state, *inputs):
                return run(state, module_modes, rng_key, forward_kwargs, *inputs)[0]

            _, pullback = vjp(forward_of, module_state, *args)
            return pullback(cotangents)

        run.__name__ = type(module).__name__ if type(module).__name__.isidentifier() else "module"
        run.__signature__ = _signature(forward)
        grad_run.__name__ = run.__name__ + "_backward"
        grad_dynamic = dynamic_shapes
        if isinstance(dynamic_shapes, tuple):  # by position: cotangents come before the args
            grad_dynamic = dynamic_shapes[:len(_OWN_ARGS)] + (None,) + dynamic_shapes[len(_OWN_ARGS):]
        elif isinstance(dynamic_shapes, dict):  # by name: grad_run shares forward's names
            grad_run.__signature__ = _signature(forward, extra=("cotangents",))
        common = dict(backend=backend, mode=mode, fullgraph=fullgraph,
                      recompile_limit=recompile_limit, trace_dir=trace_dir)
        # dynamic, explain and strict are about the user's calls: the forward program's
        self.__dict__["_compiled"] = compile(run, dynamic_shapes=dynamic_shapes, dynamic=dynamic,
                                             explain=explain, strict=strict, **common)
        self.__dict__["_compiled_grad"] = compile(grad_run, dynamic_shapes=grad_dynamic, **common)

    def __call__(self, *args, **kwargs):
        module = self.module
        modules = list(module.modules())
        modes = "".join("t" if m.training else "e" for m in modules)
        state = dict(module._named_tensors(("param", "buffer", "transient")))
        if not any(m._needs_rng() for m in modules):
            out, changed, _ = self._compiled(state, modes, None, kwargs, *args)
            _write_back(state, changed)
            return self._taped(out, state, modes, None, kwargs, args)
        from kiln.frontend.factories import _key, tensor
        from kiln.ir import dtypes as dt

        outer = random.current_stream()
        if outer is not None and not _is_traced(outer.key):
            # continue the caller's `nn.rng` block exactly as an eager call would (the
            # position is a tensor, so it folds in with Threefry built from kiln ops)
            start = outer.start + outer.draws
            rng = (outer.key, tensor(start, dtype=dt.uint32))
        else:  # no eager stream to continue: a fresh key from the global one
            outer, rng = None, (tensor(_key(None)),)
        out, changed, draws = self._compiled(state, modes, rng, kwargs, *args)
        _write_back(state, changed)
        if outer is not None:
            outer.draws += int(draws)
        return self._taped(out, state, modes, rng, kwargs, args)

    def _taped(self, out, state: dict, modes: str, rng, kwargs: dict, args: tuple):
        """Record the call on the tape when a parameter or argument requires grad, so
        `loss.backward()` reaches the module's parameters through the compiled program;
        its pullback is a second compiled program (forward recomputed, then the vjp)."""
        from kiln.frontend import pytree
        from kiln.frontend.tape import is_grad_enabled, record_opaque
        from kiln.frontend.tensor import Tensor

        names = [k for k, t in state.items() if t.requires_grad]
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        if not is_grad_enabled() or not (names or positions):
            return out
        leaves, spec = pytree.flatten(out, lambda x: isinstance(x, Tensor))
        floating = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dtype.is_floating]
        if not floating:
            return out

        def pullback(cotangents: list) -> list:
            cts = [None] * len(leaves)
            for i, ct in zip(floating, cotangents):
                cts[i] = Tensor._make(ct) if ct is not None else None
            grads = self._compiled_grad(state, modes, rng, kwargs, pytree.unflatten(spec, cts),
                                        *args)
            by_name, by_arg = grads[0], grads[1:]
            found = [by_name.get(k) for k in names] + [by_arg[i] for i in positions]
            return [None if g is None else g.numpy() for g in found]

        operands = [state[k] for k in names] + [args[i] for i in positions]
        refs = record_opaque(type(self.module).__name__, operands,
                             [leaves[i].numpy() for i in floating], pullback)
        for i, ref in zip(floating, refs):
            leaves[i]._node = ref
        return out

    def stats(self) -> dict:
        """The compiled function's cache statistics (see `CompiledFunction.stats`)."""
        return self._compiled.stats()

    def compiled_graphs(self) -> list:
        return self._compiled.compiled_graphs()

    def __getattr__(self, name: str):  # model attributes read through, as torch's wrapper
        module = self.__dict__.get("module")
        if module is None:  # during copy/unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(module, name)

    def __repr__(self) -> str:
        return f"CompiledModule({self.module!r})"


def _write_back(state: dict, changed: dict) -> None:
    """Buffers (and parameters) that forward changed in place get their new values, as
    after an eager call (BatchNorm's running statistics)."""
    if not changed:
        return
    from kiln.frontend.mutation import rebind
    from kiln.frontend.tape import no_grad

    with no_grad():
        for name, value in changed.items():
            rebind(state[name], value, "compiled module write-back")


def _is_traced(t) -> bool:
    return getattr(t, "is_traced", False)


def _signature(forward, extra: tuple = ()) -> inspect.Signature | None:
    """(module_state, module_modes, rng_key, forward_kwargs, *forward's positional
    parameters): a dynamic_shapes dict keyed by forward's argument names then lines up
    with the compiled function's positions, and graph inputs carry forward's names."""
    own = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in _OWN_ARGS + extra]
    try:
        params = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if any(p.name in _OWN_ARGS + extra for p in params):
        params = []
    rest = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_ONLY) for p in params]
    return inspect.Signature(own + rest)
