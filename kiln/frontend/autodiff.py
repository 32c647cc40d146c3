"""`kn.vjp`, `kn.grad`, `kn.value_and_grad`, `kn.stop_gradient`: JAX's autodiff API on
kiln's graph transformation (kiln/passes/autodiff.py).

The function is traced into a graph, the graph is differentiated, and the forward and
backward graphs are then *run*: eagerly through the reference interpreter, or, when
called inside `kn.trace`/`kn.compile`/`kn.export`, inlined into the graph being traced,
so `kn.compile(kn.grad(f))` is one program whose backward fuses like any code.
Arguments and results are pytrees (tuples, lists, dicts) of tensors; tensors the
function closes over are constants of the differentiation (no gradient flows to them).

    >>> w = kn.randn(3, seed=0)
    >>> kn.grad(lambda w: (w * w).sum())(w)      # 2 w
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Callable, Sequence

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnError, KilnGradientError, user_location
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER, GraphBuilder, is_python_scalar
from kiln.ir.ad import differentiable_dtype
from kiln.ir.graph import Graph, Region, Value
from kiln.ir.interpret import run_graph
from kiln.ir.regions import add_params, free_values
from kiln.ir.registry import CONTROL
from kiln.ir.types import TensorType
from kiln.frontend import pytree
from kiln.frontend.dispatch import apply, current_builder, raw, to_array, trace_stack
from kiln.frontend.closure_guards import closure_guards
from kiln.frontend.control_flow import region_value
from kiln.frontend.tensor import Tensor
from kiln.passes.autodiff import VJP, inline, vjp_graph


def _is_leaf(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray)) or is_python_scalar(x) or x is None \
        or isinstance(x, str)


def _is_tensor(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray))


def stop_gradient(x):
    """`x` unchanged, but no gradient flows back through it (jax.lax.stop_gradient,
    torch's `.detach()`).

    >>> kn.grad(lambda x: (x * kn.stop_gradient(x)).sum())(kn.ones(2))   # x, not 2x
    tensor([1., 1.], dtype=kiln.float32)
    """
    return apply("stop_gradient", x)


class _Differentiated:
    """`fn` traced at `primals` and differentiated w.r.t. the float tensor leaves of the
    arguments in `argnums`; `forward()` runs the forward, `backward(cts)` the backward."""

    def __init__(self, fn: Callable, primals: tuple, argnums: tuple[int, ...], has_aux: bool,
                 what: str, strict: bool = True):
        self.fn, self.what, self.has_aux = fn, what, has_aux
        for n in argnums:
            if not -len(primals) <= n < len(primals):
                raise KilnArgumentError(f"{what}: argnums {n} is out of range for "
                                        f"{len(primals)} positional arguments")
        argnums = tuple(n % len(primals) for n in argnums)
        outer = self._outer_builder(primals)
        self.builder = outer if outer is not None else GraphBuilder(Graph(_name(fn)))
        self.traced = outer is not None
        b = self.builder

        self.arg_leaves, self.arg_specs, leaf_values, wrt = [], [], [], []
        for position, arg in enumerate(primals):
            leaves, spec = pytree.flatten(arg, _is_leaf)
            self.arg_leaves.append(leaves)
            self.arg_specs.append(spec)
            for leaf in leaves:
                if not _is_tensor(leaf):
                    continue
                value = raw(b, leaf) if self.traced else None
                t = value.type if value is not None else _eager_type(leaf)
                float_leaf = differentiable_dtype(t.dtype)
                if strict and position in argnums and not float_leaf:
                    raise KilnGradientError(
                        f"{what}: argument {position} holds a tensor of dtype {t.dtype}; only "
                        "float tensors can be differentiated", where=user_location(),
                        hint="convert it with .to(kn.float32), or leave the argument out of "
                             "argnums (pass it at another position)")
                leaf_values.append((leaf, value, t))
                wrt.append(position in argnums and float_leaf)
        region, self.out_spec, n_out = self._trace(primals, [t for _, _, t in leaf_values])
        captured = free_values(region)
        add_params(region, captured)
        graph = Graph(_name(fn), region, dict(b.graph.shape_vars), dict(b.graph.constants))
        self.n_out = n_out
        # traced: both halves are inlined into the outer trace, which is verified whole
        self.vjp: VJP = vjp_graph(graph, [i for i, w in enumerate(wrt) if w], n_out,
                                  verify_result=not self.traced)
        self.inputs = [v if self.traced else _array(leaf) for leaf, v, _ in leaf_values] + captured
        self.wrt_mask = wrt
        self.n_captured = len(captured)
        self.plans: dict | None = None

    def rebound(self, primals: tuple) -> "_Differentiated":
        """This eager trace applied to new `primals` of the same signature (the cache
        key): the traced graphs are shared, the inputs and residuals are the new call's."""
        if self.plans is None:  # a reused trace: its graphs as straight-line programs
            self.plans = {id(g): straight_line(g) for g in (self.vjp.forward, self.vjp.backward)}
        other = copy.copy(self)
        other.arg_leaves = [pytree.flatten(arg, _is_leaf)[0] for arg in primals]
        other.inputs = [_array(leaf) for leaves in other.arg_leaves for leaf in leaves
                        if _is_tensor(leaf)]
        return other

    @staticmethod
    def _outer_builder(primals) -> GraphBuilder | None:
        for leaf in pytree.flatten(primals, _is_leaf)[0]:
            if isinstance(leaf, Tensor) and leaf.is_traced:
                return leaf._builder
        return current_builder()

    def _trace(self, primals, types: list[TensorType]) -> tuple[Region, Any, int]:
        b = self.builder
        region = Region([Value(t) for t in types])
        params = iter(region.params)
        args = []
        for leaves, spec in zip(self.arg_leaves, self.arg_specs):
            rebuilt = [Tensor._make(next(params), b) if _is_tensor(leaf) else leaf
                       for leaf in leaves]
            args.append(pytree.unflatten(spec, rebuilt))
        pushed = not self.traced
        if pushed:
            trace_stack().append(b)
        try:
            with b.entering(region):
                result = self.fn(*args)
                if self.has_aux:
                    if not (isinstance(result, (tuple, list)) and len(result) == 2):
                        raise KilnArgumentError(f"{self.what}: with has_aux=True the function "
                                                "must return a pair (output, aux)",
                                                where=user_location())
                    result = tuple(result)
                leaves, spec = pytree.flatten(result, _is_leaf)
                region.results = [region_value(b, leaf, f"{self.what}: the function")
                                  for leaf in leaves]
                # what the graph's constants were made from: eager kn.grad guards on them
                self.constant_sources = b.constant_sources()
        finally:
            if pushed:
                trace_stack().pop()
        n_out = len(pytree.flatten(result[0], _is_leaf)[0]) if self.has_aux else len(leaves)
        return region, spec, n_out

    # -- running the two halves -------------------------------------------------------

    def _run(self, graph: Graph, inputs: list) -> list:
        if self.traced:
            return [Tensor._make(v, self.builder) for v in inline(self.builder, graph, inputs)]
        plan = self.plans.get(id(graph)) if self.plans else None
        if plan is not None:
            return [Tensor._make(a) for a in plan(inputs)]
        return [Tensor._make(a) for a in run_graph(graph, *inputs)]

    def forward(self) -> list:
        """Outputs (with aux) followed by residuals."""
        outs = self._run(self.vjp.forward, self.inputs)
        n = len(self.vjp.forward.outputs) - self.vjp.num_residuals
        self.residuals = [t._x for t in outs[n:]]
        return outs[:n]

    def backward(self, cts: Sequence) -> list:
        """Cotangents of the wrt leaves given one per float output (None: zero)."""
        return self._run(self.vjp.backward, self.residuals + list(cts))

    def outputs(self, flat: list):
        return pytree.unflatten(self.out_spec, flat)

    def grads_tree(self, flat: list, positions: Sequence[int]):
        """Per argument in `positions`: its pytree with gradients at the float tensor
        leaves (None at other leaves)."""
        it = iter(flat)
        mask = iter(self.wrt_mask)
        per_arg = {}
        for position, (leaves, spec) in enumerate(zip(self.arg_leaves, self.arg_specs)):
            rebuilt = []
            for leaf in leaves:
                if _is_tensor(leaf):
                    rebuilt.append(next(it) if next(mask) else None)
                else:
                    rebuilt.append(None)
            per_arg[position] = pytree.unflatten(spec, rebuilt)
        return tuple(per_arg[p] for p in positions)


def straight_line(graph: Graph):
    """`graph` (static shapes, no regions) as a list of numpy reference calls with
    operands, attributes and result types resolved once: what run_graph does per node
    (type inference, attribute normalization, registry look-ups) is not repeated on every
    call of a cached eager gradient. None when the graph needs the interpreter."""
    if graph.shape_vars:
        return None
    slot = {id(p): i for i, p in enumerate(graph.inputs)}
    steps = []
    for node in graph.body.nodes:
        opdef = registry.get(node.op)
        if node.regions or opdef.kind == CONTROL or any(
                isinstance(v, sympy.Basic) or isinstance(v, tuple) and any(
                    isinstance(e, sympy.Basic) for e in v) for v in node.attrs.values()):
            return None
        if not all(isinstance(d, int) for r in node.results for d in r.type.shape):
            return None
        args = tuple(slot[id(v)] for v in node.operands)
        if node.op == "constant":
            const = graph.constants[node.attrs["name"]]
            fn, attrs, direct = (lambda c: lambda: c)(const), {}, True
        elif opdef.reference is None:  # a decomposition: the eager emitter runs it
            fn, attrs, direct = functools.partial(EAGER.apply, node.op), dict(node.attrs), False
        else:
            fn, attrs, direct = opdef.reference, opdef.normalize_attrs(node.attrs), True
        want = tuple((r.type.dtype.np_dtype, r.type.shape) for r in node.results)
        steps.append((node.op, fn, args, attrs, want, direct))
        for r in node.results:
            slot[id(r)] = len(slot)
    outs = tuple(slot[id(v)] for v in graph.outputs)

    def run(inputs: list) -> list:
        env = list(inputs)
        for op, fn, args, attrs, want, direct in steps:
            operands = [env[i] for i in args]
            result = fn(*operands, **attrs) if direct else fn(operands, attrs)
            results = result if isinstance(result, (tuple, list)) else (result,)
            if len(results) != len(want):
                raise KilnError(f"internal: {op} reference returned {len(results)} results")
            for r, (dtype, shape) in zip(results, want):
                r = np.asarray(r)
                if r.dtype != dtype or r.shape != shape:
                    raise KilnError(f"internal: {op} reference returned {r.dtype}{list(r.shape)}, "
                                    f"the traced type is {dtype}{list(shape)}")
                env.append(r)
        return [env[i] for i in outs]

    return run


def _eager_type(leaf) -> TensorType:
    data = leaf.numpy() if isinstance(leaf, Tensor) else to_array(leaf)
    return TensorType(dt.from_numpy(data.dtype), data.shape)


def _array(leaf) -> np.ndarray:
    return leaf.numpy() if isinstance(leaf, Tensor) else to_array(leaf)


def _name(fn) -> str:
    name = getattr(fn, "__name__", "f")
    return name if name.isidentifier() else "f"


def _ct_values(d: _Differentiated, cts, outputs: list, what: str) -> list:
    """The cotangent leaves, checked against the outputs, in the backward's order."""
    leaves = pytree.flatten(cts, _is_leaf)[0] if cts is not None else [None] * len(outputs)
    if len(leaves) != len(outputs):
        raise KilnArgumentError(f"{what}: the cotangent has {len(leaves)} tensors but the "
                                f"function has {len(outputs)} outputs")
    values = []
    for k, (ct, out) in enumerate(zip(leaves, outputs)):
        if not differentiable_dtype(out.dtype):
            continue
        if ct is None:
            values.append(_zeros_like(d, out))
            continue
        ct = ct if isinstance(ct, Tensor) else Tensor._make(to_array(ct))
        if ct.dtype != out.dtype or tuple(ct.shape) != tuple(out.shape):
            raise KilnArgumentError(
                f"{what}: cotangent {k} is {ct.dtype.short}{list(ct.shape)} but output {k} is "
                f"{out.dtype.short}{list(out.shape)}; they must match")
        values.append(raw(d.builder, ct) if d.traced else ct.numpy())
    return values


def _zeros_like(d: _Differentiated, out: Tensor):
    if d.traced:
        return d.builder.full(0, out.dtype, tuple(out.shape))
    return np.zeros(out.shape, out.dtype.np_dtype)


def vjp(fn: Callable, *primals, has_aux: bool = False):
    """`(fn(*primals), pullback)` where `pullback(cotangent)` returns one cotangent per
    primal (a pytree like it, None at non-float leaves), as `jax.vjp`.

    >>> out, pullback = kn.vjp(lambda x: x.sin(), kn.ones(3))
    >>> (dx,) = pullback(kn.ones(3))        # cos(1) each
    """
    d = _Differentiated(fn, primals, tuple(range(len(primals))), has_aux, "vjp", strict=False)
    outs = d.forward()
    main = outs[:d.n_out]

    def pullback(cotangent):
        return d.grads_tree(d.backward(_ct_values(d, cotangent, main, "vjp pullback")),
                            range(len(primals)))

    result = d.outputs(outs)
    if has_aux:
        return result[0], pullback, result[1]
    return result, pullback


def _scalar_seed(d: _Differentiated, out: list, what: str) -> list:
    if len(out) != 1 or out[0].ndim != 0 or not out[0].dtype.is_floating:  # real, as torch
        got = ", ".join(f"{o.dtype.short}{list(o.shape)}" for o in out)
        raise KilnGradientError(f"{what}: the function must return one float scalar, it returns "
                                f"({got})", where=user_location(),
                                hint="reduce it (.sum() or .mean()), or use kn.vjp with an "
                                     "explicit cotangent")
    one = d.builder.full(1, out[0].dtype) if d.traced else np.ones((), out[0].dtype.np_dtype)
    return [one]


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """A function returning `(fn(*args), gradient)`; the gradient is for argument
    `argnums` (a pytree like it), or a tuple of them when `argnums` is a tuple. `fn` must
    return a float scalar (or `(scalar, aux)` with `has_aux=True`: then the value is
    `(scalar, aux)`).

    >>> loss, g = kn.value_and_grad(lambda w, x: ((x @ w) ** 2).mean())(w, x)
    """
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    if not nums:
        raise KilnArgumentError("value_and_grad: argnums must name at least one argument")

    cache: dict = {}

    @functools.wraps(fn)
    def wrapper(*args):
        what = "grad" if not getattr(wrapper, "_value", True) else "value_and_grad"
        key = _eager_key(args) if current_builder() is None else None
        hit = cache.get(key) if key is not None else None
        if hit is not None and hit[1].check():
            d = hit[0].rebound(args)
        else:
            rng = _rng_state()
            d = _Differentiated(fn, args, nums, has_aux, what)
            if key is not None and not d.traced and not d.n_captured and _rng_state() == rng:
                guards = closure_guards(fn, d.constant_sources)
                if guards is not None:
                    cache.pop(key, None)
                    if len(cache) >= EAGER_CACHE_SIZE:  # oldest first out
                        cache.pop(next(iter(cache)))
                    template = copy.copy(d)  # keeps the graphs, not this call's arrays
                    template.inputs, template.arg_leaves = [], []
                    cache[key] = (template, guards)
        outs = d.forward()
        main = outs[:d.n_out]
        grads = d.grads_tree(d.backward(_scalar_seed(d, main, what)), nums)
        grads = grads[0] if single else grads
        return d.outputs(outs), grads

    wrapper.cache_size = lambda: len(cache)
    return wrapper


# traced vjp programs an eager value_and_grad keeps (one per argument signature)
EAGER_CACHE_SIZE = 8


def _eager_key(args: tuple):
    """The argument signature kn.compile keys on (pytree structure, dtype and shape of
    each tensor, value of every other leaf), or None: traced or unhashable arguments."""
    parts, specs = [], []
    for arg in args:
        leaves, spec = pytree.flatten(arg, _is_leaf)
        specs.append(spec)
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                if leaf._builder is not None:
                    return None
                parts.append((leaf._x.dtype, leaf._x.shape))
            elif isinstance(leaf, np.ndarray):
                parts.append((leaf.dtype, leaf.shape))
            else:
                parts.append(("static", leaf.__class__.__name__, leaf))
    try:
        key = (json.dumps(specs, default=repr), tuple(parts))
        hash(key)
    except TypeError:
        return None
    return key


def _rng_state() -> tuple:
    """The global random stream's position: a trace that draws from it (an unseeded
    kn.randn, dropout) is not reused, or every call would get the same numbers."""
    from kiln.frontend.factories import _rng

    return getattr(_rng, "seed", 0), getattr(_rng, "counter", 0)


def grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """The gradient of a float-scalar function, as `jax.grad`: for argument `argnums` (a
    pytree like it), or a tuple of them when `argnums` is a tuple; with `has_aux=True`,
    `(gradient, aux)`.

    >>> kn.grad(lambda x: (x ** 3).sum())(kn.tensor([1.0, 2.0]))     # 3 x^2
    tensor([ 3., 12.], dtype=kiln.float32)
    """
    inner = value_and_grad(fn, argnums, has_aux)
    inner._value = False

    @functools.wraps(fn)
    def wrapper(*args):
        value, grads = inner(*args)
        return (grads, value[1]) if has_aux else grads

    wrapper.cache_size = inner.cache_size  # traced programs kept (tests, kiln report)
    return wrapper
