"""The analytical tile selector: every config it returns is legal on every target (checked
independently of its own legality function, and for a few against what Triton 3.9
really allocates), its choices are the sensible ones (no one-wave tail on MI300X's 304
CUs, big tiles for big square GEMMs, a small BLOCK_M for skinny ones, float8 different
from float16 where the model says so), it is deterministic, and max-autotune measures,
caches and reuses its winner (with a fake benchmark here: there is no GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.codegen.triton import tile_selector as ts
from kiln.codegen.triton.targets import KilnNoGpuError
from kiln.codegen.triton.tile_selector import Config, device_model, explain, rank, select_tiles
from kiln.errors import KilnArgumentError, KilnDTypeError

TARGETS = ("sm_80", "sm_90", "sm_100", "gfx90a", "gfx942", "gfx950")
GEMM_SHAPES = [  # (kind, m, n, k, extra)
    ("gemm", 8192, 8192, 8192, {}),
    ("gemm", 16, 4096, 4096, {}),
    ("gemm", 1000, 300, 77, {}),
    ("grouped_gemm", 8192, 1408, 2048, {"num_experts": 64}),
    ("grouped_gemm", 24, 4096, 7168, {"group_sizes": [0, 3, 0, 21]}),
    ("gemm", None, 4096, None, {}),  # symbolic sizes
]


def _float8_ok(target):
    return device_model(target).peak_tflops["fp8"] is not None


def check_legal(kind, c: Config, target, dtype):
    """The limits restated from the hardware, independent of the selector's own check."""
    dev = device_model(target)
    cls = ts.dtype_class(dtype)
    b = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}[cls]
    threads = c.num_warps * dev.warp_size
    assert threads <= 1024
    assert c.block_m >= 16 and c.block_n >= 16, c
    assert c.block_k % (32 if cls == "fp8" else 16) == 0, c
    tiles = (c.block_m * c.block_k + c.block_k * c.block_n) * b
    # Triton 3.9 keeps `stages` buffers for wgmma/tcgen05 and on gfx950, one fewer
    # elsewhere; one stage on AMD passes A and B through LDS one after the other
    keeps_all = ts.mma_path(dev, cls, c) in ("wgmma", "tcgen05") or dev.arch == "gfx950"
    smem = (c.num_stages if keeps_all else max(1, c.num_stages - 1)) * tiles
    if dev.vendor == "rocm" and c.num_stages == 1:
        smem = max(c.block_m, c.block_n) * c.block_k * b
    assert smem <= dev.smem_per_block + 8192, c  # gfx950 keeps 8 KB of scratch
    acc = c.block_m * c.block_n / threads
    if dev.vendor == "rocm":
        assert c.block_m % 16 == 0 and c.block_n % 16 == 0
        assert c.block_m * c.block_n >= c.num_warps * 16 * 16  # a 16x16 MFMA per wave
        assert acc <= 512 / math.ceil(c.num_warps / 4)  # VGPRs per lane
    else:
        assert acc <= (255 if dev.arch != "sm_100" else 512)
    if dev.arch == "sm_90" and ts.mma_path(dev, cls, c) == "wgmma":
        assert c.block_m % 64 == 0 and c.num_warps % 4 == 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_every_returned_gemm_config_is_legal(target, dtype):
    if dtype.startswith("float8") and not _float8_ok(target):
        with pytest.raises(KilnDTypeError, match="has no matrix instruction for float8_e4m3fn"):
            select_tiles("gemm", 512, 512, 512, dtype, target)
        return
    for kind, m, n, k, extra in GEMM_SHAPES:
        configs = select_tiles(kind, m, n, k, dtype, target, **extra)
        assert configs
        for c in configs[:40] + configs[-20:]:
            assert ts.illegal_reason(kind, c, target, dtype) is None
            check_legal(kind, c, target, dtype)


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_memory_bound_kinds_are_legal(target):
    dev = device_model(target)
    for kind, m, k in [("pointwise", 1 << 24, None), ("pointwise", 7, None),
                       ("reduction_inner", 4096, 32768), ("reduction_inner", 65536, 64),
                       ("reduction_outer", 4096, 512), ("reduction_full", None, 1 << 20),
                       ("reduction", None, None)]:
        for c in select_tiles(kind, m, None, k, "float32", target)[:20]:
            threads = c.num_warps * dev.warp_size
            assert threads <= 1024 and 1 <= c.block_m * c.block_n / threads <= 64, (kind, c)


def _asm_check(target, dtype, config):
    pytest.importorskip("triton", reason="checking the model against Triton needs triton")
    from kiln.codegen.triton.grouped_gemm import aot_compile_grouped_gemm

    art = aot_compile_grouped_gemm(target, dtype, config=config, m=4096, n=4096, k=4096)
    dev = device_model(target)
    model = ts.shared_memory(dev, ts.dtype_class(dtype), config)
    assert art.shared_memory <= dev.smem_per_block
    assert art.shared_memory <= model  # the model never promises less than Triton takes
    return art


