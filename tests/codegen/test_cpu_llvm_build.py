"""What the CPU backend hands LLVM, sized for a fast build: loops around loops are not
unrolled (`llvm.loop.unroll.disable`), nor reductions of a constant length (which LLVM
would unroll before vectorizing), a column kernel loads only the reductions an expression
reads, and code generation runs without loop strength reduction. Each is checked on the
emitted or optimized IR and numerically."""

import re

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import CpuBackend, CpuOptions, jit
from kiln.codegen.cpu.column_reduce import column_friendly
from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, const
from kiln.codegen.kernel_ir import (
    IN, OUT, BufferParam, Kernel, Load, Loop, Reduce, ReduceRef, Store, loop_var,
)
from kiln.ir import dtypes as dt

from kiln.frontend.graph_compile import compile_graph
from kiln.runtime.executor import Executable

from tests.codegen.cpu_helpers import check
from tests.codegen.ir_builders import op

o0, r0, r1 = loop_var("o0"), loop_var("r0"), loop_var("r1")
F32 = dt.float32


def _nest(unroll_nested: bool) -> str:
    module = Module()
    fn = Fn(module)
    outer = CountedLoop(fn, const("i64", 0), const("i64", 16), vectorize=False,
                        unroll_nested=unroll_nested)
    outer.begin()
    inner = CountedLoop(fn, const("i64", 0), const("i64", 64), unroll_nested=unroll_nested)
    inner.begin()
    inner.end()
    outer.end()
    return "\n".join(module.metadata)


def test_unroll_disable_only_on_loops_around_loops():
    text = _nest(unroll_nested=False)
    loops = re.findall(r"^!(\d+) = distinct !\{!\d+((?:, !\d+)*)\}$", text, re.M)
    assert len(loops) == 2
    hints = dict(re.findall(r"^!(\d+) = (!\{.*\})$", text, re.M))
    inner, outer = ([hints[h.strip(" !")] for h in refs.split(",") if h.strip()] for _, refs in loops)
    assert not any("unroll" in h for h in inner)
    assert '!{!"llvm.loop.unroll.disable"}' in outer
    assert '!{!"llvm.loop.vectorize.enable", i1 false}' in outer
    assert "unroll" not in _nest(unroll_nested=True)  # the default: LLVM decides


def _rows_kernel(reductions: int, cols: int = 200) -> Kernel:
    """Column sums over a 16 x 32 grid of rows (a bias gradient of a [16, 32, C] tensor),
    `reductions` of them fused; store k reads reduction k only (an AdamW-like epilogue)."""
    loops = (Loop("r0", 16), Loop("r1", 32))
    stages, bufs = [], [BufferParam("x", F32, (16, 32, cols), IN)]
    for k in range(reductions):
        value = op("mul", Load("x", cols * 32 * r0 + cols * r1 + o0, F32), Load("x", o0, F32)) if k else \
            Load("x", cols * 32 * r0 + cols * r1 + o0, F32)
        stages.append(Reduce(f"s{k}", "sum", loops, value, F32))
    for k in range(reductions):
        stages.append(Store(f"y{k}", o0, op("add", ReduceRef(f"s{k}", F32), Load("x", o0, F32))))
        bufs.append(BufferParam(f"y{k}", F32, (cols,), OUT))
    return Kernel("rows", tuple(bufs), (), (Loop("o0", cols),), tuple(stages))


def test_column_reduction_row_loops_are_not_unrolled():
    """Unrolling the constant 16 x 32 row loops around the vectorized column loop copied
    that loop (with its remainder and epilogue) 16 times per reduction."""
    k = _rows_kernel(2)
    assert column_friendly(k)
    optimized = CpuBackend().stage_text(k, "optimized")
    bodies = len(re.findall(r"^vector\.body\d*:", optimized, re.M))
    assert 1 <= bodies <= 6, bodies  # 2 init + 2 accumulate + 2 store loops at most
    check(k, {}, rtol=1e-5, atol=1e-4)


def test_column_stores_load_only_the_reductions_they_read():
    """Store k reads reduction k: one load of the accumulators per store, not one per
    finished reduction (which made a 14-reduction AdamW kernel O(n^2) in IR)."""
    n = 6
    k = _rows_kernel(n)
    text = CpuBackend().stage_text(k, "llvm")
    # float32 sums accumulate in float64: every read of a finished sum is one fptrunc
    assert len(re.findall(r"= fptrunc double", text)) == n
    rng = np.random.default_rng(1)
    check(k, {}, rtol=1e-4, atol=1e-4, seed=int(rng.integers(100)))


