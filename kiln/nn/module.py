"""`Module`: a model is an object whose attributes are its parameters and submodules.

As in PyTorch, a layer is a class with `__init__` (make the weights) and `forward`.
Every floating-point `kn.Tensor` attribute *is* a parameter (`nn.Parameter`, which
PyTorch code writes, is accepted and changes nothing else) and requires grad, every
`Module` attribute is a submodule, and
`register_buffer` marks tensors that belong to the state but are not trained.
Names are torch's dotted paths (`encoder.0.weight`), so `state_dict()` keys line up
with a PyTorch model of the same layout.

Training is functional, as in JAX: `functional_call(model, params, x)` runs `forward`
with other tensors (traced ones, inside `kn.grad` or `kn.compile`) in place of the
named parameters, and puts the module's own back afterwards. `kn.grad` differentiates
with respect to the `params` dict, and `kn.compile(model)` passes the parameters as
graph inputs, so changing them never recompiles.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator, NamedTuple

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.frontend.tensor import Tensor


class IncompatibleKeys(NamedTuple):
    """What `load_state_dict(..., strict=False)` did not match (torch's named tuple)."""

    missing_keys: list
    unexpected_keys: list


def _describe(t) -> str:
    return f"{t.dtype.short}{list(t.shape)}"


class Module:
    """Base class of layers and models: subclass it, set weights and submodules as
    attributes in `__init__`, compute in `forward`.

    >>> class MLP(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc1, self.fc2 = nn.Linear(4, 8, seed=0), nn.Linear(8, 1, seed=1)
    ...     def forward(self, x):
    ...         return self.fc2(kn.relu(self.fc1(x)))
    >>> [name for name, _ in MLP().named_parameters()]
    ['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias']
    """

    training: bool = True  # a class default, so a subclass that skips __init__ still works

    def __init__(self) -> None:
        object.__setattr__(self, "_buffers", {})  # buffer name -> persistent (in state_dict)
        self.training = True

    # -- attributes ---------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (list, tuple)) and any(isinstance(v, Module) for v in value):
            raise KilnArgumentError(
                f"{type(self).__name__}.{name}: a plain {type(value).__name__} of modules hides "
                "their parameters from named_parameters(), state_dict() and kn.compile",
                hint=f"use self.{name} = nn.ModuleList([...]) (or nn.Sequential)")
        if isinstance(value, Tensor) and name not in self.__dict__.get("_buffers", {}):
            _trainable(value)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__.get("_buffers", {}).pop(name, None)
        object.__delattr__(self, name)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Add state that is not a parameter (running statistics, step counters): it is in
        `state_dict()` (unless `persistent=False`) and `named_buffers()`, never in
        `parameters()`, so optimizers and `kn.grad` leave it alone."""
        if not isinstance(name, str) or not name or "." in name:
            raise KilnArgumentError(f"register_buffer: name must be a non-empty string without "
                                    f"'.', got {name!r}")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise KilnArgumentError(f"register_buffer: {name!r} must be a kn.Tensor or None, got "
                                    f"{type(tensor).__name__}")
        existing = self.__dict__.get(name)
        if isinstance(existing, Module):
            raise KilnArgumentError(f"register_buffer: {name!r} is already a submodule")
        if "_buffers" not in self.__dict__:
            object.__setattr__(self, "_buffers", {})
        self._buffers[name] = bool(persistent)
        object.__setattr__(self, name, tensor)

    def register_parameter(self, name: str, tensor: Tensor | None) -> None:
        """`setattr(self, name, tensor)`, checking that the tensor is floating point."""
        if tensor is not None and not (isinstance(tensor, Tensor) and tensor.dtype.is_floating):
            raise KilnDTypeError(f"register_parameter: {name!r} must be a floating-point kn.Tensor "
                                 f"(integer state is a buffer), got {tensor!r:.60}")
        self.__dict__.get("_buffers", {}).pop(name, None)
        setattr(self, name, tensor)

    def _own_tensors(self) -> Iterator[tuple[str, Tensor, str]]:
        """(name, tensor, kind) of this module's own tensors, kind "param", "buffer" or
        "transient" (a non-persistent buffer), in attribute order."""
        buffers = self.__dict__.get("_buffers", {})
        for name, value in self.__dict__.items():
            if not isinstance(value, Tensor):
                continue
            if name in buffers:
                yield name, value, "buffer" if buffers[name] else "transient"
            elif value.dtype.is_floating:
                yield name, value, "param"

    # -- the tree -----------------------------------------------------------------------

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        for name, value in self.__dict__.items():
            if isinstance(value, Module):
                yield name, value

    def children(self) -> Iterator["Module"]:
        return (m for _, m in self.named_children())

    def named_modules(self, prefix: str = "", remove_duplicate: bool = True):
        """This module and every submodule, depth first, with dotted names ("" for self)."""
        seen: set = set()

        def walk(module, path):
            if remove_duplicate:
                if id(module) in seen:
                    return
                seen.add(id(module))
            yield path, module
            for name, child in module.named_children():
                yield from walk(child, f"{path}.{name}" if path else name)

        yield from walk(self, prefix)

    def modules(self) -> Iterator["Module"]:
        return (m for _, m in self.named_modules())

    def _named_tensors(self, kinds: tuple, prefix: str = "", remove_duplicate: bool = True):
        seen: set = set()
        for path, module in self.named_modules(prefix, remove_duplicate=remove_duplicate):
            for name, tensor, kind in module._own_tensors():
                if kind not in kinds:
                    continue
                if remove_duplicate:
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                yield (f"{path}.{name}" if path else name), tensor

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """(dotted name, tensor) of every parameter; a tensor shared by two layers (tied
        weights) is listed once, under its first name."""
        if not recurse:
            return ((f"{prefix}.{n}" if prefix else n, t) for n, t, k in self._own_tensors()
                    if k == "param")
        return self._named_tensors(("param",), prefix, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]:
        return (t for _, t in self.named_parameters(recurse=recurse))

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        if not recurse:
            return ((f"{prefix}.{n}" if prefix else n, t) for n, t, k in self._own_tensors()
                    if k != "param")
        return self._named_tensors(("buffer", "transient"), prefix, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        return (t for _, t in self.named_buffers(recurse=recurse))

    def get_submodule(self, target: str) -> "Module":
        """The submodule at dotted path `target` ("" is self)."""
        module = self
        for part in target.split(".") if target else ():
            child = module.__dict__.get(part)
            if not isinstance(child, Module):
                raise KilnArgumentError(f"{type(self).__name__} has no submodule {target!r} "
                                        f"({type(module).__name__} has no submodule {part!r})")
            module = child
        return module

    def _slot(self, name: str) -> tuple["Module", str]:
        """The module owning the tensor at dotted path `name`, and its attribute name."""
        path, _, attr = name.rpartition(".")
        return self.get_submodule(path), attr

    # -- state ------------------------------------------------------------------------

    def _set_tensors(self, tensors: dict) -> None:
        """Put `tensors` (dotted name -> tensor) in place; a tensor tied under several
        names is replaced under all of them, so tied weights stay tied."""
        by_id: dict = {}
        for path, owner in self.named_modules(remove_duplicate=False):
            for attr, tensor, _ in owner._own_tensors():
                by_id.setdefault(id(tensor), []).append((owner, attr))
        updates = []
        for name, new in tensors.items():
            owner, attr = self._slot(name)
            old = owner.__dict__.get(attr)
            updates.extend((o, a, new) for o, a in by_id.get(id(old), [(owner, attr)]))
        for owner, attr, new in updates:
            old = owner.__dict__.get(attr)
            if isinstance(old, Tensor) and old._requires_grad and isinstance(new, Tensor):
                _trainable(new)
            object.__setattr__(owner, attr, new)

    def state_dict(self, prefix: str = "") -> "OrderedDict[str, Tensor]":
        """Every parameter and persistent buffer by dotted name, in definition order
        (tied tensors appear under each of their names, as in torch)."""
        return OrderedDict(self._named_tensors(("param", "buffer"), prefix, remove_duplicate=False))

    def load_state_dict(self, state_dict, strict: bool = True) -> IncompatibleKeys:
        """Copy tensors (or numpy arrays) from `state_dict` into the module.

        With `strict=True` a missing or unexpected key raises; with `strict=False` they
        are returned as `(missing_keys, unexpected_keys)`. A shape or dtype that differs
        from the module's always raises, naming the key and both types, and nothing is
        loaded unless everything matches."""
        from kiln.frontend.factories import tensor as make_tensor

        expected = self.state_dict()
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise KilnArgumentError(
                f"load_state_dict: {type(self).__name__}: " + " and ".join(parts),
                hint="pass strict=False to load the keys that match")
        loaded = []
        for name, current in expected.items():
            if name not in state_dict:
                continue
            value = state_dict[name]
            new = value if isinstance(value, Tensor) else make_tensor(value)
            if tuple(new.shape) != tuple(current.shape):
                raise KilnShapeError(f"load_state_dict: {name!r} is {_describe(current)} in the "
                                     f"module but {_describe(new)} in the state dict")
            if new.dtype != current.dtype:
                raise KilnDTypeError(f"load_state_dict: {name!r} is {_describe(current)} in the "
                                     f"module but {_describe(new)} in the state dict",
                                     hint=f"convert it first: value.to(kn.{current.dtype.name})")
            loaded.append((name, new))
        # copied into the existing tensors (torch's param.copy_): optimizers holding them
        # and tied weights see the loaded values, and later changes to the source do not
        # leak in
        from kiln.frontend.mutation import rebind
        from kiln.frontend.tape import no_grad

        fresh = {}
        with no_grad():
            for name, new in loaded:
                owner, attr = self._slot(name)
                current = owner.__dict__.get(attr)
                if isinstance(current, Tensor) and not current.is_traced:
                    rebind(current, make_tensor(new), "load_state_dict")
                else:
                    fresh[name] = make_tensor(new)
        if fresh:
            self._set_tensors(fresh)
        return IncompatibleKeys(missing, unexpected)

    def to(self, *args, dtype=None, device=None, **_) -> "Module":
        """Convert every floating-point parameter and buffer to `dtype` and move every
        parameter and buffer to `device`, in place, as torch (`model.to(device)`,
        `model.to(dtype)`, `model.to(device, dtype)`)."""
        from kiln.frontend.functional import to
        from kiln.frontend.methods import _is_device
        from kiln.frontend.tensor import as_device
        from kiln.ir import dtypes as dt

        for a in args:
            if _is_device(a):
                device = a
            else:
                dtype = a
        where = None if device is None else as_device(device, "Module.to")
        target = None if dtype is None else dt.dtype(dtype)
        if target is not None and not target.is_floating:
            raise KilnDTypeError(f"Module.to: {target} is not a floating dtype")
        if target is None and where is None:
            return self
        for module in self.modules():
            for name, tensor, _ in list(module._own_tensors()):
                new = tensor
                if target is not None and tensor.dtype.is_floating:
                    new = to(new, target)
                if where is not None and new.device != where:
                    new = new.to(where)
                if new is not tensor:
                    if tensor._requires_grad:
                        _trainable(new)
                    object.__setattr__(module, name, new)
        return self

    def cpu(self) -> "Module":
        return self.to("cpu")

    def cuda(self, device=None) -> "Module":
        return self.to("cuda" if device is None else f"cuda:{device}"
                       if isinstance(device, int) else device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear `.grad` of every parameter (torch.nn.Module.zero_grad)."""
        from kiln.frontend.factories import zeros_like

        for p in self.parameters():
            if p.grad is not None:
                p.grad = None if set_to_none else zeros_like(p.grad)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    # -- modes and calls ----------------------------------------------------------------

    def train(self, mode: bool = True) -> "Module":
        """Training mode (Dropout active) for this module and all submodules."""
        for module in self.modules():
            module.training = bool(mode)
        return self

    def eval(self) -> "Module":
        """Evaluation mode: `train(False)`."""
        return self.train(False)

    def apply(self, fn: Callable[["Module"], Any]) -> "Module":
        """Call `fn` on every submodule, then on self (as torch)."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    def forward(self, *args, **kwargs):
        """What calling the module computes; every subclass defines it."""
        raise KilnArgumentError(f"{type(self).__name__} was called, but it does not define "
                                "forward(); a Module subclass computes in forward(self, ...)")

    def __kiln_compile__(self, **options):
        """What `kn.compile(module, **options)` returns (kn.compile's protocol for objects
        that compile themselves): a CompiledModule, whose programs take the parameters and
        buffers as inputs (kiln/nn/compiled.py)."""
        from kiln.nn.compiled import CompiledModule

        return CompiledModule(self, **options)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _needs_rng(self) -> bool:
        """Whether a call draws random keys (Dropout in training mode)."""
        return False

    # -- printing -----------------------------------------------------------------------

    def extra_repr(self) -> str:
        """The text inside the parentheses of this module's line in `repr`."""
        return ""

    def __repr__(self) -> str:
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        children = [f"({name}): " + repr(child).replace("\n", "\n  ")
                    for name, child in self.named_children()]
        if len(lines) == 1 and not children:
            return f"{type(self).__name__}({lines[0]})"
        body = lines + children
        inner = ("\n  " + "\n  ".join(body) + "\n") if body else ""
        return f"{type(self).__name__}({inner})"


def _trainable(t: Tensor) -> None:
    """A float leaf set as a module attribute is a parameter: it requires grad, as every
    torch.nn.Parameter does, so `loss.backward()` fills its `.grad`."""
    if not t.is_traced and t._node is None and t.dtype.is_floating:
        t._requires_grad = True


# -- functional_call ---------------------------------------------------------------------


def functional_call(module: Module, params, *args, **kwargs):
    """Run `module(*args, **kwargs)` with the tensors of `params` (a dict of dotted name ->
    tensor, or a tuple of such dicts) in place of the module's parameters and buffers of
    those names, then put the originals back (also when forward raises).

    This is how a model is differentiated and compiled: `params` may hold traced tensors.
    Names not given keep the module's own tensors; a tensor tied under several names is
    replaced under all of them unless each name is given (torch's `tie_weights=True`).
    Not thread-safe on one module (it swaps attributes while forward runs).

    >>> params = dict(model.named_parameters())
    >>> loss = lambda p: F.mse_loss(nn.functional_call(model, p, x), y)
    >>> grads = kn.grad(loss)(params)
    """
    if isinstance(params, (tuple, list)):
        merged: dict = {}
        for d in params:
            for k, v in d.items():
                if k in merged:
                    raise KilnArgumentError(f"functional_call: {k!r} is given in two of the dicts")
                merged[k] = v
        params = merged
    slots = {}  # name -> (owner, attr, current tensor) of every tensor, tied names included
    for path, owner in module.named_modules(remove_duplicate=False):
        for name, tensor, _ in owner._own_tensors():
            slots[f"{path}.{name}" if path else name] = (owner, name, tensor)
    unknown = [k for k in params if k not in slots]
    if unknown:
        raise KilnArgumentError(
            f"functional_call: {type(module).__name__} has no parameter or buffer named "
            f"{unknown[0]!r}" + (f" (nor {unknown[1:]})" if len(unknown) > 1 else ""),
            hint=f"its names are {list(slots)[:8]}{' ...' if len(slots) > 8 else ''}")
    replace = {}
    by_tensor = {}
    for name, (owner, attr, tensor) in slots.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    for name, value in params.items():
        value = _as_tensor(name, value)
        owner, attr, tensor = slots[name]
        replace[(id(owner), attr)] = (owner, attr, value)
        for alias in by_tensor[id(tensor)]:  # tied weights follow unless given themselves
            if alias not in params:
                a_owner, a_attr, _ = slots[alias]
                replace.setdefault((id(a_owner), a_attr), (a_owner, a_attr, value))
    already = _traced_ids(module)  # an enclosing functional_call's tensors are not leaks
    saved = []
    try:
        for owner, attr, value in replace.values():
            saved.append((owner, attr, owner.__dict__[attr]))
            object.__setattr__(owner, attr, value)
        out = module(*args, **kwargs)
    finally:
        for owner, attr, old in reversed(saved):
            object.__setattr__(owner, attr, old)
    _check_no_traced_state(module, already)
    return out


def _traced_ids(module: Module) -> set:
    return {id(v) for _, owner in module.named_modules() for v in owner.__dict__.values()
            if isinstance(v, Tensor) and v.is_traced}


def _check_no_traced_state(module: Module, already: set) -> None:
    """A forward that stores a traced tensor on a module (`self.cache = h`) would leak it
    out of its trace; say so here, naming the attribute, rather than at a later use."""
    for path, owner in module.named_modules():
        for name, value in list(owner.__dict__.items()):
            if isinstance(value, Tensor) and value.is_traced and id(value) not in already:
                from kiln.errors import KilnTraceError

                owner.__delattr__(name)  # a dead value: leave the module usable
                where = f"{path}.{name}" if path else name
                raise KilnTraceError(
                    f"{type(owner).__name__}.forward stored a traced tensor in the module "
                    f"attribute {where!r} (now removed); it would outlive the trace "
                    "(kn.grad / kn.compile)",
                    hint="return the value from forward instead of keeping it on the module")


def _as_tensor(name: str, value) -> Tensor:
    if isinstance(value, Tensor):
        return value
    from kiln.frontend.factories import asarray

    try:
        return asarray(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with the parameter's name
        raise KilnArgumentError(f"functional_call: {name!r} must be a tensor, got "
                                f"{type(value).__name__} ({exc})") from None
