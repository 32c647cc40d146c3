"""erf and erfc of eager arrays as native loops over libm, exactly their references' values.

The references (kiln/ir/ops/erf_reference.py) define erf/erfc of float32 (and float16,
bfloat16, widened) as math.erf/math.erfc rounded to the dtype, and of float64 as
math.erf itself; math.erf is the C library's `erf` (measured: equal on 201 K doubles
here). numpy has no erf, so the reference is float64 numpy (~60 passes, exact by a
recheck of the values whose rounding is in doubt): 2^20 float32 values took 58 ms,
torch 0.24 (benchmarks/bench_eager.py). This module is one loop per dtype and function
that widens each element to double and calls libm's `erf`/`erfc`. Its float64 result,
as the numpy path's, is rounded by the caller to the value the reference defines, bit for
bit (float64 inputs: math.erf itself), at libm's scalar speed, cut over kiln's threads.
kiln/frontend/eager_path.py hands `compute` (imported on first use) to the reference
module, which keeps its numpy path for small arrays and other dtypes.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V
from kiln.codegen.cpu.llvm_emit import template_args
from kiln.codegen.cpu.native_pool import run_range

FLOATS = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
FUNCTIONS = ("erf", "erfc")
MIN_ELEMS = 1 << 12  # a smaller array keeps the numpy reference (the module costs a build)
SPLIT_ELEMS = 1 << 14  # ~10 ns an element: from here cut over kiln's threads
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_OBJECTS = ctypes.c_void_p * 2


def entry(name: str, ty: str) -> str:
    return f"kiln_{name}_{ty}"


def module_text(name: str, ty: str) -> str:
    """fn(bufs = [x, out] (array objects), sizes (unread), begin, end): out[i] =
    name((double) x[i]) for i in [begin, end), out float64 as the numpy path's (the
    caller rounds once: to float32, or straight to float16 where it widened them)."""
    module = Module()
    module.declare(name, f"declare double @{name}(double) nounwind")
    fn = Fn(module)
    (x, out), _ = template_args(fn, 2, ())
    size = 8 if ty == "double" else 4
    loop = CountedLoop(fn, V("%begin", "i64"), V("%end", "i64"), vectorize=False)
    i, _ = loop.begin()
    v = fn.load(ty, fn.gep(ty, x, i), size)
    wide = v if ty == "double" else fn.cast("fpext", v, "double")
    fn.store(fn.call(name, "double", [wide]), fn.gep("double", out, i), 8)
    loop.end()
    fn.stmt("ret void")
    module.functions.append(fn.define(f"define void @{entry(name, ty)}(ptr %bufs, ptr %sizes, i64 %begin, "
                                      "i64 %end) nounwind"))
    return module.text()


@lru_cache(maxsize=None)
def _entry(name: str, dtype: np.dtype):
    """(the jitted module, the address, a ctypes callable), built on first use (the glue
    cache keeps the object code across processes)."""
    from kiln.codegen.cpu.glue_cache import glue_module

    ty = FLOATS[dtype]
    jitted = glue_module(module_text(name, ty), 2)
    address = jitted.address(entry(name, ty))
    return jitted, address, _FN(address)


def compute(x: np.ndarray, name: str) -> np.ndarray | None:
    """`name` ("erf" or "erfc") of float32 or float64 `x` natively, as float64, or None
    (the caller runs its numpy path: another dtype, or an array under MIN_ELEMS)."""
    if not isinstance(x, np.ndarray) or name not in FUNCTIONS or x.dtype not in FLOATS or x.size < MIN_ELEMS:
        return None
    x = np.ascontiguousarray(x)
    out = np.empty(x.shape, np.float64)
    _, address, call = _entry(name, x.dtype)
    sizes = (ctypes.c_int64 * 1)()  # the ABI's sizes: the loop reads none
    bufs = _OBJECTS(id(x), id(out))  # alive until the call returns
    run_range(address, call, bufs, sizes, x.size, x.size >= SPLIT_ELEMS)
    return out