def test_build_cost_weighs_vectorized_loops(monkeypatch):
    """The partition's estimate: a kernel's vectorized loops cost LLVM more than their
    text suggests (each becomes a vector body, remainder and epilogue)."""
    from kiln.codegen.cpu import parallel_build as pb

    monkeypatch.setattr(pb, "MIN_PART_CHARS", 1)  # split even these small kernels
    text = CpuBackend().stage_text(_rows_kernel(6), "llvm")
    loops = text.count(pb.VECTOR_HINT)
    assert loops == 3  # clear the accumulators, accumulate the six sums, the six stores
    assert pb.build_cost(text) == len(text) + loops * pb.CHARS_PER_VECTOR_LOOP + pb.CHARS_PER_KERNEL
    # a text longer by half its loops' weight but without loops: by length alone it would
    # fill a module by itself and the two kernels would share the other; by cost it is
    # the lighter item, and the two kernels are kept apart
    plain = "x" * (len(text) + loops * pb.CHARS_PER_VECTOR_LOOP // 2)
    assert pb.build_cost(plain) < pb.build_cost(text)
    groups = pb.partition([text, text, plain], pb.build_cost, 2)
    assert sorted(groups, key=len) == [[text], [text, plain]]
    assert sorted(pb.partition([text, text, plain], len, 2), key=len) == [[plain], [text, text]]


def test_column_stages_share_loops_where_independent():
    """Consecutive stores share one column loop; consecutive reductions over the same
    rows share one row nest unless one reads another (mean, then the variance around
    it); the numerics are the evaluator's."""
    from kiln.codegen.cpu.column_reduce import stage_groups

    k = _rows_kernel(4)
    assert [len(g) for g in stage_groups(k.stages)] == [4, 4]
    x = Load("x", 200 * 32 * r0 + 200 * r1 + o0, F32)
    loops = (Loop("r0", 16), Loop("r1", 32))
    mean = op("div", ReduceRef("m", F32), Load("x", 0, F32))
    chained = Kernel("mv", (BufferParam("x", F32, (16, 32, 200), IN), BufferParam("v", F32, (200,), OUT),
                            BufferParam("w", F32, (200,), OUT)), (), (Loop("o0", 200),),
                     (Reduce("m", "sum", loops, x, F32), Reduce("s", "sum", loops, op("mul", x, x), F32),
                      Reduce("q", "sum", loops, op("mul", op("sub", x, mean), op("sub", x, mean)), F32),
                      Store("v", o0, ReduceRef("q", F32)), Store("w", o0, ReduceRef("s", F32))))
    assert column_friendly(chained)
    assert [[st.name if isinstance(st, Reduce) else st.buffer for st in g]
            for g in stage_groups(chained.stages)] == [["m", "s"], ["q"], ["v", "w"]]
    check(chained, {}, rtol=1e-4, atol=1e-3, low=0.5, high=2.0)
    check(k, {}, rtol=1e-4, atol=1e-4)


def _small_batch():
    """(f, its arguments, the BatchKernel its three small independent kernels share)."""
    import kiln as kn
    from kiln.codegen.build_program import build_program
    from kiln.codegen.kernel_ir import BatchKernel
    from kiln.passes.batching import batch_kernels
    from kiln.passes.fusion import fuse

    def f(a, b, c):
        return kn.exp(a), b.sum(dim=1), kn.tanh(c) * 2

    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(8,), (4, 3), (5,)]]
    program = build_program(batch_kernels(fuse(kn.trace(f, *args))))
    (batch,) = [k for k in program.kernels.values() if isinstance(k, BatchKernel)]
    return f, args, batch


