"""The backend contract (kiln/codegen/backend.py): a toy backend registered from this test
file compiles pointwise and reduction graphs with no edit to any kiln module; options are
in every cache key; per-backend graph passes and stages; clear errors (K370-K374); a new
elementwise op with a decomposition (erfc) runs on every backend without a backend edit."""

from __future__ import annotations

import math
import pathlib
import shutil
from dataclasses import dataclass

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import artifact_cache
from kiln.codegen.backend import Backend, Options, get_backend, register_backend, unregister_backend
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.codegen.cpu.mathlib import float32_math
from kiln.errors import (
    KilnBackendContractError, KilnNotLegalizableError, KilnTemplateError, KilnUnknownBackendError,
    KilnUnknownStageError,
)
from kiln.frontend.graph_compile import compile_graph
from kiln.frontend.kernel_cache import compile_kernels
from kiln.frontend.stages import render_stage
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.types import TensorType
from tests.codegen.c_backend import CBackend

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="the toy C backend needs a C compiler (cc)")


@pytest.fixture
def c_target():
    register_backend("c", CBackend)
    yield "c"
    unregister_backend("c")


def _erfc_graph(d, n=64):
    b = GraphBuilder()
    x = b.add_input(TensorType(d, (n,)), "x")
    b.graph.body.results = [b.call("erfc", x)]
    return b.graph


# -- the toy backend: registered here, no kiln module edited ------------------------------

@needs_cc
def test_toy_c_backend_compiles_pointwise_and_reduction_graphs(c_target):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 33)).astype(np.float32)
    a[2, 3] = np.nan

    def pointwise(x, y):
        return kn.gelu(x) * y + kn.maximum(x, y), kn.clamp(x, -0.5, 0.5), kn.sign(x)

    def reductions(x):
        return kn.softmax(x, -1), x.sum(dim=0), kn.layer_norm(x, (33,))

    y = rng.standard_normal((5, 33)).astype(np.float32)
    for fn, args in ((pointwise, (a, y)), (reductions, (a,))):
        got = kn.compile(fn, backend=c_target)(*args)
        want = fn(*[kn.tensor(v) for v in args])
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-6, atol=2e-6, equal_nan=True)
    assert isinstance(get_backend(c_target), CBackend)