def test_model_of_shared_memory_matches_triton_on_sm80_and_gfx950():
    """The two targets the grouped GEMM tests do not compile for (sm_90 and gfx942 are
    checked there, to the byte)."""
    c80 = select_tiles("gemm", 4096, 4096, 4096, "float16", "sm_80")[0]
    art = _asm_check("sm_80", "float16", c80)
    assert art.shared_memory == ts.shared_memory(device_model("sm_80"), "fp16", c80)
    assert "mma.sync.aligned" in art.assembly
    c950 = select_tiles("gemm", 4096, 4096, 4096, "bfloat16", "gfx950")[0]
    art = _asm_check("gfx950", "bfloat16", c950)
    assert "v_mfma" in art.assembly


# -- sensible choices ---------------------------------------------------------------------------

def _first(ests, bm, bn):
    return next((i, e) for i, e in enumerate(ests) if (e.config.block_m, e.config.block_n) == (bm, bn))


def test_mi300x_avoids_a_one_wave_tail():
    # 640 x 7808 in 128 x 128 tiles is 5 x 61 = 305 tiles: one more than MI300X's 304 CUs
    tail = rank("gemm", 640, 7808, 8192, "float16", "gfx942")
    i, e = _first(tail, 128, 128)
    assert e.tiles == 305 and e.waves == 2 and e.wave_efficiency < 0.51
    best = tail[0]
    assert i > 20 and best.time < 0.9 * e.time and best.wave_efficiency > 0.6
    # the same tile on 512 x 9728 is exactly 304 tiles: one full wave, and the first choice
    full = rank("gemm", 512, 9728, 8192, "float16", "gfx942")
    i, e = _first(full, 128, 128)
    assert e.tiles == 304 and e.waves == 1 and i == 0
    # and on H100 (132 SMs) the 305-tile shape has no comparable tail to avoid
    assert _first(rank("gemm", 640, 7808, 8192, "float16", "sm_90"), 128, 128)[1].waves == 3


@pytest.mark.parametrize("target", TARGETS)
def test_large_square_gemms_get_big_tiles_and_skinny_ones_a_small_block_m(target):
    big = select_tiles("gemm", 8192, 8192, 8192, "bfloat16", target)[0]
    assert big.block_m * big.block_n >= 128 * 128 and big.block_k >= 32
    skinny = select_tiles("gemm", 16, 8192, 8192, "bfloat16", target)[0]
    assert skinny.block_m <= 32 < big.block_m
    decode = select_tiles("grouped_gemm", 64, 2048, 7168, "bfloat16", target, num_experts=64)[0]
    assert decode.block_m <= 32  # one token per expert


def test_wgmma_tiles_on_hopper_mma_sync_when_m_is_tiny():
    dev = device_model("sm_90")
    big = rank("gemm", 8192, 8192, 8192, "float16", "sm_90")[0]
    assert big.path == "wgmma" and big.config.block_m % 64 == 0 and big.config.num_warps % 4 == 0
    assert big.bound == "compute"
    assert ts.mma_path(dev, "fp16", Config(32, 128, 64, 8, 4, 3)) == "mma.sync"
    assert ts.mma_path(dev, "fp32", Config(128, 128, 32, 8, 4, 3)) == "fma"  # ieee float32
    assert ts.mma_path(dev, "tf32", Config(128, 128, 32, 8, 4, 3)) == "wgmma"


def test_float8_and_float16_differ_where_the_model_says_so():
    # Hopper: float8 runs at twice the rate and half the bytes, so its tiles take a
    # deeper K step (the wgmma k is 32, not 16)
    f16 = rank("gemm", 8192, 8192, 8192, "float16", "sm_90")[0]
    f8 = rank("gemm", 8192, 8192, 8192, "float8_e4m3fn", "sm_90")[0]
    assert f8.config != f16.config and f8.config.block_k > f16.config.block_k
    assert f8.time < 0.6 * f16.time
    # MI300X's MFMA takes only the fnuz float8; kiln's OCP float8 is converted to
    # float16 first, so the model gives it float16's rate; MI355X runs it natively
    mi300 = [rank("gemm", 8192, 8192, 8192, d, "gfx942")[0].compute for d in ("float16", "float8_e4m3fn")]
    mi355 = [rank("gemm", 8192, 8192, 8192, d, "gfx950")[0].compute for d in ("float16", "float8_e4m3fn")]
    assert mi300[1] > 0.9 * mi300[0] and mi355[1] < 0.6 * mi355[0]


def test_memory_bound_moe_shapes_are_reported_as_such():
    """Many experts, few tokens each: streaming the weights is the cost."""
    e = rank("grouped_gemm", 8192, 1408, 2048, "bfloat16", "gfx942", num_experts=64)[0]
    assert e.bound == "dram"
    weights = 64 * 2048 * 1408 * 2
    assert e.dram >= weights / (5.3e12)


