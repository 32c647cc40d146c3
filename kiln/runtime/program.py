"""`Program`: the flat list of steps a compiled graph becomes, over numbered buffer slots.

Steps: `Launch` a compiled kernel, `Extern` (an op run by its library reference: sort,
gather, LAPACK, ...), `View` (a reshape: same memory, new shape), `Constant` (data
baked into the program) and `Control` (cond / while_loop: a step that owns
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


Step = Union[Launch, Extern, View, Constant, Control]


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
        """Readable listing (the `scheduled` stage of `kiln dump`)."""
        lines = [f"program @{self.name}(" + ", ".join(f"%{s}: {self.buffers[s]}" for s in self.inputs)
                 + ") -> (" + ", ".join(f"%{s}" for s in self.outputs) + ")"]
        for i, step in enumerate(self.steps):
            if isinstance(step, Launch):
                text = f"launch {step.kernel}(" + ", ".join(f"%{a}" for a in step.args) + ")"
            elif isinstance(step, Extern):
                text = (", ".join(f"%{o}" for o in step.outputs) + f" = extern {step.op}("
                        + ", ".join(f"%{a}" for a in step.inputs) + ")")
            elif isinstance(step, View):
                text = f"%{step.target} = view %{step.source} as {self.buffers[step.target]}"
            elif isinstance(step, Constant):
                text = f"%{step.target} = constant {step.name}"
            else:
                text = (", ".join(f"%{o}" for o in step.outputs) + f" = {step.op}("
                        + ", ".join(f"%{a}" for a in step.inputs) + f") with {len(step.bodies)} bodies")
            freed = self.release_after.get(i)
            if freed:
                text += "    ; frees " + ", ".join(f"%{s}" for s in freed)
            lines.append("  " + text)
        lines.append("  storage: " + ", ".join(f"%{s}->#{k}" for s, k in sorted(self.storage.items())))
        return "\n".join(lines)