def test_batch_members_have_no_abi_wrappers():
    """A batch's members are called by its entry only: their `.body` functions are
    emitted, their exported wrappers (two per member, each unpacking every buffer) are
    not. The batch still runs like numpy."""
    import kiln as kn

    f, args, batch = _small_batch()
    text = CpuBackend().stage_text(batch, "llvm")
    defined = re.findall(r"^define (?:internal )?void @([\w.]+)\(", text, re.M)
    members = [d for d in defined if "_m" in d]
    assert sorted(members) == sorted(f"{m}.body" for m in {d.rsplit(".", 1)[0] for d in members})
    assert len(members) == len(batch.members) == 3
    assert len(defined) == 3 + 2  # the members' bodies, the entry and its `.np` twin
    got = kn.compile(f)(*args)
    for g, want in zip(got, (np.exp(args[0]), args[1].sum(1), np.tanh(args[2]) * 2)):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)


def _function_asm(asm: str) -> dict[str, str]:
    """Each function's instructions in an assembly listing (directives and comments out)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in asm.splitlines():
        m = re.match(r"^([A-Za-z_][\w.$]*):", line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None and line.strip() and not line.strip().startswith(("#", ".")):
            current.append(line.strip())
    return {name: "\n".join(lines) for name, lines in out.items()}


def test_entries_are_built_without_optimization_and_bodies_are_unchanged():
    """Exported entries (a kernel's ABI wrapper and its `.np` twin, a batch's entry) only
    unpack pointers and call bodies: they are `optnone` (FastISel, no IR passes), which
    saves LLVM ~0.8 ms per function. Oracle: the same module with optimized entries gives
    every `.body` byte-identical machine code; the kernels still run like the evaluator."""
    import kiln as kn
    from kiln.codegen.cpu import jit
    from kiln.codegen.cpu.llvm_emit import WRAPPER_ATTRS

    f, args, batch = _small_batch()
    for kernel in (_rows_kernel(3), batch):
        text = CpuBackend().stage_text(kernel, "llvm")
        entries = re.findall(r"^define void @([\w.]+)\(.*\) (.*) \{$", text, re.M)
        assert len(entries) == 2 and all(attrs == WRAPPER_ATTRS for _, attrs in entries)
        assert "optnone" in WRAPPER_ATTRS and "optnone" not in "".join(re.findall(r"^define internal .*$", text, re.M))
        optimized = text.replace(f") {WRAPPER_ATTRS} {{", ") nounwind {")
        built = []
        for t in (text, optimized):
            mod = jit.parse(t)
            jit.optimize(mod)
            built.append(_function_asm(jit.assembly(mod)))
        bodies = [name for name in built[1] if name.endswith(".body")]
        assert len(bodies) == (len(batch.members) if kernel is batch else 1)
        for name in bodies:
            assert built[0][name] == built[1][name], name
    check(_rows_kernel(3), {}, rtol=1e-4, atol=1e-4)
    got = kn.compile(f)(*args)
    for g, want in zip(got, (np.exp(args[0]), args[1].sum(1), np.tanh(args[2]) * 2)):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)


def test_micro_gemm_text_is_weighted_in_the_build_cost():
    """A micro-kernel GEMM's unrolled tile costs LLVM less per character than loop code
    (the fit in parallel_build): its emitted module carries MICRO_TEXT_WEIGHT, and
    module_cost weighs its length by it; other kernels' modules weigh 1."""
    import kiln as kn
    from kiln.codegen.cpu import parallel_build as pb
    from kiln.codegen.kernel_ir import GemmKernel
    from kiln.frontend.graph_compile import compile_graph

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in [(32, 16), (16, 24)])
    program = compile_graph(kn.trace(lambda a, b: kn.relu(a @ b) + 1, x, w), "cpu", build=False).program
    backend = CpuBackend()
    kernels = [backend.legalize(k) for k in program.kernels.values()]
    plans = [backend._plan(k, set(), "micro" if isinstance(k, GemmKernel) else None) for k in kernels]
    assert any(p.micro for p in plans)
    for plan, module in zip(plans, backend._parts(plans)):
        text = backend._joined([module])
        weight = pb.MICRO_TEXT_WEIGHT if plan.micro else 1.0
        assert module.text_weight == weight
        assert pb.module_cost(module, backend._joined) == pb.build_cost(text, weight) == \
            int(len(text) * weight) + pb.CHARS_PER_VECTOR_LOOP * text.count(pb.VECTOR_HINT) + pb.CHARS_PER_KERNEL
    assert 0 < pb.MICRO_TEXT_WEIGHT < 1


