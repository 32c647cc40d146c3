"""Checking generated MSL without a Mac: clang++-15 against tests/codegen/metal/metal_compat.h.

`check_msl(source)` runs `clang++-15 -std=c++17 -fsyntax-only` on a kernel (address spaces
as clang attributes: a pointer moved between `device` and `threadgroup`, or a write to
`constant`, is an error). `simulate(kernel, arrays, sizes)` builds the same source with
`-DKILN_SIM` into a shared library whose launcher runs every threadgroup on one
std::thread per lane (a std::barrier per threadgroup and per simdgroup) and runs the
kernel in place on numpy arrays. Both need clang++-15 (Debian: `apt-get install
clang-15`); tests skip, naming it, where it is missing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import numpy as np

from kiln.codegen.metal.emit import emit_kernel
from kiln.codegen.metal.scalar import msl_type

HERE = pathlib.Path(__file__).resolve().parent
CLANG = shutil.which("clang++-15")
_BUILT: dict = {}


class MslError(AssertionError):
    """clang rejected a generated kernel (the message is its diagnostics)."""


def rewrite(source: str) -> str:
    """The two rewrites MSL needs before clang: the compatibility header for metal_stdlib,
    and function-scope threadgroup arrays made static (one per threadgroup, which the
    simulator runs one at a time)."""
    source = source.replace("#include <metal_stdlib>", '#include "metal_compat.h"')
    # a declaration (no initializer, no pointer): `threadgroup T name[N];` or `threadgroup T name;`
    source = re.sub(r"^(\s+)threadgroup (\w+ \w+(\[[^\]]*\])*;)", r"\1static threadgroup \2", source, flags=re.M)
    return re.sub(r"\[\[threadgroup\((\d+)\)\]\]", r"[[kiln_threadgroup(\1)]]", source)


def _clang(args: list[str], source: str, suffix: str, tmp: str) -> None:
    path = os.path.join(tmp, "k" + suffix)
    with open(path, "w") as f:
        f.write(source)
    std = "-std=c++20" if "-DKILN_SIM" in args else "-std=c++17"
    proc = subprocess.run([CLANG, std, "-Wno-unknown-attributes", "-I", str(HERE), *args, path],
                          capture_output=True, text=True, timeout=120, cwd=tmp)
    if proc.returncode != 0:
        raise MslError(proc.stderr[-4000:])


def check_msl(source: str) -> None:
    """clang++-15 -fsyntax-only on one MSL source (MslError with the diagnostics)."""
    with tempfile.TemporaryDirectory() as tmp:
        _clang(["-fsyntax-only"], rewrite(source), ".cpp", tmp)


def _launcher(types: list[str], emitted) -> str:
    args = [f"({t}*)bufs[{i}]" for i, t in enumerate(types)]
    args += [f"sizes[{j}]" for j in range(len(emitted.sizes))]
    call = emitted.name
    thread_args = ["(uint)g", "(uint)t"] if "thread_index_in_simdgroup" not in emitted.source else \
        ["(uint)g", "(uint)t", "(uint)(t % 32)", "(uint)(t / 32)"]
    return f"""
thread_local std::barrier<>* metal::kiln_tg_barrier;
thread_local metal::KilnSimd* metal::kiln_simd;
thread_local unsigned metal::kiln_lane;
extern "C" void kiln_sim_launch(void** bufs, long* sizes, long groups, int threads) {{
  std::barrier<> tg(threads);
  std::vector<std::unique_ptr<metal::KilnSimd>> sgs;
  for (int s = 0; s * 32 < threads; ++s) sgs.emplace_back(new metal::KilnSimd(std::min(32, threads - 32 * s)));
  std::vector<std::thread> lanes;
  for (int t = 0; t < threads; ++t) lanes.emplace_back([&, t] {{
    metal::kiln_tg_barrier = &tg; metal::kiln_simd = sgs[t / 32].get(); metal::kiln_lane = t % 32;
    for (long g = 0; g < groups; ++g) {{
      {call}({", ".join(args + thread_args)});
      tg.arrive_and_wait();
    }}
  }});
  for (auto& l : lanes) l.join();
}}
"""


def build(kernel, tmp_root: str):
    """The simulator library for one legalized kernel (built once per source)."""
    emitted = emit_kernel(kernel)
    return build_emitted(emitted, [msl_type(b.dtype) for b in kernel.buffers], tmp_root)


def build_emitted(emitted, types: list[str], tmp_root: str):
    """The simulator library for an EmittedKernel whose buffers have MSL types `types`."""
    source = rewrite(emitted.source) + _launcher(types, emitted)
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    if key not in _BUILT:
        tmp = tempfile.mkdtemp(dir=tmp_root)
        _clang(["-DKILN_SIM", "-O1", "-shared", "-fPIC", "-pthread", "-o", "k.so"], source, ".cpp", tmp)
        lib = ctypes.CDLL(os.path.join(tmp, "k.so"))
        lib.kiln_sim_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_long),
                                        ctypes.c_long, ctypes.c_int]
        _BUILT[key] = (lib, emitted)
    return _BUILT[key]


def simulate(kernel, arrays: list, sizes: dict, tmp_root: str):
    """Run `kernel` (legalized) under the simulator on contiguous `arrays`, in place;
    returns the EmittedKernel (its kind, threads, vec4)."""
    return _launch(build(kernel, tmp_root), arrays, sizes)


def simulate_emitted(emitted, arrays: list, sizes: dict, tmp_root: str):
    """Run an EmittedKernel (e.g. a linear-algebra kernel) on `arrays` (their dtypes give
    the buffer types) under the simulator, in place."""
    names = {np.dtype(np.float32): "float", np.dtype(np.int32): "int", np.dtype(np.float16): "half",
             np.dtype(np.bool_): "bool"}
    return _launch(build_emitted(emitted, [names[a.dtype] for a in arrays], tmp_root), arrays, sizes)


def _launch(built, arrays: list, sizes: dict):
    lib, emitted = built
    arrays = [np.ascontiguousarray(a) for a in arrays]
    ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
    svals = (ctypes.c_long * max(1, len(emitted.sizes)))(*[int(sizes[s]) for s in emitted.sizes])
    lib.kiln_sim_launch(ptrs, svals, emitted.group_count(sizes), emitted.threads)
    return emitted, arrays


class _SimCall:
    def __init__(self, kernel, tmp_root: str):
        self.kernel, self.tmp_root = kernel, tmp_root
        self.emitted = None

    def __call__(self, arrays, sizes):
        self.emitted, _ = simulate(self.kernel, arrays, sizes, self.tmp_root)


def sim_backend(tmp_root: str):
    """A MetalBackend whose `build` runs kernels under the simulator (target "metal-sim"),
    so whole graphs compile and run through kn.compile / compile_graph; `calls` keeps
    every built kernel's launcher (its `emitted` says which kind ran)."""
    from kiln.codegen.metal.backend import MetalBackend

    class SimMetalBackend(MetalBackend):
        calls: list = []

        def __init__(self, target: str = "metal-sim", options=None):
            super().__init__("metal", options)
            self.target = target

        @classmethod
        def supports(cls, target: str) -> bool:
            return target == "metal-sim"

        def build(self, kernels):
            out = [_SimCall(k, tmp_root) for k in kernels]
            type(self).calls.extend(out)
            return out

    return SimMetalBackend
