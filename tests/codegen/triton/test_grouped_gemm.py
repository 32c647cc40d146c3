"""The persistent Triton grouped GEMM: ahead-of-time compilation for Hopper (wgmma) and
MI300 (MFMA) on this CPU-only machine, and numerics through Triton's CPU interpreter
against numpy (ragged and empty groups, K and N tails, every epilogue, float32 /
float16 / bfloat16, the persistent loop with one program and with more programs than
tiles).

The interpreter must be switched on before triton is imported, and ahead-of-time
compilation cannot run in such a process, so the interpreter cases run in one child
process (started once for the module) that writes its outputs to a folder.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton backend needs the triton package")
pytest.importorskip("torch", reason="Triton's interpreter needs CPU torch (the test extra torch==2.13.0)")

from kiln.codegen import artifact_cache  # noqa: E402
from kiln.codegen.triton import grouped_gemm as gg  # noqa: E402
from kiln.codegen.triton.tile_selector import Config, device_model, select_tiles, shared_memory  # noqa: E402
from kiln.errors import KilnArgumentError, KilnDTypeError  # noqa: E402
from kiln.ir.emitter import EAGER  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]

# name -> (dtype, group sizes, K, N, launch options); small: the interpreter runs ~1 s a case
CASES = {
    "f32_plain": ("float32", [5, 0, 33, 1, 17], 40, 40, {}),
    "f16_silu_bias_scale": ("float16", [5, 0, 33, 1, 17], 40, 40,
                            {"activation": "silu", "bias": True, "row_scale": True, "alpha": 0.5}),
    "bf16_gelu": ("bfloat16", [0, 20, 0, 9], 32, 24, {"activation": "gelu", "bias": True}),
    "f32_gelu_tanh_transposed": ("float32", [7, 12, 0], 24, 48,
                                 {"activation": "gelu_tanh", "transpose_rhs": True}),
    "f16_relu_to_f32_one_program": ("float16", [3, 30, 2], 48, 40,
                                    {"activation": "relu", "out_dtype": "float32", "num_programs": 1}),
    "f32_more_programs_than_tiles_int64_sizes": ("float32", [0, 0, 9], 16, 16,
                                                 {"num_programs": 64, "sizes_dtype": "int64"}),
}
CONFIG = Config(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=2)
# the weight-gradient kernel: name -> (dtype, group sizes, K, N)
DW_CASES = {"dw_f32": ("float32", [5, 0, 33, 1, 17], 40, 24), "dw_bf16": ("bfloat16", [0, 9, 20], 32, 48)}

WORKER = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np, torch
    from kiln.codegen.triton.grouped_gemm import grouped_gemm
    from kiln.codegen.triton.tile_selector import Config

    out_dir, cases, config = sys.argv[1], json.loads(sys.argv[2]), Config(**json.loads(sys.argv[3]))
    for name, (dtype, sizes, k, n, opts) in cases.items():
        data = np.load(os.path.join(out_dir, name + "_in.npz"))
        cast = lambda a: torch.tensor(a).to(getattr(torch, dtype))
        opts = dict(opts)
        sizes_t = torch.tensor(data["sizes"], dtype=getattr(torch, opts.pop("sizes_dtype", "int32")))
        bias = torch.tensor(data["bias"]) if opts.pop("bias", False) else None
        scale = torch.tensor(data["scale"]) if opts.pop("row_scale", False) else None
        y = grouped_gemm(cast(data["x"]), cast(data["w"]), sizes_t, bias=bias, row_scale=scale,
                         config=config, **opts)
        np.save(os.path.join(out_dir, name + "_out.npy"), y.float().numpy())
    from kiln.codegen.triton.grouped_gemm import grouped_gemm_dw
    for name, (dtype, sizes, k, n) in json.loads(sys.argv[4]).items():
        data = np.load(os.path.join(out_dir, name + "_in.npz"))
        cast = lambda a: torch.tensor(a).to(getattr(torch, dtype))
        z = grouped_gemm_dw(cast(data["x"]), cast(data["y"]), torch.tensor(data["sizes"]),
                            out_dtype="float32", config=config)
        np.save(os.path.join(out_dir, name + "_out.npy"), z.numpy())
""")


