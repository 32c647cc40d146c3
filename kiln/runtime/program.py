"""`Program`: the flat list of steps a compiled graph becomes, over numbered buffer slots.

Steps: `Launch` a compiled kernel, `Extern` (an op run by its library reference: sort,
gather, LAPACK, ...), `Collective` (run through a process group), `View` (a reshape:
same memory, new shape), `Constant` (data baked into the program) and `Control` (cond / while_loop: a step that owns
sub-programs). The runtime never looks at the graph again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.shapes import Dim, ShapeVar, format_shape


@dataclass(frozen=True)
class BufferSpec:
    dtype: DType
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype.short}{format_shape(self.shape)}"


@dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple[int, ...]  # slots, in the kernel's buffer order


@dataclass(frozen=True)
class Extern:
    op: str
    attrs: dict
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class Collective(Extern):
    """A collective run through the process group its `group` attr names: a whole
    collective, a nonblocking `<op>_start` (its output slot holds the pending call) or
    a `collective_wait`. An Extern to the memory plan: reads inputs, writes outputs."""


@dataclass(frozen=True)
class View:
    source: int
    target: int


@dataclass(frozen=True)
class Constant:
    target: int
    name: str


@dataclass(frozen=True)
class Control:
    op: str  # "cond" or "while_loop"
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    bodies: tuple["Program", ...]


Step = Union[Launch, Extern, Collective, View, Constant, Control]


@dataclass
class Program:
    name: str
    inputs: list[int]
    outputs: list[int]
    buffers: dict[int, BufferSpec]
    steps: list[Step]
    kernels: dict[str, Any]  # name -> Kernel IR
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    shape_vars: dict[str, ShapeVar] = field(default_factory=dict)
    # memory plan: slot -> storage id for intermediates (outputs, inputs and views own none)
    storage: dict[int, int] = field(default_factory=dict)
    release_after: dict[int, list[int]] = field(default_factory=dict)  # step index -> slots

    def format(self) -> str:
        """Readable listing (the `program` stage of `kiln dump`): the steps, each buffer's
        (symbolic) type, the memory plan, and the sub-programs of control-flow steps
        indented under their step (`cond` branches by index, `while_loop` cond and body).

        >>> print(program.format())   # program @f(%0: f32[B, 4]) -> (%2) ...
        """
        return "\n".join(self._lines(""))

    def _lines(self, indent: str) -> list[str]:
        lines = [f"{indent}program @{self.name}(" + ", ".join(f"%{s}: {self.buffers[s]}" for s in self.inputs)
                 + ") -> (" + ", ".join(f"%{s}" for s in self.outputs) + ")"]
        inner = indent + "  "
        if not indent:  # a sub-program shares its parent's shape variables
            for name in sorted(self.shape_vars):
                lines.append(f"{inner}where {self.shape_vars[name].describe()}")
        for i, step in enumerate(self.steps):
            if isinstance(step, Launch):
                text = f"launch {step.kernel}(" + ", ".join(f"%{a}" for a in step.args) + ")"
            elif isinstance(step, Extern):
                kind = "collective" if isinstance(step, Collective) else "extern"
                text = (", ".join(f"%{o}" for o in step.outputs) + f" = {kind} {step.op}("
                        + ", ".join(f"%{a}" for a in step.inputs) + ")")
            elif isinstance(step, View):
                text = f"%{step.target} = view %{step.source} as {self.buffers[step.target]}"
            elif isinstance(step, Constant):
                text = f"%{step.target} = constant {step.name}"
            else:
                text = (", ".join(f"%{o}" for o in step.outputs) + f" = {step.op}("
                        + ", ".join(f"%{a}" for a in step.inputs) + ")")
            freed = self.release_after.get(i)
            if freed:
                text += "    ; frees " + ", ".join(f"%{s}" for s in freed)
            lines.append(inner + text)
            if isinstance(step, Control):
                labels = (["cond", "body"] if step.op == "while_loop"
                          else [f"branch {k}" for k in range(len(step.bodies))])
                for label, body in zip(labels, step.bodies):
                    lines.append(f"{inner}  {label}:")
                    lines.extend(body._lines(inner + "    "))
        internal = [s for s in sorted(self.buffers) if s not in self.inputs]
        if internal:
            lines.append(inner + "buffers: " + ", ".join(f"%{s}: {self.buffers[s]}" for s in internal))
        plan = ", ".join(f"%{s}->#{k}" for s, k in sorted(self.storage.items()))
        lines.append(inner + "storage: " + (plan or "(none)"))
        return lines
