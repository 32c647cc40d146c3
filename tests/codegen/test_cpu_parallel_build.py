"""Object code built as several LLVM modules on threads at once (cpu/parallel_build.py):
the same answers as numpy, one payload of several ELF objects that the cache validates
part by part, and a malformed object list refused."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import artifact_cache, cache_elf
from kiln.codegen.cpu import parallel_build
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.frontend.graph_compile import compile_graph


def many_kernels(x, w):
    h = kn.gelu(x @ w, approximate="tanh")
    a = kn.softmax(h, dim=-1)
    b = kn.layer_norm(h, (h.shape[-1],))
    c = (kn.exp(h) * kn.sin(h)).sum(dim=0)
    return a, b, c, kn.tanh(a + b).max(dim=-1)[0]


def oracle(x, w):
    z = x @ w
    h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    e = np.exp(h - h.max(-1, keepdims=True))
    a = e / e.sum(-1, keepdims=True)
    b = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    return a, b, (np.exp(h) * np.sin(h)).sum(0), np.tanh(a + b).max(-1)


@pytest.fixture
def kernels():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 24)).astype(np.float32)
    w = rng.standard_normal((24, 32)).astype(np.float32) / 5
    program = compile_graph(kn.trace(many_kernels, x, w), "cpu", build=False).program
    return x, w, program


def test_parts_are_packed_and_run_like_numpy(kernels, monkeypatch):
    x, w, program = kernels
    monkeypatch.setattr(parallel_build, "MIN_PART_CHARS", 1)  # split even a small program
    backend = CpuBackend(CpuOptions(threads=3))
    ks = list(program.kernels.values())
    blob = backend.object_code(ks)
    parts = cache_elf.unpack_objects(blob)
    assert len(parts) == min(3, len(ks)) >= 2
    artifact_cache.VALIDATORS["objects"](blob)  # every part is checked as an ELF object
    compiled = dict(zip(program.kernels, backend.load_object_code(ks, blob)))
    from kiln.runtime.executor import Executable

    outputs = Executable(program, compiled).run([x, w], {})
    for got, want in zip(outputs, oracle(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_kernels_emitted_once_join_into_the_one_module_text(kernels):
    """The parallel build emits each kernel once and joins the texts of any grouping: the
    join of all of them is the text one module emits (helpers such as the float32 exp and
    tanh bodies defined once, loop metadata renumbered after the earlier kernels')."""
    import re

    from kiln.codegen.cpu.backend import _distinct

    _, _, program = kernels
    backend = CpuBackend(CpuOptions(threads=2))
    taken: set = set()
    legal = [backend.legalize(k) for k in program.kernels.values()]
    plans = [backend._plan(k, taken) for k in _distinct(legal)[0]]
    parts = backend._parts(plans)
    joined = backend._joined(parts)
    assert joined == backend._module_text(plans)
    assert sum(re.findall(r"define internal float @(kiln\.\w+\.f32\w*)\(", backend._joined([p])) != []
               for p in parts) >= 2  # several kernels carry the same helper...
    names = re.findall(r"define internal float @(kiln\.\w+\.f32\w*)\(", joined)
    assert names and len(names) == len(set(names))  # ...defined once in the join
    ids = re.findall(r"^!(\d+) = ", joined, re.M)
    assert len(ids) == len(set(ids)) and ids  # metadata numbers stay unique
    from kiln.codegen.cpu import jit

    for group in (parts[::2], parts[1::2]):  # any grouping parses as a module
        jit.parse(backend._joined(group))


def test_partition_balances_and_keeps_order():
    plans = list(range(10))
    groups = parallel_build.partition(plans, lambda p: (p + 1) * 100_000, 3)
    assert sorted(p for g in groups for p in g) == plans
    assert all(g == sorted(g) for g in groups)
    loads = [sum((p + 1) for p in g) for g in groups]
    assert max(loads) - min(loads) <= 10  # LPT: within the largest item
    assert parallel_build.partition(plans, lambda p: 10, 4) == [plans]  # too small to split


@pytest.mark.parametrize("spoil", [
    lambda b: b[:20],
    lambda b: b[:8] + (1).to_bytes(4, "little") + b[12:],
    lambda b: b[:8] + (300).to_bytes(4, "little") + b[12:],
    lambda b: b + b"x",
], ids=["truncated", "one-part", "too-many", "trailing"])
def test_malformed_object_list_is_refused(spoil):
    blob = cache_elf.pack_objects([b"\x7fELF" + b"a" * 60, b"\x7fELF" + b"b" * 70])
    assert cache_elf.unpack_objects(blob) == [b"\x7fELF" + b"a" * 60, b"\x7fELF" + b"b" * 70]
    with pytest.raises(cache_elf.BadObject):
        cache_elf.unpack_objects(spoil(blob))


def test_modules_parsed_on_the_build_threads_report_bad_ir():
    """A build thread parses its module outside llvmlite's lock: a malformed module still
    fails with LLVM's parse error, and good modules built at once give ELF objects."""
    from kiln.codegen.cpu import jit

    good = "define i32 @f(i32 %x) {\n  %y = add i32 %x, 1\n  ret i32 %y\n}\n"
    objects = jit.object_codes([good, good.replace("@f", "@g")], 3)
    assert len(objects) == 2 and all(o[:4] == b"\x7fELF" for o in objects)
    with pytest.raises(RuntimeError, match="parsing error"):
        jit.object_codes([good, "define void @h() {\n  ret i32 0\n}\n"], 3)
