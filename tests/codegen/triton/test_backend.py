"""The Triton backend as kiln sees it: target names, options, backend lookup, named stages,
`kiln dump --target cuda|rocm` on an exported .kir, and the clear error (K165) where no
GPU can run the kernels."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.backends import get_backend
from kiln.codegen.triton import runtime
from kiln.codegen.triton.backend import STAGES, TritonBackend, TritonOptions
from kiln.codegen.triton.targets import KilnNoGpuError, resolve_arch, split_spec, supports
from kiln.errors import KilnArgumentError, KilnDTypeError
from tests.codegen.triton import kernels as K
from tests.codegen.triton.conftest import ROOT
from tests.cli_helpers import kiln_cli

def _triton():
    return pytest.importorskip("triton", reason="this test compiles with the triton package")


def test_target_specs():
    assert split_spec("cuda") == ("cuda", None) and split_spec("rocm:gfx950") == ("rocm", "gfx950")
    assert split_spec("sm_100") == ("cuda", "sm_100") and split_spec("gfx90a") == ("rocm", "gfx90a")
    assert resolve_arch("cuda") == "sm_90" and resolve_arch("rocm") == "gfx942"
    assert resolve_arch("cuda:sm_80") == "sm_80"
    for bad in ("cuda:gfx942", "rocm:sm_90", "metal", "cuda:sm_75", "cpu"):
        assert not supports(bad)
    with pytest.raises(KilnArgumentError, match="has no architecture 'gfx942'") as info:
        split_spec("cuda:gfx942")
    assert "cuda:ARCH" in str(info.value)


def test_backend_lookup_and_options():
    backend = get_backend("cuda")
    assert isinstance(backend, TritonBackend) and backend.arch == "sm_90" and backend.supports("rocm")
    assert get_backend("rocm").arch == "gfx942" and get_backend("cuda:sm_100").arch == "sm_100"
    assert get_backend("cuda") is get_backend("cuda")
    assert TritonBackend("rocm", TritonOptions(arch="gfx950")).arch == "gfx950"
    assert hash(TritonOptions()) == hash(TritonOptions()) and TritonBackend.stages == STAGES
    with pytest.raises(KilnArgumentError, match="unknown arch"):
        TritonOptions(arch="sm_75")
    with pytest.raises(KilnArgumentError, match="f32_matmul"):
        TritonOptions(f32_matmul="fp16")
    with pytest.raises(KilnArgumentError, match="not a cuda architecture"):
        TritonBackend("cuda", TritonOptions(arch="gfx942"))
    with pytest.raises(KilnArgumentError, match="name different architectures"):
        TritonBackend("cuda:sm_80", TritonOptions(arch="sm_90"))
    with pytest.raises(KilnArgumentError, match="unknown backend 'tpu'"):
        get_backend("tpu")


def test_import_kiln_does_not_import_triton():
    code = "import sys, kiln; from kiln.codegen.backends import get_backend; b = get_backend('cuda'); " \
           "b.stage_text  # noqa\nprint('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_source_stage_needs_no_triton_and_names_every_argument():
    backend = TritonBackend("cuda")
    text = backend.stage_text(K.softmax(33), "source")
    assert "@triton.jit\ndef kiln_softmax_33(x, y, size_B, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):" in text
    e = backend.emit(K.softmax(33))
    assert list(e.signature) == ["x", "y", "size_B", "XBLOCK", "RBLOCK"] and e.signature["size_B"] == "i64"
    assert runtime.grid_size(e, {"B": 9}) == -(-9 // e.constexprs["XBLOCK"])
    with pytest.raises(KilnArgumentError, match="unknown stage 'ptx'"):
        backend.stage_text(K.softmax(33), "ptx")


def test_fast_math_and_tf32_change_the_source():
    exact, fast = TritonBackend("cuda"), TritonBackend("cuda", TritonOptions(fast_math=True))
    assert "tl.div_rn" in exact.emit(K.softmax(33)).source and "libdevice.exp" in exact.emit(K.softmax(33)).source
    src = fast.emit(K.softmax(33)).source
    assert "tl.div_rn" not in src and "tl.exp(" in src
    tf32 = TritonBackend("cuda", TritonOptions(f32_matmul="tf32")).emit(K.gemm()).source
    assert 'input_precision="tf32"' in tf32


def test_float8_e4m3_on_sm80_is_a_dtype_error():
    from kiln.ir import dtypes as dt

    with pytest.raises(KilnDTypeError, match="sm_89"):
        TritonBackend("cuda:sm_80").emit(K.low_precision(dt.float8_e4m3fn))


def test_backend_stages(tmp_path, monkeypatch):
    _triton()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    backend = TritonBackend("rocm")
    kernel = K.pointwise()
    assert backend.stage_text(kernel, "ttir").startswith("#loc") or "tt.func" in backend.stage_text(kernel, "ttir")
    assert "ttg." in backend.stage_text(kernel, "ttgir")
    assert "define amdgpu_kernel void @kiln_pointwise" in backend.stage_text(kernel, "llir")
    assert "gfx942" in backend.stage_text(kernel, "asm")


def test_compile_without_a_gpu_is_a_clear_error():
    _triton()
    if runtime.device_target("cuda") is not None:
        pytest.skip("this machine has an NVIDIA GPU")
    with pytest.raises(KilnNoGpuError) as info:
        TritonBackend("cuda").compile_many([K.pointwise()])
    message = str(info.value)
    assert message.startswith("[K165]") and "NVIDIA" in message and "TRITON_INTERPRET=1" in message
    assert "kiln dump" in message
    f = kn.compile(lambda x: kn.exp(x) + 1, backend="rocm")
    with pytest.raises(KilnNoGpuError, match="AMD GPUs"):
        f(kn.ones(4))


# -- kiln dump --target cuda|rocm -------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported_kir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kir") / "net.kir"
    kn.export(lambda x, w, b: kn.softmax(kn.relu(x @ w + b), dim=-1),
              (kn.randn(4, 32, seed=0), kn.randn(32, 16, seed=1), kn.randn(16, seed=2))).save(path)
    return path


def test_kiln_dump_source_for_cuda(exported_kir):
    code, out, err = kiln_cli("dump", exported_kir, "--stage", "source", "--target", "cuda")
    assert code == 0, err
    assert out.count("# ---- kernel ") == 2 and out.count("@triton.jit") >= 2
    assert "tl.dot(" in out and "tl.reduce(" in out  # the GEMM with its epilogue, then the softmax


def test_kiln_dump_asm_for_rocm_and_ptx(exported_kir, tmp_path, monkeypatch):
    _triton()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    code, out, err = kiln_cli("dump", exported_kir, "--stage", "asm", "--target", "rocm")
    assert code == 0, err
    assert out.startswith("; ---- kernel ") and "gfx942" in out and "v_mfma" in out and "s_endpgm" in out
    code, out, err = kiln_cli("dump", exported_kir, "--stage", "ttgir", "--target", "cuda:sm_90")
    assert code == 0 and out.startswith("// ---- kernel ") and "tt.dot" in out and "#ttg.blocked" in out, err
    code, out, err = kiln_cli("dump", exported_kir, "--stage", "ttgir", "--target", "cpu")
    assert code == 2 and "unknown stage 'ttgir'" in err


def test_kiln_dump_unknown_target(exported_kir):
    code, _, err = kiln_cli("dump", exported_kir, "--stage", "source", "--target", "cuda:sm_75")
    assert code == 2 and "sm_75" in err


# -- device buffers (what a GPU run uses; checked here only where no GPU is needed) ----------------

def test_interpreter_is_off_in_this_process():
    _triton()
    assert not runtime.interpreter_active()  # the AOT tests need compiled triton here


def test_numpy_views_for_the_interpreter_share_memory():
    pytest.importorskip("torch", reason="Triton's interpreter needs CPU torch")
    from kiln.ir import dtypes as dt

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = runtime._torch_view(x, dt.float32)
    t[0] = 42
    assert x[0, 0] == 42
    bf = np.zeros(4, dt.bfloat16.np_dtype)
    tb = runtime._torch_view(bf, dt.bfloat16)
    tb[1] = 1.5
    assert float(bf[1]) == 1.5