@needs_cc
def test_toy_c_backend_gets_integer_semantics_from_legalize(c_target):
    x = np.array([7, -7, 5, -2 ** 31, 3, 0, 2 ** 31 - 1], np.int32)
    y = np.array([2, 2, 0, -1, -2, 0, -1], np.int32)
    f = kn.compile(lambda x, y: (x // y, x % y, x ** 3, kn.abs(x)), backend=c_target)
    with np.errstate(all="ignore"):
        want = (x // y, np.where(y == 0, 0, x % np.where(y == 0, 1, y)), x ** 3, np.abs(x))
    for g, w in zip(f(x, y), want):
        np.testing.assert_array_equal(g.numpy(), w)
    text = render_stage(kn.trace(lambda x, y: x // y, x, y), "source", c_target)
    assert "void kiln_" in text and " / " in text and "INT" not in text  # C, legalized guards inline
    legal = render_stage(kn.trace(lambda x, y: x // y, x, y), "legalized", c_target)
    assert "div_unchecked(" in legal and " div(" not in legal
    with pytest.raises(KilnUnknownStageError, match="c backend has no 'asm' stage; its stages are c"):
        render_stage(kn.trace(lambda x, y: x // y, x, y), "asm", c_target)


@needs_cc
def test_toy_c_backend_rejects_what_neither_its_table_nor_legalize_covers(c_target):
    x = kn.tensor(np.ones(4, np.float32)).to(kn.bfloat16)
    with pytest.raises(KilnNotLegalizableError, match=r"c backend: scalar op '\w+' on \(bfloat16") as info:
        kn.compile(lambda x: kn.exp(x) + 1, backend=c_target)(x)
    assert info.value.code == "K372"


# -- the contract ----------------------------------------------------------------------------

def test_options_are_in_every_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    graph = kn.trace(lambda x: kn.exp(x) * 2, np.ones(8, np.float32))
    kernels = list(compile_graph(graph, "cpu", build=False).program.kernels.values())
    native, double = CpuBackend(CpuOptions(f32_math="native")), CpuBackend(CpuOptions(f32_math="double"))
    assert native.cache_key() != double.cache_key()
    before = dict(artifact_cache.STATS)
    compile_kernels(native, kernels)
    compile_kernels(double, kernels)  # another option: another entry, not a hit
    assert artifact_cache.STATS["writes"] - before["writes"] == 2
    assert artifact_cache.STATS["hits"] == before["hits"]
    compile_kernels(CpuBackend(CpuOptions(f32_math="double")), kernels)
    assert artifact_cache.STATS["hits"] == before["hits"] + 1


def test_float32_math_sets_the_option_default_not_the_code():
    with float32_math("double"):
        opts = CpuOptions()
    assert opts.f32_math == "double" and CpuOptions().f32_math == "native"
    assert "f32_math='double'" in opts.cache_text()
    with pytest.raises(kn.KilnError, match="f32_math"):
        CpuOptions(f32_math="fast")


def test_no_capability_probes_remain_in_the_frontend():
    root = pathlib.Path(kn.__file__).parent / "frontend"
    for name in ("compile.py", "stages.py"):
        assert "hasattr(" not in (root / name).read_text(), name


def test_registry_errors_and_contract_checks():
    with pytest.raises(KilnUnknownBackendError, match="unknown backend 'tpu'.*cpu, reference, cuda, rocm"):
        get_backend("tpu")
    with pytest.raises(KilnBackendContractError, match="frozen dataclass"):
        class Loose(Backend):  # noqa: F841
            @dataclass
            class Options:
                x: int = 0
    with pytest.raises(KilnBackendContractError, match="not a Backend subclass"):
        register_backend("bad", object)
    with pytest.raises(KilnUnknownStageError, match="stages are llvm, optimized, asm"):
        get_backend("cpu").stage_text(None, "ptx")
    with pytest.raises(KilnTemplateError, match="kinds are gemm, grouped_gemm"):
        get_backend("cpu").template_for("winograd")
    assert get_backend("cpu").template_for("conv") is not None  # conv_native.py
    assert get_backend("cuda").template_for("grouped_gemm") is not None
    assert get_backend("cpu").template_for("attention") is None


def test_each_backend_has_its_own_graph_passes_and_keep_set(c_target):
    graph = kn.trace(lambda a, b: a @ b, np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
    cpu = compile_graph(graph, "cpu", build=False)
    toy = compile_graph(graph, c_target, build=False)
    assert "matmul" in str(cpu.stages["decompose"])  # kept whole for the GEMM template
    assert "matmul" not in str(toy.stages["decompose"])  # no template: decomposed into loops
    assert [n for n, _ in get_backend(c_target).graph_passes()][0] == "decompose"


def test_default_options_base_is_frozen_and_describes_itself():
    @dataclass(frozen=True)
    class MyOptions(Options):
        width: int = 4

    assert MyOptions().cache_text() == "test_default_options_base_is_frozen_and_describes_itself.<locals>." \
                                       "MyOptions(width=4)"
    assert hash(MyOptions()) == hash(MyOptions(width=4))


# -- a new op with a decomposition needs no backend edit -------------------------------------

@pytest.mark.parametrize("d, rtol", [(dt.float32, 4e-7), (dt.float64, 1e-13), (dt.bfloat16, 0.0)])
def test_erfc_runs_on_cpu_through_its_decomposition(d, rtol):
    graph = _erfc_graph(d)
    x = np.concatenate([np.linspace(-6, 10, 60), [0.0, np.inf, -np.inf, np.nan]]).astype(d.np_dtype)
    (got,) = compile_graph(graph, "cpu").run([x])
    want = np.asarray(np.frompyfunc(math.erfc, 1, 1)(x.astype(np.float64)), np.float64)
    # erfc(10) ~ 2e-45: float32 flushes it like numpy's rounding of the exact value
    np.testing.assert_allclose(got.astype(np.float64), want.astype(d.np_dtype).astype(np.float64),
                               rtol=rtol, atol=1e-44 if d == dt.float32 else 0, equal_nan=True)
    assert "erfc" not in render_stage(graph, "legalized", "cpu")


def test_erfc_compiles_ahead_of_time_for_cuda_and_rocm_without_a_backend_edit():
    graph = _erfc_graph(dt.float32)
    source = render_stage(graph, "source", "cuda")
    assert "erfc" not in source and "libdevice.exp" in source
    pytest.importorskip("triton", reason="ahead-of-time PTX/AMDGCN needs the triton package")
    assert ".entry" in render_stage(graph, "asm", "cuda")
    assert "s_endpgm" in render_stage(graph, "asm", "rocm")
