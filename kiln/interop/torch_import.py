"""`kn.from_torch(module, example_inputs)`: a PyTorch module as a kiln program with its weights.

The module goes through `torch.export` and its core ATen decompositions; the exported
graph's nodes are then replayed with the kiln ops of `aten_ops.ATEN`. The replay is an
ordinary kiln function of (weights..., inputs...), so it runs eagerly, traces into a
kiln Graph, compiles, exports and differentiates like user code. torch is needed only
here, during the import; the result does not use it.
"""

from __future__ import annotations

import operator
import os
import re
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from kiln.errors import KilnTorchImportError, KilnUnsupportedTorchOpError

# keyword arguments of ATen creation ops that mean nothing to kiln (one device, no layouts)
_IGNORED_KWARGS = {"device", "layout", "pin_memory", "memory_format", "non_blocking",
                   "requires_grad", "copy"}


class TorchProgram:
    """A PyTorch module imported into kiln.

    >>> prog = kn.from_torch(torch_model, (x,))
    >>> prog(x)                          # compiled with kn.compile, no torch involved
    >>> prog.params                      # {torch state-dict name: kn.Tensor}
    >>> kn.grad(lambda p, x: prog.apply(p, x).sum())(prog.params, x)
    """

    def __init__(self, name: str, steps: list, params: "OrderedDict[str, Any]", placeholders: list,
                 outputs: Any, out_spec: Callable, dynamic_shapes, n_inputs: int):
        self.name = name
        self.params = params
        self._steps = steps
        self._placeholders = placeholders  # ("param", name) or ("input", index), in graph order
        self._outputs = outputs
        self._unflatten = out_spec
        self._n_inputs = n_inputs
        self._dynamic = dynamic_shapes  # kiln TensorSpecs of the user inputs, or None
        self._compiled = None

        def flat(*arrays):  # (weights..., inputs...): kn.compile's fast positional path
            names = list(self.params)
            return self.apply(dict(zip(names, arrays[:len(names)])), *arrays[len(names):])

        flat.__name__ = flat.__qualname__ = re.sub(r"\W", "_", name)  # names the graph and kernels
        self._flat = flat

    # -- running --------------------------------------------------------------------------

    def apply(self, params: dict, *inputs):
        """The module as a pure kiln function of its weights and inputs (traceable,
        differentiable: pass a dict with the same names as `params`)."""
        if len(inputs) != self._n_inputs:
            raise KilnTorchImportError(f"{self.name}: takes {self._n_inputs} input tensors, "
                                       f"got {len(inputs)}")
        env: dict[str, Any] = {}
        for node_name, (kind, key) in self._placeholders:
            env[node_name] = params[key] if kind == "param" else inputs[key]
        from kiln.interop.aten_ops import Unsupported

        for node_name, fn, args, kwargs, where in self._steps:
            try:
                env[node_name] = fn(*_resolve(args, env), **_resolve(kwargs, env))
            except Unsupported as e:
                raise KilnUnsupportedTorchOpError(f"from_torch: {e}", where=where) from None
        return self._unflatten([_resolve(o, env) for o in self._outputs])

    def __call__(self, *inputs):
        """Run compiled (the first call compiles; kn.compile's cache serves the rest)."""
        if self._compiled is None:
            from kiln.frontend.compile import compile as kn_compile

            self._compiled = kn_compile(self._flat, dynamic_shapes=self._spec())
        return self._compiled(*self.params.values(), *inputs)

    def _spec(self):
        """dynamic_shapes by position for (weights..., inputs...): weights are static."""
        if self._dynamic is None:
            return None
        return tuple([None] * len(self.params)) + tuple(self._dynamic)

    def graph(self, *inputs):
        """The kiln Graph of the whole module (weights are its first inputs), traced at
        `inputs`' shapes (and the import's dynamic dims)."""
        from kiln.frontend.tracing import trace_function

        return trace_function(self._flat, (*self.params.values(), *inputs), self._spec(),
                              name=self.name).graph

    def export(self, *inputs):
        """A kiln ExportedProgram (`.save("m.kir")`, `kiln dump`); weights are its first inputs."""
        from kiln.frontend.export import export

        return export(self._flat, (*self.params.values(), *inputs), dynamic_shapes=self._spec())

    def save_weights(self, path) -> None:
        """The weights as a safetensors file, under torch's state-dict names."""
        from kiln.io.safetensors_io import save_state_dict

        save_state_dict(self.params, path)

    def load_weights(self, path) -> None:
        """Replace the weights with a safetensors file's (same names, shapes and dtypes)."""
        from kiln.io.safetensors_io import load_state_dict

        loaded = load_state_dict(path)
        missing = [k for k in self.params if k not in loaded]
        if missing:
            raise KilnTorchImportError(f"{self.name}: {path} lacks weights {missing[:5]}")
        for k, old in self.params.items():
            new = loaded[k]
            if new.shape != old.shape or new.dtype != old.dtype:
                raise KilnTorchImportError(f"{self.name}: weight {k!r} is {new.dtype}{list(new.shape)} "
                                           f"in {path}, but the module has {old.dtype}{list(old.shape)}")
            self.params[k] = new