def _inputs(name):
    dtype, sizes, k, n, opts = CASES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2 ** 32)
    tokens = sum(sizes)
    w_shape = (len(sizes), n, k) if opts.get("transpose_rhs") else (len(sizes), k, n)
    return {"x": rng.standard_normal((tokens, k)).astype(np.float32),
            "w": (rng.standard_normal(w_shape) / np.sqrt(k)).astype(np.float32),
            "sizes": np.array(sizes, np.int64), "bias": rng.standard_normal((len(sizes), n)).astype(np.float32),
            "scale": rng.random(tokens).astype(np.float32)}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Run every case through the interpreter in one child process; name -> output."""
    folder = tmp_path_factory.mktemp("grouped_gemm_interp")
    for name in CASES:
        np.savez(folder / f"{name}_in.npz", **_inputs(name))
    for name in DW_CASES:
        np.savez(folder / f"{name}_in.npz", **_dw_inputs(name))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    config = json.dumps({f: getattr(CONFIG, f) for f in CONFIG.__dataclass_fields__})
    proc = subprocess.run([sys.executable, "-c", WORKER, str(folder), json.dumps(CASES), config,
                           json.dumps(DW_CASES)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: np.load(folder / f"{name}_out.npy") for name in list(CASES) + list(DW_CASES)}


def _dw_inputs(name):
    dtype, sizes, k, n = DW_CASES[name]
    rng = np.random.default_rng(len(name) + k)
    return {"x": rng.standard_normal((sum(sizes), k)).astype(np.float32),
            "y": rng.standard_normal((sum(sizes), n)).astype(np.float32),
            "sizes": np.array(sizes, np.int32)}


def _rounded(a, dtype):
    import torch

    return torch.tensor(a).to(getattr(torch, dtype)).float().numpy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_numpy(interpreted, name):
    dtype, sizes, k, n, opts = CASES[name]
    data = _inputs(name)
    # the kernel sees the inputs rounded to their dtype; it accumulates in float32
    x, w = _rounded(data["x"], dtype), _rounded(data["w"], dtype)
    want = gg.reference(x, w, data["sizes"], bias=data["bias"] if opts.get("bias") else None,
                        row_scale=data["scale"] if opts.get("row_scale") else None,
                        alpha=opts.get("alpha", 1.0), activation=opts.get("activation", "none"),
                        transpose_rhs=opts.get("transpose_rhs", False))
    got = interpreted[name]
    assert got.shape == (sum(sizes), n)
    out = opts.get("out_dtype", dtype)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[out]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def test_interpreter_agrees_with_the_grouped_matmul_op(interpreted):
    """No epilogue: the kernel computes kiln's `grouped_matmul` (its eager reference)."""
    data = _inputs("f32_plain")
    (want,) = EAGER.apply("grouped_matmul", [data["x"], data["w"], data["sizes"]], {})
    np.testing.assert_allclose(interpreted["f32_plain"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(DW_CASES))
def test_weight_gradient_kernel_matches_numpy(interpreted, name):
    dtype, sizes, k, n = DW_CASES[name]
    data = _dw_inputs(name)
    want = gg.reference_dw(_rounded(data["x"], dtype), _rounded(data["y"], dtype), data["sizes"])
    got = interpreted[name]
    assert got.shape == (len(sizes), k, n)
    assert not got[[i for i, s in enumerate(sizes) if s == 0]].any()  # empty experts: zeros
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # and it is kiln's grouped_matmul_dw
    (op,) = EAGER.apply("grouped_matmul_dw", [_rounded(data["x"], dtype), _rounded(data["y"], dtype),
                                               data["sizes"]], {})
    np.testing.assert_allclose(got, op, rtol=1e-5, atol=1e-4)


# -- ahead of time, no GPU -------------------------------------------------------------------

def _mma(asm: str) -> list[str]:
    return sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+|mma\.sync\.aligned\.\w+"
                                 r"|v_mfma_\w+", asm)))


def test_aot_sm90_uses_wgmma_and_a_pipelined_k_loop():
    epilogue = gg.Epilogue("silu", bias=True, row_scale=True)
    art = gg.aot_compile_grouped_gemm("sm_90", "float16", epilogue=epilogue, m=8192, n=1408,
                                      k=2048, num_experts=64)
    ptx = art.asm["ptx"]
    assert any(i.startswith("wgmma.mma_async") for i in _mma(ptx)), _mma(ptx)
    assert "cp.async" in ptx  # the divisibility hints let the K loop pipeline
    assert art.binary
    config = select_tiles("grouped_gemm", 8192, 1408, 2048, "float16", "sm_90", num_experts=64)[0]
    assert art.metadata["num_warps"] == config.num_warps
    assert art.shared_memory == shared_memory(device_model("sm_90"), "fp16", config)
    assert art.shared_memory <= device_model("sm_90").smem_per_block


