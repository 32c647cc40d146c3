"""The GPU model of the tile selector: what it knows of each device (peaks, bandwidths,
cache and shared-memory sizes, the vendors' published dense numbers), the launch
configs it ranks, and what makes a config illegal on a device.

Legality (a config that breaks one is never returned):
  - shared memory / LDS per block, as Triton allocates it (stages x the A and B tiles;
    calibrated on Triton 3.9's AOT output for every target: the wgmma/tcgen05 and
    gfx950 pipelines keep `stages` buffers, mma.sync and gfx90a/gfx942 `stages - 1`);
  - registers per thread (NVIDIA: 255; AMD: 512 VGPRs per lane shared by the waves of
    a workgroup on one SIMD), estimated from the accumulator and operand fragments;
  - instruction shapes: dot tiles of at least 16 x 16, BLOCK_K a multiple of the MMA's k
    (16; 32 for float8); on AMD (64-wide waves) every wave must own a 16 x 16 MFMA tile;
    a dtype the target has no matrix instruction for (float8 on sm_80 / gfx90a) is refused.
  Hopper's wgmma needs BLOCK_M a multiple of 64 and whole warpgroups (num_warps % 4);
  a config without them is legal but runs on mma.sync, which the model charges for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import KilnArgumentError, KilnDTypeError

GEMM_KINDS = ("gemm", "grouped_gemm")
REDUCTION_KINDS = ("reduction_inner", "reduction_outer", "reduction_full")
KINDS = GEMM_KINDS + ("pointwise",) + REDUCTION_KINDS


@dataclass(frozen=True)
class Device:
    """What the model knows of one GPU (dense peaks in TFLOP/s; None: no matrix instruction)."""

    name: str
    arch: str  # kiln target name: "sm_90", "gfx942", ...
    units: int  # SMs / CUs a kernel can use
    clock_ghz: float
    peak_tflops: dict = field(hash=False)  # by dtype class: fp16 bf16 fp8 tf32 fp32 fp64
    dram_tbs: float
    l2_bytes: int  # the last-level cache operands are reused from (MI300/MI355: Infinity Cache)
    l2_tbs: float  # L2 -> SM/CU bandwidth (MI300/MI355: the per-XCD L2s together)
    smem_per_block: int
    smem_per_unit: int
    warp_size: int
    fp8_native: bool = True  # AMD gfx942 has only the fnuz float8 MFMA; OCP float8 is converted
    vendor: str = field(init=False)  # "cuda" or "rocm"

    def __post_init__(self):
        object.__setattr__(self, "vendor", "cuda" if self.arch.startswith("sm_") else "rocm")


_NV = dict(warp_size=32)
_AMD = dict(warp_size=64)
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("A100", "sm_80", 108, 1.41, {"fp16": 312, "bf16": 312, "fp8": None, "tf32": 156,
                                        "fp32": 19.5, "fp64": 19.5},
           2.04, 40 << 20, 4.5, 166912, 167936, **_NV),
    Device("H100", "sm_90", 132, 1.83, {"fp16": 989, "bf16": 989, "fp8": 1979, "tf32": 495,
                                        "fp32": 67, "fp64": 67},
           3.35, 50 << 20, 9.0, 232448, 233472, **_NV),
    Device("H200", "sm_90", 132, 1.83, {"fp16": 989, "bf16": 989, "fp8": 1979, "tf32": 495,
                                        "fp32": 67, "fp64": 67},
           4.8, 50 << 20, 9.0, 232448, 233472, **_NV),
    Device("B200", "sm_100", 148, 1.96, {"fp16": 2250, "bf16": 2250, "fp8": 4500, "tf32": 1100,
                                         "fp32": 75, "fp64": 37},
           8.0, 126 << 20, 20.0, 232448, 233472, **_NV),
    # one MI250X GCD: each of its two dies is a device of its own (110 of the 220 CUs)
    Device("MI250X", "gfx90a", 110, 1.7, {"fp16": 191.5, "bf16": 191.5, "fp8": None, "tf32": None,
                                          "fp32": 47.9, "fp64": 47.9},
           1.64, 8 << 20, 5.0, 65536, 65536, **_AMD),
    Device("MI300X", "gfx942", 304, 2.1, {"fp16": 1307, "bf16": 1307, "fp8": 2615, "tf32": 654,
                                          "fp32": 163.4, "fp64": 81.7},
           5.3, 256 << 20, 24.0, 65536, 65536, fp8_native=False, **_AMD),
    Device("MI355X", "gfx950", 256, 2.4, {"fp16": 2517, "bf16": 2517, "fp8": 5033, "tf32": None,
                                          "fp32": 157.3, "fp64": 78.6},
           8.0, 256 << 20, 27.0, 163840, 163840, **_AMD),
)}
# the device a bare architecture name is modelled as
DEFAULT_DEVICE = {"sm_80": "A100", "sm_90": "H100", "sm_100": "B200", "gfx90a": "MI250X",
                  "gfx942": "MI300X", "gfx950": "MI355X"}


def device_model(target: str | Device) -> Device:
    """The Device for a product ("H200", "MI300X"), an architecture ("sm_90", "gfx942") or a
    backend spec ("cuda", "rocm:gfx950")."""
    if isinstance(target, Device):
        return target
    if target in DEVICES:
        return DEVICES[target]
    if target in DEFAULT_DEVICE:
        return DEVICES[DEFAULT_DEVICE[target]]
    from kiln.codegen.triton.targets import resolve_arch

    try:
        return DEVICES[DEFAULT_DEVICE[resolve_arch(target)]]
    except KilnArgumentError:
        raise KilnArgumentError(
            f"tile selector: unknown target {target!r}; name an architecture "
            f"({', '.join(DEFAULT_DEVICE)}), a device ({', '.join(DEVICES)}) or 'cuda'/'rocm'") from None


def device_for_name(gpu_name: str, arch: str) -> Device:
    """The model of a GPU from its driver name ("NVIDIA H200", "AMD Instinct MI300X")."""
    upper = gpu_name.upper()
    for name in sorted(DEVICES, key=len, reverse=True):
        if name in upper and DEVICES[name].arch == arch:
            return DEVICES[name]
    return device_model(arch)


# dtype classes and their sizes
DTYPE_CLASS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
                "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8",
                "float8_e5m2fnuz": "fp8"}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp64": 8, "fp8": 1}


def dtype_name(dtype) -> str:
    """kiln's name for a dtype given as a kiln, numpy or torch dtype or a short name."""
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.replace("torch.", "")
    return {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
            "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32",
            "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}.get(name, name)


def dtype_class(dtype, input_precision: str = "ieee") -> str:
    """"fp16", "bf16", "fp8", "tf32", "fp32" or "fp64": which peak a dot of `dtype` runs at."""
    name = dtype_name(dtype)
    if name not in DTYPE_CLASS:
        raise KilnDTypeError(f"tile selector: no model for dtype {name}; it knows "
                             f"{', '.join(sorted(DTYPE_CLASS))}")
    cls = DTYPE_CLASS[name]
    return "tf32" if cls == "fp32" and input_precision == "tf32" else cls


# -- configs and their legality ----------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Config:
    """One launch configuration. For pointwise kernels block_m is XBLOCK; for reductions
    block_m is XBLOCK (rows per program) and block_n RBLOCK (reduced elements per step)."""

    block_m: int
    block_n: int = 1
    block_k: int = 1
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def blocks(self, kind: str) -> dict[str, int]:
        """The constexpr block sizes by the names kiln's Triton kernels use."""
        if kind in GEMM_KINDS:
            return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                    "GROUP_M": self.group_m}
        if kind == "pointwise":
            return {"XBLOCK": self.block_m}
        return {"XBLOCK": self.block_m, "RBLOCK": self.block_n}

    def __str__(self) -> str:
        return (f"BM={self.block_m} BN={self.block_n} BK={self.block_k} GM={self.group_m} "
                f"warps={self.num_warps} stages={self.num_stages}")


