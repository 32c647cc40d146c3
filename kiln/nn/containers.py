"""The module containers: `ModuleList`, `Sequential` and `ModuleDict` (torch.nn's), whose
items are registered as children, so their parameters are the model's.
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.nn.module import Module


class ModuleList(Module):
    """A list of modules, registered as children "0", "1", ... (torch.nn.ModuleList).

    >>> layers = nn.ModuleList([nn.Linear(8, 8, seed=i) for i in range(3)])
    """

    def __init__(self, modules=None) -> None:
        super().__init__()
        for m in modules or ():
            self.append(m)

    def _items(self) -> list:
        return [m for _, m in self.named_children()]

    def _reset(self, items) -> None:
        for name, _ in list(self.named_children()):
            object.__delattr__(self, name)
        for i, m in enumerate(items):
            object.__setattr__(self, str(i), _check_module(type(self).__name__, m))

    def append(self, module: Module) -> "ModuleList":
        object.__setattr__(self, str(len(self)), _check_module(type(self).__name__, module))
        return self

    def extend(self, modules) -> "ModuleList":
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        items = self._items()
        items.insert(index, module)
        self._reset(items)

    def __getitem__(self, index):
        items = self._items()
        if isinstance(index, slice):
            return type(self)(items[index])
        return items[index]

    def __setitem__(self, index: int, module: Module) -> None:
        items = self._items()
        items[index] = module
        self._reset(items)

    def __delitem__(self, index) -> None:
        items = self._items()
        del items[index]
        self._reset(items)

    def __len__(self) -> int:
        return sum(1 for _ in self.named_children())

    def __iter__(self):
        return iter(self._items())


class Sequential(ModuleList):
    """Modules applied in order: `Sequential(a, b, c)(x) == c(b(a(x)))`.

    >>> mlp = nn.Sequential(nn.Linear(4, 8, seed=0), nn.GELU(), nn.Linear(8, 1, seed=1))
    """

    def __init__(self, *modules) -> None:
        if len(modules) == 1 and isinstance(modules[0], dict):
            Module.__init__(self)
            for name, m in modules[0].items():
                object.__setattr__(self, _check_name(self, name), _check_module("Sequential", m))
            return
        super().__init__(modules)

    def __getitem__(self, index):
        items = self._items()
        if isinstance(index, slice):
            return Sequential(*items[index])
        return items[index]

    def forward(self, x):
        for module in self._items():
            x = module(x)
        return x


class ModuleDict(Module):
    """Modules by name (torch.nn.ModuleDict); names become the dotted path."""

    def __init__(self, modules=None) -> None:
        super().__init__()
        for name, m in (dict(modules) if modules else {}).items():
            self[name] = m

    def __getitem__(self, name: str) -> Module:
        value = self.__dict__.get(name)
        if not isinstance(value, Module):
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, module: Module) -> None:
        object.__setattr__(self, _check_name(self, name), _check_module("ModuleDict", module))

    def __delitem__(self, name: str) -> None:
        self[name]
        object.__delattr__(self, name)

    def __contains__(self, name) -> bool:
        return isinstance(self.__dict__.get(name), Module)

    def __len__(self) -> int:
        return sum(1 for _ in self.named_children())

    def __iter__(self):
        return iter(self.keys())

    def keys(self) -> list:
        return [n for n, _ in self.named_children()]

    def values(self) -> list:
        return [m for _, m in self.named_children()]

    def items(self) -> list:
        return list(self.named_children())


def _check_module(where: str, m) -> Module:
    if not isinstance(m, Module):
        raise KilnArgumentError(f"{where}: expected an nn.Module, got {type(m).__name__}")
    return m


def _check_name(owner: Module, name) -> str:
    """A child name must not shadow an attribute of the container (`keys`, `training`)."""
    if (not isinstance(name, str) or not name or "." in name or name.startswith("_")
            or hasattr(type(owner), name)):
        raise KilnArgumentError(f"{type(owner).__name__}: a module name must be a non-empty "
                                f"string without '.' that is not an attribute of "
                                f"{type(owner).__name__}, got {name!r}")
    return name