def test_codegen_runs_without_lsr_and_sets_the_option_back():
    """While kiln generates code, LLVM's -disable-lsr is on (counted over threads); after
    the last build it is back to LLVM's default for other llvmlite users. A kernel with
    many address streams (LSR's costly case) compiles to smaller code without it."""
    import llvmlite.binding as llvm

    rng = np.random.default_rng(1)
    cols = [rng.standard_normal((8, 16, 64)).astype(np.float32) for _ in range(6)]
    program = compile_graph(kn.trace(lambda *xs: [x.sum(dim=(0, 1)) for x in xs], *cols),
                            "cpu", build=False).program
    backend = CpuBackend(CpuOptions(threads=1))
    ks = list(program.kernels.values())
    blob = backend.object_code(ks)
    assert jit._lsr_users == 0
    compiled = dict(zip(program.kernels, backend.load_object_code(ks, blob)))
    for got, x in zip(Executable(program, compiled).run(cols, {}), cols):
        np.testing.assert_allclose(got, x.sum((0, 1)), rtol=1e-4, atol=1e-4)
    text = backend._module_text([backend._plan(backend.legalize(k), set()) for k in ks])
    sizes = []
    for disable in (False, True):  # the option as a plain emit sees it, then kiln's scope
        mod = jit.parse(text)
        jit.optimize(mod)
        if disable:
            sizes.append(len(jit.object_code(mod)))
        else:
            sizes.append(len(jit.target_machine(3).emit_object(mod)))
    assert sizes[1] < sizes[0]
    assert jit._lsr_users == 0
    llvm.set_option("kiln", "-disable-lsr=false")  # (what the scope leaves, stated)


def test_the_lsr_scope_is_left_on_an_error():
    with pytest.raises(RuntimeError):
        with jit._no_codegen_lsr():
            assert jit._lsr_users == 1
            raise RuntimeError("boom")
    assert jit._lsr_users == 0


def test_a_row_sum_of_constant_length_is_vectorized_not_unrolled():
    """LLVM fully unrolled a 64-long row sum before its vectorizer saw it (a chain of 64
    dependent scalar adds, 2x slower); the loop now says `unroll.disable` with the
    vectorizer's usual four accumulators."""
    x = np.random.default_rng(2).standard_normal((512, 64)).astype(np.float32)
    program = compile_graph(kn.trace(lambda t: (t * t).sum(-1), x), "cpu", build=False).program
    backend = CpuBackend(CpuOptions(threads=1))
    (kernel,) = [backend.legalize(k) for k in program.kernels.values()]
    emitted = backend.render(kernel, "llvm")
    assert re.search(r'"llvm.loop.interleave.count", i32 4', emitted)
    assert '"llvm.loop.vectorize.followup_vectorized"' in emitted
    optimized = backend.render(kernel, "optimized")
    body = re.search(r"define [^@]*@[\w.]+\.body\(.*?\n}\n", optimized, re.S).group(0)
    assert re.search(r"load <\d+ x float>", body)
    assert len(re.findall(r"load float,", body)) < 16
    out = kn.compile(lambda t: (t * t).sum(-1))(x)
    np.testing.assert_allclose(out.numpy(), (x.astype(np.float64) ** 2).sum(-1), rtol=1e-5)


def test_a_long_float32_sum_keeps_its_vector_loop_unrolled():
    """unroll.disable holds for a reduction before it is vectorized and for its scalar
    remainder, not for its vector loop (followup_vectorized): a 1024-long block of a
    float32 sum still runs as straight-line vector code (25% faster over 2^25 elements
    than the same loop kept rolled)."""
    x = np.random.default_rng(3).standard_normal((64, 4096)).astype(np.float32)
    program = compile_graph(kn.trace(lambda t: (t * t).sum(-1), x), "cpu", build=False).program
    backend = CpuBackend(CpuOptions(threads=1))
    (kernel,) = [backend.legalize(k) for k in program.kernels.values()]
    optimized = backend.render(kernel, "optimized")
    body = re.search(r"define [^@]*@[\w.]+\.body\(.*?\n}\n", optimized, re.S).group(0)
    assert len(re.findall(r"load <\d+ x float>", body)) >= 16
    out = kn.compile(lambda t: (t * t).sum(-1))(x)
    np.testing.assert_allclose(out.numpy(), (x.astype(np.float64) ** 2).sum(-1), rtol=1e-5)
