"""A `BatchKernel` as one LLVM function: a switch over sub-problems by offsets.

Every member is emitted as it would be alone (`NAME_mK.body`, its own loops, shapes,
strides and sizes; not its exported ABI wrappers, which nothing would call); the batch's
exported entry has the ABI of any kernel,
`void NAME(ptr bufs, ptr sizes, i64 begin, i64 end)` (plus `NAME.np`, which takes numpy
array objects), over the concatenated index space: member k owns
[offset_k, offset_k + points_k), where points_k, the product of its outer extents, is
computed from the sizes at run time (symbolic shapes work). A range [begin, end) calls
each member whose part it overlaps, on the overlap only, so the runtime's pool splits a
batch over threads like any kernel and one call runs all of it.

    >>> emit_batch(module, batch, "kiln_f_batch_0")
"""

from __future__ import annotations

from typing import Callable

from kiln.codegen.kernel_ir import BatchKernel, Kernel
from kiln.codegen.cpu.index_emit import emit_index
from kiln.codegen.cpu.ir_builder import Fn, Module, V, const
from kiln.codegen.cpu.llvm_emit import NUMPY_DATA_OFFSET, WRAPPER_ATTRS, emit_kernel


def member_symbol(symbol: str, k: int) -> str:
    return f"{symbol}_m{k}"


def emit_batch(module: Module, batch: BatchKernel, symbol: str) -> None:
    """Add the members and the batch entry `symbol` (and `symbol.np`) to `module`."""
    for k, member in enumerate(batch.members):  # no ABI wrappers: only the entry calls them
        emit_kernel(module, member, member_symbol(symbol, k), wrappers=False)
    for suffix, deref in (("", False), (".np", True)):
        module.functions.append(_entry(module, batch, symbol, deref).define(
            f"define void @{symbol}{suffix}(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) {WRAPPER_ATTRS}"))


def _entry(module: Module, batch: BatchKernel, symbol: str, deref: bool) -> Fn:
    fn = Fn(module, prefix="t")
    pointers = []
    for i in range(len(batch.buffers)):
        p = fn.load("ptr", fn.gep("ptr", V("%bufs", "ptr"), const("i64", i)), 8)
        if deref:  # PyArrayObject: PyObject_HEAD, then char *data (llvm_emit.abi_wrapper)
            p = fn.load("ptr", fn.gep("i8", p, const("i64", NUMPY_DATA_OFFSET)), 8)
        pointers.append(p)
    symbols = {name: fn.load("i64", fn.gep("i64", V("%sizes", "ptr"), const("i64", i)), 8)
               for i, name in enumerate(batch.sizes)}
    begin, end = V("%begin", "i64"), V("%end", "i64")
    zero = const("i64", 0)
    offset = zero
    memo: dict = {}
    for k, (member, args, points) in enumerate(zip(batch.members, batch.args, batch.points())):
        n = emit_index(fn, points, symbols, memo)
        lo = fn.bin("sub", begin, offset)
        lo = fn.select(fn.icmp("slt", lo, zero), zero, lo)
        hi = fn.bin("sub", end, offset)
        hi = fn.select(fn.icmp("slt", hi, n), hi, n)
        run, done = fn.new_label(f"m{k}_run"), fn.new_label(f"m{k}_done")
        fn.cbr(fn.icmp("slt", lo, hi), run, done)
        fn.start_block(run)
        call_args = [V(pointers[a].ref, "ptr") for a in args]
        call_args += [symbols[s] for s in member.sizes] + [lo, hi]
        fn.call(f"{member_symbol(symbol, k)}.body", "void", call_args)
        fn.br(done)
        fn.start_block(done)
        offset = fn.bin("add", offset, n)
    fn.stmt("ret void")
    return fn


def batch_work(batch: BatchKernel) -> Callable[[dict], float]:
    """Estimated element-operations per point of the batch's index space at a size
    binding (the members' work over their total points), for the pool's split decision."""
    from kiln.codegen.cpu.compiled import _work_per_point
    from kiln.ir.shapes import dim_function

    parts = [(dim_function(p), _work_per_point(m) if isinstance(m, Kernel) else (lambda env: 1))
             for m, p in zip(batch.members, batch.points())]

    def work(env: dict) -> float:
        points = [count(env) for count, _ in parts]
        total = sum(points)
        return sum(n * per(env) for n, (_, per) in zip(points, parts)) / max(1, total)

    return work

