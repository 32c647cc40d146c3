"""The op registry: one `OpDef` per op, carrying every rule the system needs.

An op is defined once, in `kiln/ir/ops/<family>.py`, as a short class whose functions
are its rules (JAX's shape: every interpreter is a table keyed by op):

    @defop("exp", family="elementwise", kind=ELEMENTWISE)
    class exp:
        type = unary_float_type
        reference = np.exp

- `type(op, *types, **attrs)` -> TensorType or tuple: the type rule, and where bad
  input gets its error;
- `reference(*arrays, **attrs)` -> array or tuple: the numpy implementation (eager
  mode, and the oracle of every test);
- `decompose(b, *values, **attrs)`: composites only, in terms of other ops, written
  against an `Emitter` so it traces into a graph or runs eagerly alike;
- `vjp` rules are filled in by the autodiff layer; `sharding` holds a collective's layout
  rule. The SPMD sharding rule of every op sits beside it in its ops module, in the
  tables of `kiln/ir/sharding.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.errors import KilnArgumentError, KilnUnknownOpError

# op kinds: what rules the registry test demands of each
ELEMENTWISE = "elementwise"  # a scalar primitive applied pointwise; backends implement it
PRIMITIVE = "primitive"  # structural primitives (shape, reduce, dot, random, ...)
COMPOSITE = "composite"  # decomposes into other ops; backends may match it as a template
CONTROL = "control"  # owns regions (cond, while_loop)
EXTERN = "extern"  # a library call (LAPACK) with a numpy reference
# communicates with other ranks: never folded at compile time (operands may differ per
# rank), a fusion boundary, run by the runtime through a process group; needs a sharding rule
COLLECTIVE = "collective"

KINDS = (ELEMENTWISE, PRIMITIVE, COMPOSITE, CONTROL, EXTERN, COLLECTIVE)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()


@dataclass
class OpDef:
    name: str
    family: str
    kind: str
    type_rule: Callable
    reference: Callable | None = None
    decompose: Callable | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    num_operands: int | None = None  # None: variadic
    num_regions: int | None = 0  # None: any number (cond)
    differentiable: bool = True
    vjp: Callable | None = None
    sharding: Callable | None = None
    doc: str = ""

    def normalize_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Defaults filled in, unknown and missing attributes rejected."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise KilnArgumentError(
                f"{self.name}: unknown attribute(s) {', '.join(sorted(unknown))}; "
                f"it takes {', '.join(self.attrs) or 'none'}")
        out = {}
        for key, default in self.attrs.items():
            if key in attrs:
                out[key] = attrs[key]
            elif default is REQUIRED:
                raise KilnArgumentError(f"{self.name}: missing required attribute '{key}'")
            else:
                out[key] = default
        return out

    def infer(self, types, attrs: dict[str, Any]):
        """Result types as a list, after checking operand count and attributes."""
        if self.num_operands is not None and len(types) != self.num_operands:
            raise KilnArgumentError(
                f"{self.name}: takes {self.num_operands} operand(s), got {len(types)}")
        result = self.type_rule(self.name, *types, **attrs)
        return list(result) if isinstance(result, (tuple, list)) else [result]


_OPS: dict[str, OpDef] = {}


def defop(name: str, *, family: str, kind: str, attrs: dict[str, Any] | None = None,
          num_operands: int | None = None, num_regions: int | None = 0,
          differentiable: bool = True):
    """Register the rules of the decorated class as op `name`."""

    def wrap(cls):
        rules = cls.__dict__
        opdef = OpDef(
            name=name, family=family, kind=kind, type_rule=rules["type"],
            reference=rules.get("reference"), decompose=rules.get("decompose"),
            attrs=dict(attrs or {}), num_operands=num_operands, num_regions=num_regions,
            differentiable=differentiable, vjp=rules.get("vjp"), sharding=rules.get("sharding"),
            doc=(cls.__doc__ or "").strip())
        register(opdef)
        return opdef

    return wrap


def register(opdef: OpDef) -> OpDef:
    if opdef.kind not in KINDS:
        raise ValueError(f"op {opdef.name}: kind {opdef.kind!r} is not one of {KINDS}")
    if opdef.name in _OPS:
        raise ValueError(f"op {opdef.name} is defined twice")
    _OPS[opdef.name] = opdef
    return opdef


def get(name: str) -> OpDef:
    _load_families()
    try:
        return _OPS[name]
    except KeyError:
        raise KilnUnknownOpError(f"unknown op '{name}'; kiln's registry has no such op") from None


def all_ops() -> dict[str, OpDef]:
    _load_families()
    return dict(_OPS)


_loaded = False


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import kiln.ir.ops  # noqa: F401  (importing the families registers every op)