def mma_path(dev: Device, cls: str, c: Config) -> str:
    """The instruction family Triton lowers this config's tl.dot to on `dev`."""
    if dev.vendor == "rocm":
        return "mfma"
    tensor_core = cls in ("fp16", "bf16", "fp8", "tf32") or (cls == "fp64" and dev.arch != "sm_100")
    if not tensor_core:
        return "fma"
    whole_warpgroups = c.num_warps % 4 == 0 and c.block_m % 64 == 0 and cls != "fp64"
    if dev.arch == "sm_90" and whole_warpgroups:
        return "wgmma"
    if dev.arch == "sm_100" and whole_warpgroups:
        return "tcgen05"
    return "mma.sync"


def shared_memory(dev: Device, cls: str, c: Config) -> int:
    """Bytes of shared memory / LDS Triton allocates for a GEMM config (calibrated, see doc)."""
    b = DTYPE_BYTES[cls]
    stage = (c.block_m * c.block_k + c.block_k * c.block_n) * b
    path = mma_path(dev, cls, c)
    if dev.vendor == "rocm":
        if c.num_stages == 1:  # A and B go through LDS one after the other
            return max(c.block_m, c.block_n) * c.block_k * b
        if dev.arch == "gfx950":
            return c.num_stages * stage + 8192
        return (c.num_stages - 1) * stage
    if path in ("wgmma", "tcgen05"):
        return c.num_stages * stage + (16 * c.num_stages if path == "tcgen05" else 0)
    return max(1, c.num_stages - 1) * stage