def _resolve(template, env):
    if isinstance(template, _Ref):
        return env[template.name]
    if isinstance(template, (list, tuple)):
        return type(template)(_resolve(t, env) for t in template)
    if isinstance(template, dict):
        return {k: _resolve(v, env) for k, v in template.items()}
    return template


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


# -- importing ------------------------------------------------------------------------------


def from_torch(module, example_inputs, dynamic_shapes=None, *, decompose: bool = True) -> TorchProgram:
    """Import a `torch.nn.Module` through `torch.export` (core ATen opset).

    `dynamic_shapes` is torch.export's (`torch.export.Dim` per dim); those dims stay
    symbolic in kiln too. An ATen op kiln has no mapping for raises K346 naming the op
    and the module's source line.

    >>> prog = kn.from_torch(model.eval(), (torch.randn(2, 8),))
    >>> prog(np.ones((2, 8), np.float32))
    """
    try:
        import torch
        import torch.utils._pytree as torch_pytree
    except ImportError:
        raise KilnTorchImportError("from_torch needs PyTorch, which is not installed",
                                   hint="pip install 'kiln[torch]'") from None
    if not isinstance(module, torch.nn.Module):
        raise KilnTorchImportError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in example_inputs)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise KilnTorchImportError(f"from_torch: example input {i} is a {type(x).__name__}; "
                                       "kiln imports modules whose inputs are tensors")
    name = type(module).__name__
    try:
        ep = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes)
        if decompose:
            ep = ep.run_decompositions()
    except Exception as e:  # torch raises many types: report them as one import failure
        raise KilnTorchImportError(f"from_torch: torch.export could not export {name}: "
                                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                   hint="check that torch.export.export(module, example_inputs) works") from None
    params = _weights(ep, torch)
    placeholders, user_index = [], 0
    specs = ep.graph_signature.input_specs
    for spec in specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            placeholders.append((spec.arg.name, ("input", user_index)))
            user_index += 1
        elif kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            placeholders.append((spec.arg.name, ("param", spec.target)))
        else:
            raise KilnTorchImportError(f"from_torch: {name} has a {kind} input ({spec.target}), "
                                       "which kiln cannot take")
    for spec in ep.graph_signature.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            what = (f"mutates buffer {spec.target!r}" if spec.kind.name == "BUFFER_MUTATION" else
                    f"has a {spec.kind.name.lower()} output ({spec.target!r})")
            raise KilnTorchImportError(
                f"from_torch: {name} {what} in forward; kiln imports pure functions",
                hint="call module.eval() first (batch norm in training mode updates its running "
                     "statistics)")
    steps, outputs = _steps(ep.graph_module.graph, torch)
    out_spec = ep.call_spec.out_spec

    def unflatten(leaves):
        return torch_pytree.tree_unflatten(leaves, out_spec) if out_spec is not None else leaves

    dynamic = _kiln_specs(ep, _dim_names(dynamic_shapes, ep), torch) if dynamic_shapes is not None else None
    return TorchProgram(name, steps, params, placeholders, outputs, unflatten, dynamic, user_index)


def _weights(ep, torch) -> "OrderedDict[str, Any]":
    """Parameters, buffers and lifted constants as kiln tensors, by their torch names."""
    from kiln.frontend.factories import asarray

    params: "OrderedDict[str, Any]" = OrderedDict()
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            continue
        source = ep.state_dict if spec.target in ep.state_dict else ep.constants
        params[spec.target] = asarray(torch_to_numpy(source[spec.target], torch))
    return params


def torch_to_numpy(t, torch) -> np.ndarray:
    """A torch tensor's data as numpy (bf16 and fp8 through their bits), copied."""
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    special = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
               torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
               torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
    if t.dtype in special:
        bits, np_dtype = special[t.dtype]
        return t.view(bits).numpy().view(np_dtype).copy()
    return t.numpy().copy()


def _kiln_dtype(torch_dtype):
    from kiln.ir import dtypes

    name = str(torch_dtype).removeprefix("torch.")
    try:
        return dtypes.dtype(name)
    except Exception:
        raise KilnTorchImportError(f"from_torch: torch dtype {name} has no kiln dtype") from None


