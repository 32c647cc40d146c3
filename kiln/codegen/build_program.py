"""From a fused graph to a runtime `Program`: one step per top-level node.

`fused` nodes become kernel launches (Kernel IR by `lower`; a run of nodes the batching
pass tagged `batch=N` becomes one launch of a `BatchKernel`), reshapes become views,
constants become constant steps, control flow becomes steps that own sub-programs,
collectives become collective steps (run through the process group), and every
other op runs as an extern call of its reference implementation (sort, gather,
scatter, LAPACK, random bits, ...), so every graph kiln can trace also runs compiled.
"""

from __future__ import annotations

from typing import Callable

from kiln.codegen.batch_lower import batch_launch
from kiln.codegen.complex_stores import interleave_stores, interleaved_pairs
from kiln.codegen.lower import SplitReduction, lower_fused
from kiln.ir import registry
from kiln.ir.dtypes import float32
from kiln.ir.graph import Graph, Region, Value
from kiln.ir.registry import COLLECTIVE
from kiln.runtime.memory_plan import plan_memory
from kiln.runtime.program import (
    BufferSpec, Collective, Constant, Control, Extern, Launch, Program, View,
)


def build_program(graph: Graph, prefix: str = "", sink: Callable | None = None) -> Program:
    """Lower `graph` (already through the graph passes and fusion, regions included).
    `sink(kernel)`, when given, sees each kernel as soon as it is lowered, in the order
    of the program's `kernels` (a backend may start building them: cpu/stream_build.py)."""
    slots: dict[int, int] = {}
    buffers: dict[int, BufferSpec] = {}
    kernels: dict = {}

    def add_kernel(kernel, name: str | None = None) -> None:
        kernels[kernel.name if name is None else name] = kernel
        if sink is not None:
            sink(kernel)
    steps: list = []

    def new_slot(spec: BufferSpec) -> int:
        buffers[len(buffers)] = spec
        return len(buffers) - 1

    def slot(v: Value) -> int:
        if id(v) not in slots:
            slots[id(v)] = new_slot(BufferSpec(v.type.dtype, v.type.shape))
        return slots[id(v)]

    inputs = [slot(v) for v in graph.inputs]
    pairs = interleaved_pairs(graph)  # complex results a kernel stores interleaved
    packed: dict[int, int] = {}  # such a complex node -> the f32[..., 2] slot written
    batched: set[int] = set()  # nodes launched as members of a batch (batch_lower.py)
    for index, node in enumerate(graph.body.nodes):
        if index in batched:
            continue
        batch = batch_launch(graph.body.nodes, index, f"{prefix}{graph.name}", slot, lower_fused)
        if batch is not None:
            kernel, args, covered = batch
            add_kernel(kernel)
            steps.append(Launch(kernel.name, args))
            batched.update(covered)
            if index in batched:
                continue
        ins = tuple(slot(v) for v in node.operands)
        outs = tuple(slot(v) for v in node.results)
        if node.op == "fused":
            name = f"{prefix}{graph.name}_{node.attrs['kind']}_{len(kernels)}"
            lowered = lower_fused(node, name)
            if isinstance(lowered, SplitReduction):
                scratch = tuple(new_slot(BufferSpec(b.dtype, b.shape)) for b in lowered.scratch)
                add_kernel(lowered.partial)
                add_kernel(lowered.combine)
                steps.append(Launch(lowered.partial.name, ins + scratch))
                steps.append(Launch(lowered.combine.name, scratch + outs))
            else:
                if index in pairs:  # complex_stores.py
                    at, re, im = pairs[index]
                    lowered = interleave_stores(lowered, re, im)
                    shape = tuple(node.results[re].type.shape) + (2,)
                    packed[at] = new_slot(BufferSpec(float32, shape))
                    outs = tuple(packed[at] if k == re else s for k, s in enumerate(outs) if k != im)
                add_kernel(lowered, name)
                steps.append(Launch(name, ins + outs))
        elif index in packed:
            steps.append(View(packed[index], outs[0]))
        elif node.op in ("reshape", "view_as_real", "view_as_complex"):  # same memory
            steps.append(View(ins[0], outs[0]))
        elif node.op == "constant":
            steps.append(Constant(outs[0], node.attrs["name"]))
        elif node.op in ("cond", "while_loop"):
            bodies = []
            for k, region in enumerate(node.regions):
                sub = region_graph(region, f"{graph.name}_{node.op}{index}_{k}", graph)
                body = build_program(sub, prefix=prefix, sink=sink)  # sub.name is unique
                kernels.update(body.kernels)  # fed to the sink already, in this order
                bodies.append(body)
            steps.append(Control(node.op, ins, outs, tuple(bodies)))
        elif registry.get(node.op).kind == COLLECTIVE:
            steps.append(Collective(node.op, dict(node.attrs), ins, outs))
        else:
            steps.append(Extern(node.op, dict(node.attrs), ins, outs))
    outputs = [slot(v) for v in graph.outputs]
    program = Program(graph.name, inputs, outputs, buffers, steps, kernels,
                      constants=dict(graph.constants), shape_vars=dict(graph.shape_vars))
    return plan_memory(program)


def region_graph(region: Region, name: str, parent: Graph) -> Graph:
    """A region as a standalone graph (its parameters are the inputs). Regions are
    self-contained: the tracer turns captured values into explicit operands."""
    graph = Graph(name, region, shape_vars=parent.shape_vars, constants=parent.constants)
    return graph