def registers(dev: Device, cls: str, c: Config) -> float:
    """Estimated 32-bit registers per thread (VGPRs per lane on AMD)."""
    threads = c.num_warps * dev.warp_size
    acc = c.block_m * c.block_n / threads  # float32 accumulators
    operands = (c.block_m * c.block_k + c.block_k * c.block_n) * DTYPE_BYTES[cls] / 4 / threads
    if dev.vendor == "rocm":
        return acc + 4 * operands + 60  # fitted to Triton 3.9's gfx942 register counts
    path = mma_path(dev, cls, c)
    if path == "wgmma":
        return acc + 40  # operands stay in shared memory
    if path == "tcgen05":
        return min(acc, 128) + 40  # the accumulator lives in tensor memory
    return acc + 2 * operands + 40


def register_limit(dev: Device, c: Config) -> float:
    if dev.vendor == "rocm":  # a workgroup's waves share 4 SIMDs of 512 VGPRs per lane
        return 512 / math.ceil(c.num_warps / 4)
    return 255


def illegal_reason(kind: str, c: Config, target: str | Device, dtype="float16",
                   input_precision: str = "ieee") -> str | None:
    """Why `c` cannot run on `target`, or None when it is legal."""
    dev = device_model(target)
    threads = c.num_warps * dev.warp_size
    if threads > 1024:
        return f"{threads} threads per block (max 1024)"
    if kind not in GEMM_KINDS:
        per_thread = c.block_m * max(c.block_n, 1) / threads
        if per_thread < 1:
            return f"{c.block_m * c.block_n} elements for {threads} threads (idle threads)"
        if per_thread > 64:
            return f"{per_thread:.0f} elements per thread (register spills)"
        return None
    cls = dtype_class(dtype, input_precision)
    if dev.peak_tflops.get(cls) is None and not (cls == "tf32" and dev.peak_tflops["fp32"]):
        return f"{dev.arch} has no matrix instruction for {cls}"
    if c.block_m < 16 or c.block_n < 16:
        return f"dot tile {c.block_m}x{c.block_n} (min 16x16)"
    kmin = 32 if cls == "fp8" else 16
    if c.block_k < kmin or c.block_k % kmin:
        return f"BLOCK_K={c.block_k} (a multiple of {kmin} for {cls})"
    if dev.vendor == "rocm":
        if c.block_m % 16 or c.block_n % 16:
            return "MFMA tiles need BLOCK_M and BLOCK_N multiples of 16"
        if c.block_m * c.block_n < c.num_warps * 256:
            return f"{c.num_warps} waves for a {c.block_m}x{c.block_n} tile (each needs a 16x16 MFMA)"
    elif c.block_m * c.block_n < c.num_warps * 16 * 8:
        return f"{c.num_warps} warps for a {c.block_m}x{c.block_n} tile (each needs a 16x8 MMA)"
    smem = shared_memory(dev, cls, c)
    if smem > dev.smem_per_block:
        what = "LDS" if dev.vendor == "rocm" else "shared memory"
        return f"{smem} bytes of {what} (max {dev.smem_per_block})"
    regs, limit = registers(dev, cls, c), register_limit(dev, c)
    if regs > limit:
        return f"~{regs:.0f} registers per thread (max {limit:.0f})"
    return None


def resident_blocks(dev: Device, c: Config, smem: int, regs: float) -> int:
    """Blocks resident per SM/CU."""
    threads = c.num_warps * dev.warp_size
    by_threads = 2048 // threads
    by_smem = dev.smem_per_unit // smem if smem else 32
    if dev.vendor == "rocm":
        waves_per_simd = min(8, int(512 // max(regs, 1)))
        by_regs = (4 * waves_per_simd) // c.num_warps
    else:
        by_regs = int(65536 // (max(regs, 32) * threads))
    return max(0, min(32, by_threads, by_smem, by_regs))