def _steps(graph, torch) -> tuple[list, list]:
    from kiln.interop import aten_ops  # kiln's ops: imported once kiln itself is

    steps, outputs = [], []
    for node in graph.nodes:
        if node.op in ("placeholder",):
            continue
        if node.op == "output":
            outputs = list(_template(node.args[0], torch))
            continue
        if node.op != "call_function":
            raise KilnTorchImportError(f"from_torch: graph node {node.name} is a {node.op}, "
                                       "which an exported core ATen graph should not have")
        where = source_line(node)
        fn = _function(node, where)
        if fn is aten_ops.ATEN.get("native_layer_norm") and _only_first_output_read(node):
            fn = aten_ops.layer_norm_output_only
        steps.append((node.name, fn, _template(node.args, torch), _kwargs(node.kwargs, torch), where))
    return steps, outputs


def _only_first_output_read(node) -> bool:
    return all(user.target is operator.getitem and user.args[1] == 0 for user in node.users)


def _function(node, where: str | None) -> Callable:
    from kiln.interop import aten_ops

    target = node.target
    if target is operator.getitem:
        def getitem(seq, i, _where=where):
            value = seq[i]
            if value is None:
                raise KilnUnsupportedTorchOpError(
                    f"from_torch: output {i} of {node.args[0]} (pooling indices, or the saved "
                    "statistics of a training-mode op) has no kiln counterpart", where=_where)
            return value
        return getitem
    if target in (operator.mul, operator.add, operator.sub, operator.floordiv, operator.neg):
        return target  # symbolic-size arithmetic
    name = str(target)
    match = re.fullmatch(r"aten\.(\w+)(?:\.\w+)?", name)
    if match and match.group(1) == "sym_size":
        return lambda x, dim: x.shape[dim]
    if match is None or match.group(1) not in aten_ops.ATEN:
        random = match is not None and ("dropout" in match.group(1) or "bernoulli" in match.group(1))
        raise KilnUnsupportedTorchOpError(
            f"from_torch: {name} has no kiln mapping (kiln maps {len(aten_ops.ATEN)} ATen ops; "
            "see docs/torch-import.md)", where=where,
            hint="call module.eval() before importing: dropout is random only in training mode"
            if random else "rewrite that line with ops kiln has, or keep that part of the model in torch")
    return aten_ops.ATEN[match.group(1)]


def _template(value, torch):
    import torch.fx

    if isinstance(value, torch.fx.Node):
        return _Ref(value.name)
    if isinstance(value, (list, tuple)):
        return type(value)(_template(v, torch) for v in value)
    if isinstance(value, torch.dtype):
        return _kiln_dtype(value)
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return None
    return value


def _kwargs(kwargs: dict, torch) -> dict:
    return {k: _template(v, torch) for k, v in kwargs.items() if k not in _IGNORED_KWARGS}


def source_line(node) -> str | None:
    """The user's source line that produced an exported node (its last stack frame)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return None
    # the innermost frame outside torch is the user's line (nn.Conv2d's own code is not)
    torch_dir = _torch_dir()
    user = [f for f in frames if not os.path.abspath(f[0]).startswith(torch_dir)]
    path, line, fn, code = (user or frames)[-1]
    return f"{path}:{line} in {fn}: {code.strip()}"


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _dim_names(dynamic_shapes, ep) -> dict:
    """(user input index, dim) -> the name of the torch.export.Dim the user gave it."""
    entries = dynamic_shapes
    if isinstance(entries, dict):  # by forward()'s parameter names, in order
        entries = list(entries.values())
    names = {}
    for i, entry in enumerate(entries if isinstance(entries, (list, tuple)) else ()):
        items = entry.items() if isinstance(entry, dict) else enumerate(entry or ())
        for axis, dim in items:
            name = getattr(dim, "__name__", None)
            if isinstance(name, str) and name.isidentifier():
                names[(i, axis)] = name
    return names


def _kiln_specs(ep, dim_names: dict, torch) -> list:
    """kiln TensorSpecs for the user inputs: each torch symbolic dim becomes a ShapeVar
    with the range torch.export derived for it."""
    from kiln.frontend.specs import TensorSpec
    from kiln.ir.shapes import ShapeVar

    variables: dict[str, ShapeVar] = {}
    specs = []
    users = [s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    nodes = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    for index, spec in enumerate(users):
        val = nodes[spec.arg.name].meta.get("val")
        dims = []
        for axis, d in enumerate(getattr(val, "shape", ())):
            if isinstance(d, torch.SymInt):
                expr = d.node.expr
                key = str(expr)
                if key not in variables:
                    label = dim_names.get((index, axis), key)
                    bounds = ep.range_constraints.get(expr)
                    low = int(bounds.lower) if bounds is not None else 0
                    high = bounds.upper if bounds is not None else None
                    high = int(high) if high is not None and high.is_finite else None
                    variables[key] = ShapeVar(label, min=low, max=high)
                dims.append(variables[key])
            else:
                dims.append(None)
        specs.append(TensorSpec(dims) if any(isinstance(d, ShapeVar) for d in dims) else None)
    return specs