def test_aot_gfx942_uses_mfma_within_lds():
    config = Config(128, 128, 64, 8, 4, 2)
    art = gg.aot_compile_grouped_gemm("gfx942", "bfloat16", config=config,
                                      epilogue=gg.Epilogue("gelu", bias=True), m=4096, n=4096, k=1024)
    assert any(i.startswith("v_mfma_f32_32x32") and i.endswith("bf16") for i in _mma(art.assembly)), \
        _mma(art.assembly)
    assert art.asm["hsaco"]
    assert art.shared_memory == shared_memory(device_model("gfx942"), "bf16", config) <= 65536


def test_aot_weight_gradient_kernel_on_both_vendors():
    hopper = gg.aot_compile_grouped_gemm_dw("sm_90", "bfloat16", m=8192, n=1408, k=2048,
                                            num_experts=64)
    assert any(i.startswith("wgmma.mma_async") for i in _mma(hopper.asm["ptx"]))
    assert "cp.async" in hopper.asm["ptx"]
    mi300 = gg.aot_compile_grouped_gemm_dw("gfx942", "bfloat16", config=Config(128, 128, 64, 8, 4, 2),
                                           m=8192, n=1408, k=2048, num_experts=64)
    assert any(i.startswith("v_mfma") for i in _mma(mi300.assembly))


def test_aot_transposed_weights_and_a_second_call_hits_the_cache():
    args = dict(config=Config(64, 64, 32, 8, 4, 2), transpose_rhs=True, m=512, n=256, k=512)
    art = gg.aot_compile_grouped_gemm("gfx942", "float16", **args)
    assert _mma(art.assembly)
    hits = artifact_cache.STATS["hits"]
    assert gg.aot_compile_grouped_gemm("gfx942", "float16", **args).key == art.key
    assert artifact_cache.STATS["hits"] == hits + 1


# -- host-side helpers ------------------------------------------------------------------------

def test_signature_and_constexprs_describe_the_kernel():
    units = gg.unit_strides()
    sig = gg.signature("bfloat16", "float32", unit_strides=units)
    assert list(sig)[:18] == list(gg._ARGS)
    assert sig["x_ptr"] == "*bf16" and sig["y_ptr"] == "*fp32" and sig["sizes_ptr"] == "*i32"
    assert sig["stride_xk"] == sig["stride_wn"] == sig["stride_yn"] == "constexpr"
    values = gg.constexprs(CONFIG, gg.Epilogue("silu", bias=True), unit_strides=units)
    assert values["BLOCK_M"] == 16 and values["ACTIVATION"] == "silu" and values["HAS_BIAS"]
    assert values["stride_xk"] == 1 and "stride_wk" not in values
    assert gg.unit_strides(transpose_rhs=True) == ("stride_xk", "stride_wk", "stride_yn")
    assert gg.signature("float8_e4m3fn")["y_ptr"] == "*fp16"  # float8 writes float16


def test_divisibility_hints_follow_the_sizes():
    assert "K" in gg.divisible_args(n=4096, k=2048) and "stride_we" in gg.divisible_args(4096, 2048)
    odd = gg.divisible_args(n=100, k=2048)
    assert "N" not in odd and "stride_ym" not in odd and "K" in odd and "stride_we" not in odd


def test_host_side_errors_name_the_problem():
    with pytest.raises(KilnArgumentError, match="unknown activation 'swish'"):
        gg.Epilogue("swish")
    with pytest.raises(KilnDTypeError, match="inputs of dtype int8 are not supported"):
        gg.signature("int8")
    with pytest.raises(KilnDTypeError, match="output dtype float8_e4m3fn is not supported"):
        gg.signature("float16", "float8_e4m3fn")
    with pytest.raises(KilnArgumentError, match="input_precision must be one of ieee, tf32"):
        gg.constexprs(CONFIG, input_precision="bf16x3")


def test_persistent_grid_is_bounded_without_reading_the_sizes():
    config = Config(128, 128, 64, 8, 4, 3)
    # 64 experts x 100 tokens: at most ceil(6400 / 128) + 64 row tiles, x 8 column tiles
    assert gg.num_programs_for(132, 6400, 64, 1024, config) == 132
    assert gg.num_programs_for(132, 10, 2, 128, config) == 3  # (1 + 2) x 1 tiles at most
    assert gg.num_programs_for(304, 0, 4, 128, config) == 4
    assert gg.balanced_sizes(10, 4).tolist() == [3, 3, 2, 2]
