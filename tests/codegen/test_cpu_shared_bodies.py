"""Kernel bodies that differ only in integer constants compiled once (cpu/shared_bodies.py):
which bodies are twins, checked on the text handed to LLVM, and what the shared code
computes, against the constants each kernel had and against numpy."""

import ctypes
import re

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import jit
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions, _distinct
from kiln.codegen.cpu.ir_builder import Module, join_modules
from kiln.codegen.cpu.shared_bodies import merge_twins, part_key, share_module
from kiln.frontend.graph_compile import compile_graph
from kiln.runtime.executor import Executable


def _part(name: str, body_lines: list[str], meta: list[str] = ()) -> Module:
    """A one-kernel module: `name.body(out, x)` and an exported `name(out, x)` calling it."""
    m = Module()
    m.functions.append(f"define internal void @{name}.body(ptr noalias %b0, i64 %x) noinline nounwind {{\n"
                       "entry:\n" + "\n".join(body_lines) + "\n  ret void\n}")
    m.functions.append(f"define void @{name}(ptr %p, i64 %x) noinline nounwind {{\n"
                       f"  call void @{name}.body(ptr %p, i64 %x)\n  ret void\n}}")
    m.metadata = list(meta)
    return m


def _scale_body(k: int) -> list[str]:
    return [f"  %v1 = mul i64 %x, {k}", f"  %v2 = add i64 %v1, {k + 1}", "  store i64 %v2, ptr %b0, align 8"]


def _run(parts: list[Module], names: list[str], x: int) -> list[int]:
    jitted = jit.Jitted(objects=(jit._compile_alone(join_modules(parts), 3),))
    out = []
    for name in names:
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(jitted.address(name))
        cell = np.zeros(1, np.int64)
        fn(cell.ctypes.data, x)
        out.append(int(cell[0]))
    return out


def test_constant_twins_share_one_body_and_keep_their_constants():
    parts = [_part("k_a", _scale_body(64)), _part("k_b", _scale_body(65)), _part("k_c", _scale_body(7))]
    assert part_key(parts[0]) == part_key(parts[1]) == part_key(parts[2]) is not None
    merged = merge_twins(parts)
    assert len(merged) == 1
    text = join_modules(merged)
    # one body with the differing constants as trailing parameters (two columns of values)
    shared = re.findall(r"define internal void @([\w.]+\.shared)\(([^)]*)\)", text)
    assert len(shared) == 1 and shared[0][1].count("%kiln.k") == 2
    assert "noduplicate" in text  # IPSCCP must not clone it back per constant
    assert _run(merged, ["k_a", "k_b", "k_c"], 3) == [3 * 64 + 65, 3 * 65 + 66, 3 * 7 + 8]


def test_exact_twins_share_without_parameters():
    merged = merge_twins([_part("k_a", _scale_body(5)), _part("k_b", _scale_body(5))])
    text = join_modules(merged)
    assert re.findall(r"@k_a\.body\.shared\(ptr noalias %b0, i64 %x\)", text)
    assert _run(merged, ["k_a", "k_b"], 2) == [2 * 5 + 6] * 2


@pytest.mark.parametrize("body_of", [
    # a differing literal inside a vector constant cannot become a register
    lambda k: [f"  %v1 = add <2 x i64> zeroinitializer, <i64 1, i64 {k}>",
               "  %v2 = extractelement <2 x i64> %v1, i64 1", "  store i64 %v2, ptr %b0, align 8"],
    # nor an alloca's element count (a type)
    lambda k: [f"  %v1 = alloca [{k} x i64], align 8", "  store i64 %x, ptr %b0, align 8"],
    # nor an alignment
    lambda k: [f"  store i64 %x, ptr %b0, align {k}"],
])
def test_twins_differing_where_a_register_cannot_stand_stay_apart(body_of):
    parts = [_part("k_a", body_of(8)), _part("k_b", body_of(16))]
    merged = merge_twins(parts)
    assert merged == parts and ".shared" not in join_modules(merged)


def test_loop_metadata_must_match_too():
    loop = ["  br label %l", "l:", "  %i = phi i64 [ 0, %entry ], [ %j, %l ]", "  %j = add i64 %i, {k}",
            "  %c = icmp slt i64 %j, %x", "  br i1 %c, label %l, label %e, !llvm.loop !0", "e:",
            "  store i64 %j, ptr %b0, align 8"]
    meta = lambda flag: ["!0 = distinct !{!0, !1}", f'!1 = !{{!"llvm.loop.vectorize.enable", i1 {flag}}}']
    a = _part("k_a", [line.format(k=1) for line in loop], meta("true"))
    b = _part("k_b", [line.format(k=2) for line in loop], meta("false"))
    c = _part("k_c", [line.format(k=3) for line in loop], meta("true"))
    merged = merge_twins([a, b, c])
    assert len(merged) == 2  # a and c share; b's loop asks for something else
    assert _run(merged, ["k_a", "k_b", "k_c"], 10) == [10, 10, 12]


def test_batch_members_that_are_twins_share_inside_their_module():
    m = Module()
    for name, k in (("b_m0", 3), ("b_m1", 4)):
        m.functions.append(f"define internal void @{name}.body(ptr noalias %b0, i64 %x) noinline nounwind {{\n"
                           "entry:\n" + "\n".join(_scale_body(k)) + "\n  ret void\n}")
    m.functions.append("define void @b(ptr %p, ptr %q, i64 %x) noinline nounwind {\n"
                       "  call void @b_m0.body(ptr %p, i64 %x)\n  call void @b_m1.body(ptr %q, i64 %x)\n"
                       "  ret void\n}")
    share_module(m)
    text = join_modules([m])
    assert len(re.findall(r"define internal void @[\w.]+\.shared\(", text)) == 1
    jitted = jit.Jitted(objects=(jit._compile_alone(text, 3),))
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(jitted.address("b"))
    p, q = np.zeros(1, np.int64), np.zeros(1, np.int64)
    fn(p.ctypes.data, q.ctypes.data, 5)
    assert (int(p[0]), int(q[0])) == (5 * 3 + 4, 5 * 4 + 5)


def two_products(a, b, c, d, e, f):
    # the same shapes of code three times over: GEMMs and broadcast adds that differ in
    # one extent, which makes their kernels constant-only twins
    return a @ b + 1.0, c @ d + 1.0, e + f[None, :], a[:, :20] + b[0][None, :]


def _oracle(a, b, c, d, e, f):
    return a @ b + 1.0, c @ d + 1.0, e + f[None, :], a[:, :20] + b[0][None, :]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_program_of_twins_builds_shared_bodies_and_matches_numpy(threads):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((48, 40), (40, 20), (48, 40), (40, 28), (48, 24), (24,))]
    program = compile_graph(kn.trace(two_products, *arrays), "cpu", build=False).program
    backend = CpuBackend(CpuOptions(threads=threads))
    ks = list(program.kernels.values())
    legal = [backend.legalize(k) for k in ks]
    taken: set = set()
    parts = backend._parts([backend._plan(k, taken) for k in _distinct(legal)[0]])
    merged = merge_twins(parts)
    assert len(merged) < len(parts)  # some kernels were twins
    assert ".shared(" in backend._joined(merged)
    blob = backend.object_code(ks)
    compiled = dict(zip(program.kernels, backend.load_object_code(ks, blob)))
    outputs = Executable(program, compiled).run(arrays, {})
    for got, want in zip(outputs, _oracle(*arrays)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