def test_pointwise_and_reduction_rules():
    big = select_tiles("pointwise", 1 << 24, 3, None, "float32", "sm_90")[0]
    small = select_tiles("pointwise", 100, 2, None, "float32", "sm_90")[0]
    assert (1 << 24) // big.block_m >= 4 * 132  # enough blocks to fill every SM a few times
    assert small.block_m <= 256 and big.block_m >= small.block_m
    long_rows = select_tiles("reduction_inner", 4096, None, 32768, "float32", "gfx942")[0]
    short_rows = select_tiles("reduction_inner", 65536, None, 64, "float32", "gfx942")[0]
    assert long_rows.block_m == 1 and long_rows.block_n >= 1024  # one row, big steps
    assert short_rows.block_m > 1 and short_rows.block_n == 64  # several whole rows a program
    assert Config(8, 64).blocks("reduction_inner") == {"XBLOCK": 8, "RBLOCK": 64}
    assert big.blocks("pointwise") == {"XBLOCK": big.block_m}
    assert set(Config(128, 128, 64, 8).blocks("gemm")) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"}


def test_deterministic():
    args = ("grouped_gemm", 8192, 14336, 4096, "bfloat16", "sm_90")
    assert select_tiles(*args, num_experts=8) == select_tiles(*args, num_experts=8)
    sizes = np.random.default_rng(0).multinomial(8192, np.ones(8) / 8)
    assert rank(*args, group_sizes=sizes) == rank(*args, group_sizes=list(sizes))


def test_explain_shows_the_breakdown():
    text = explain("grouped_gemm", 8192, 1408, 2048, "bfloat16", "gfx942", num_experts=64, top=3)
    lines = text.splitlines()
    assert lines[0].startswith("tile selector: grouped_gemm m=8192 n=1408 k=2048 num_experts=64 "
                               "bfloat16 on MI300X (gfx942, 304 CUs)")
    assert "compute" in lines[1] and "waves" in lines[1] and "bound" in lines[1]
    assert len(lines) == 5 and lines[2].split()[-1] == "dram"
    assert str(select_tiles("grouped_gemm", 8192, 1408, 2048, "bfloat16", "gfx942",
                            num_experts=64)[0]) in lines[2]


def test_command_line(capsys):
    assert ts.main(["gemm", "4096", "4096", "4096", "--target", "H200", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "on H200 (sm_90, 132 SMs)" in out and len(out.splitlines()) == 4


def test_targets_devices_and_errors():
    assert device_model("cuda").name == "H100" and device_model("rocm:gfx950").name == "MI355X"
    assert device_model("gfx90a").units == 110  # one GCD of an MI250X
    assert ts.device_for_name("NVIDIA H200", "sm_90").name == "H200"
    assert ts.device_for_name("Some future GPU", "gfx942").name == "MI300X"
    with pytest.raises(KilnArgumentError, match="unknown target 'tpu'"):
        select_tiles("gemm", 64, 64, 64, "float16", "tpu")
    with pytest.raises(KilnArgumentError, match="unknown kernel kind 'conv'"):
        select_tiles("conv", 64, 64, 64)
    with pytest.raises(KilnDTypeError, match="no model for dtype int8"):
        select_tiles("gemm", 64, 64, 64, "int8")
    with pytest.raises(KilnArgumentError, match="mode must be 'default' or 'max-autotune'"):
        select_tiles("gemm", 64, 64, 64, mode="fast")


# -- max-autotune -----------------------------------------------------------------------------------

def test_max_autotune_needs_a_gpu():
    pytest.importorskip("torch", reason="GPU detection goes through torch")
    with pytest.raises(KilnNoGpuError, match="max-autotune measures candidate tile configs on a GPU"):
        select_tiles("grouped_gemm", 4096, 1024, 1024, "bfloat16", "sm_90", num_experts=8,
                     mode="max-autotune")


def test_max_autotune_measures_caches_and_reuses(capsys):
    args = ("gemm", 2048, 2048, 2048, "float16", "gfx942")
    analytical = select_tiles(*args)
    measured = []

    def benchmark(c):  # pretend the 5th candidate is the fastest, and one fails to build
        measured.append(c)
        if c == analytical[1]:
            raise RuntimeError("out of resources")
        return 1.0 if c != analytical[4] else 0.5

    tuned = select_tiles(*args, mode="max-autotune", benchmark=benchmark, candidates=6,
                         kernel_key="k1")
    assert tuned[0] == analytical[4] and measured == analytical[:6]
    assert sorted(tuned) == sorted(analytical)
    err = capsys.readouterr().err
    assert "kiln: tuning tiles" in err and "/6 " in err and "out of resources" in err  # the bar (tqdm, cleared when done)
    # a size in the same bucket reuses the measurement without running anything
    measured.clear()
    again = select_tiles("gemm", 2000, 1900, 2048, "float16", "gfx942", mode="max-autotune",
                         benchmark=benchmark, kernel_key="k1")
    assert again[0] == analytical[4] and measured == []
    # default mode with the kernel's key puts the measured winner first; other kernels don't
    assert select_tiles(*args, kernel_key="k1")[0] == analytical[4]
    assert select_tiles(*args, kernel_key="k2")[0] == analytical[0]
