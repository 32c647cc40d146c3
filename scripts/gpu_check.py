"""kiln's GPU check: numerics and speed of kiln's Triton kernels on a real NVIDIA GPU.

One prepared run (under 5 minutes on an H200) that prints markdown tables:

1. grouped GEMM numerics: ragged and empty groups, float32 (ieee and tf32), float16,
   bfloat16, every epilogue, transposed weights, and the weight-gradient kernel;
   against float64 torch on the GPU.
2. grouped GEMM speed: TFLOP/s of kiln's persistent kernel (the analytical tile
   selector's config for this GPU) against a loop of per-expert torch.matmul calls and,
   where this torch has it, torch._grouped_mm; then max-autotune on one shape (the
   measured winner against the model's first choice).
3. kiln-generated kernels through `kn.compile(..., backend="cuda")`, where the backend
   exists: pointwise numerics and GB/s against the copy ceiling (4.3 TB/s measured
   on an H200, and this GPU's torch copy), softmax and layer_norm against torch eager.
4. the device runtime (scripts/gpu_check_device.py): a compiled program on `cuda`
   device tensors with its host copies counted, CUDA-graph replay vs normal launch per
   call, a captured while_loop, the caching allocator against cuMemGetInfo, DLPack with
   torch CUDA tensors.

Every part is guarded: a missing piece (no kiln Triton backend yet, an older torch) is
reported in its table and the rest still runs. Kernels are timed with
triton.testing.do_bench (median of warm runs, L2 flushed between runs).

    python scripts/gpu_check.py                       # print the tables
    python scripts/gpu_check.py --out benchmarks/results/gpu-h200.md
    python scripts/gpu_check.py --quick               # smaller shapes, no tuning
    python scripts/gpu_check.py --cute                # only kiln's CuTeDSL GEMMs (scripts/gpu_check_cute.py)
    python scripts/gpu_check.py --nccl                # only kiln's NCCL layer (scripts/gpu_check_nccl.py)
                                                      # and CUDA symmetric memory between two
                                                      # processes (scripts/gpu_check_symmetric.py)
    python scripts/gpu_check.py --device --out benchmarks/results/gpu.md   # only the device runtime

Needs: an NVIDIA GPU, a CUDA build of torch, triton. Exits with status 2 and says what
is missing when there is no GPU.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
import traceback

COPY_CEILING_TBS = 4.3  # H200 device-to-device copy, measured (the ceiling)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda"

# grouped GEMM numerics: name, dtype, group sizes, K, N, options, float32 input precision
NUMERIC_CASES = [
    ("ragged + empty", "float32", [37, 0, 128, 1, 300, 0, 66], 200, 136, {}, "ieee"),
    ("ragged, tf32", "float32", [37, 0, 128, 1, 300], 256, 128, {}, "tf32"),
    ("silu + bias + router scale", "bfloat16", [512, 3, 0, 1000, 77], 1024, 768,
     {"activation": "silu", "bias": True, "row_scale": True}, "ieee"),
    ("gelu, alpha, to float32", "float16", [64, 64, 0, 129], 512, 320,
     {"activation": "gelu", "alpha": 0.125, "out_dtype": "float32"}, "ieee"),
    ("gelu_tanh, w [E, N, K]", "bfloat16", [250, 0, 6, 400], 384, 512,
     {"activation": "gelu_tanh", "transpose_rhs": True}, "ieee"),
    ("relu, all tokens one expert", "float16", [0, 0, 4096, 0], 256, 256, {"activation": "relu"}, "ieee"),
    ("no tokens", "bfloat16", [0, 0, 0], 64, 64, {}, "ieee"),
]
# grouped GEMM speed: name, routed rows (tokens x top-k), K, N, experts, skewed router
SPEED_SHAPES = [
    ("Mixtral-8x7B up (8192 rows)", 8192, 4096, 14336, 8, False),
    ("Mixtral-8x7B down", 8192, 14336, 4096, 8, False),
    ("64 experts, skewed router", 16384, 2048, 1408, 64, True),
    ("DeepSeek-V3-like, 256 experts", 32768, 7168, 2048, 256, False),
    ("decode: 64 rows, 64 experts", 64, 2048, 1408, 64, False),
]
TUNING_SHAPE = (8192, 4096, 14336, 8)  # rows, K, N, experts
# the weight-gradient kernel: name, dtype, group sizes, K, N (float32 output)
DW_CASES = [
    ("dw: ragged + empty", "bfloat16", [300, 0, 17, 1024, 5], 512, 384),
    ("dw: float32", "float32", [64, 0, 200], 256, 128),
]


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    def __init__(self):
        self.sections: list[str] = []

    def add(self, title: str, body: str) -> None:
        text = f"## {title}\n\n{body}\n"
        print(text, flush=True)
        self.sections.append(text)

    def failed(self, title: str, exc: BaseException) -> None:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        self.add(title, f"**not run**: {last}")


def gpu_or_exit():
    """torch with a CUDA GPU, or exit 2 with what is missing."""
    try:
        import torch
    except ImportError:
        sys.exit("gpu_check: torch is not installed; the GPU check needs a CUDA build of torch "
                 "(and triton) on a machine with an NVIDIA GPU")
    if not torch.cuda.is_available():
        print("gpu_check: no GPU: torch.cuda.is_available() is False (torch "
              f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). This script checks "
              "kiln's Triton kernels on an NVIDIA GPU; run it on a GPU machine.", file=sys.stderr)
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("gpu_check: triton is not installed")
    return torch


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


# -- 1. grouped GEMM numerics ---------------------------------------------------------------------

def grouped_numerics(torch, report: Report, quick: bool) -> None:
    from kiln.codegen.triton.grouped_gemm import grouped_gemm

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cases = NUMERIC_CASES
    if quick:
        cases = cases[:3]
    acts = {"none": lambda v: v, "relu": torch.relu, "silu": torch.nn.functional.silu,
            "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}
    rows = []
    for name, dtype, sizes, k, n, opts, precision in cases:
        opts = dict(opts)
        dt = getattr(torch, dtype)
        tokens, experts = sum(sizes), len(sizes)
        x = torch.randn((tokens, k), device=DEVICE, generator=gen).to(dt)
        shape = (experts, n, k) if opts.get("transpose_rhs") else (experts, k, n)
        w = (torch.randn(shape, device=DEVICE, generator=gen) / math.sqrt(k)).to(dt)
        bias = torch.randn((experts, n), device=DEVICE, generator=gen) if opts.pop("bias", False) else None
        scale = torch.rand(tokens, device=DEVICE, generator=gen) if opts.pop("row_scale", False) else None
        sizes_t = torch.tensor(sizes, device=DEVICE, dtype=torch.int32)
        y = grouped_gemm(x, w, sizes_t, bias=bias, row_scale=scale, input_precision=precision, **opts)
        torch.cuda.synchronize()
        # float64 reference on the GPU
        ref = torch.empty((tokens, n), device=DEVICE, dtype=torch.float64)
        start = 0
        for e, m in enumerate(sizes):
            we = w[e].double().T if opts.get("transpose_rhs") else w[e].double()
            v = x[start:start + m].double() @ we * opts.get("alpha", 1.0)
            if bias is not None:
                v = v + bias[e].double()
            ref[start:start + m] = acts[opts.get("activation", "none")](v)
            start += m
        if scale is not None:
            ref = ref * scale.double()[:, None]
        out_dtype = opts.get("out_dtype", dtype)
        # relative to the largest output: the output dtype's rounding, or tf32's products
        tol = 5e-3 if precision == "tf32" else {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}[out_dtype]
        err = float((y.double() - ref).abs().max()) if tokens else 0.0
        scale_ref = max(1.0, float(ref.abs().max())) if tokens else 1.0
        ok = err <= tol * scale_ref and y.dtype == getattr(torch, out_dtype)
        rows.append([name, dtype, precision, str(sizes), f"{k}x{n}", f"{err:.2e}",
                     f"{tol * scale_ref:.1e}", "ok" if ok else "**FAIL**"])
    from kiln.codegen.triton.grouped_gemm import grouped_gemm_dw

    for name, dtype, sizes, k, n in DW_CASES:  # the weight gradient z[e] = x_e^T @ y_e
        dt = getattr(torch, dtype)
        x = torch.randn((sum(sizes), k), device=DEVICE, generator=gen).to(dt)
        y = torch.randn((sum(sizes), n), device=DEVICE, generator=gen).to(dt)
        z = grouped_gemm_dw(x, y, torch.tensor(sizes, device=DEVICE, dtype=torch.int32),
                            out_dtype="float32")
        offsets = [0] + list(itertools.accumulate(sizes))
        ref = torch.stack([x[a:b].double().T @ y[a:b].double() for a, b in zip(offsets, offsets[1:])])
        err = float((z.double() - ref).abs().max())
        tol = 1e-4 * max(1.0, float(ref.abs().max()))
        rows.append([name, dtype, "ieee", str(sizes), f"{k}x{n}", f"{err:.2e}", f"{tol:.1e}",
                     "ok" if err <= tol else "**FAIL**"])
    report.add("Grouped GEMM numerics (vs float64 torch)",
               table(["case", "dtype", "precision", "group sizes", "K x N", "max abs err",
                      "tolerance", "result"], rows))


# -- 2. grouped GEMM speed -------------------------------------------------------------------------

def _moe_problem(torch, tokens, k, n, experts, dtype, skew: bool, gen):
    import numpy as np

    from kiln.codegen.triton.grouped_gemm import balanced_sizes

    if skew:  # a router's imbalance: Zipf-like expert popularity
        weights = 1.0 / np.arange(1, experts + 1) ** 0.8
        sizes = np.random.default_rng(0).multinomial(tokens, weights / weights.sum()).astype(np.int32)
    else:
        sizes = balanced_sizes(tokens, experts)
    dt = getattr(torch, dtype)
    x = torch.randn((tokens, k), device=DEVICE, generator=gen).to(dt)
    w = (torch.randn((experts, k, n), device=DEVICE, generator=gen) / math.sqrt(k)).to(dt)
    return x, w, sizes


def grouped_speed(torch, report: Report, quick: bool, device) -> None:
    from kiln.codegen.triton.grouped_gemm import grouped_gemm
    from kiln.codegen.triton.tile_selector import rank

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shapes = SPEED_SHAPES
    if quick:
        shapes = [shapes[0], shapes[2], shapes[4]]
    grouped_mm = getattr(torch, "_grouped_mm", None)
    rows = []
    for name, tokens, k, n, experts, skew in shapes:
        x, w, sizes = _moe_problem(torch, tokens, k, n, experts, "bfloat16", skew, gen)
        sizes_t = torch.tensor(sizes, device=DEVICE)
        flops = 2.0 * tokens * k * n
        est = rank("grouped_gemm", tokens, n, k, "bfloat16", device, group_sizes=sizes)[0]
        y = torch.empty((tokens, n), device=DEVICE, dtype=torch.bfloat16)
        kiln_ms = bench_ms(lambda: grouped_gemm(x, w, sizes_t, config=est.config, out=y))
        offsets = [0] + list(map(int, sizes.cumsum()))
        y_loop = torch.empty_like(y)

        def loop():
            for e in range(experts):
                a, b = offsets[e], offsets[e + 1]
                if b > a:
                    torch.matmul(x[a:b], w[e], out=y_loop[a:b])

        loop_ms = bench_ms(loop)
        err = float((y.float() - y_loop.float()).abs().max())
        gm_cell = "n/a"
        if grouped_mm is not None:
            try:
                offs = torch.tensor(offsets[1:], device=DEVICE, dtype=torch.int32)
                gm_ms = bench_ms(lambda: grouped_mm(x, w, offs=offs))
                gm_cell = f"{flops / gm_ms / 1e9:.0f}"
            except Exception as exc:  # older torch, or an unsupported layout
                gm_cell = f"n/a ({type(exc).__name__})"
        rows.append([name, f"{tokens} x {k} x {n}, E={experts}", str(est.config),
                     f"{flops / kiln_ms / 1e9:.0f}", f"{est.tflops:.0f}", f"{flops / loop_ms / 1e9:.0f}",
                     gm_cell, f"{loop_ms / kiln_ms:.2f}x", f"{err:.1e}"])
    from kiln.codegen.triton.grouped_gemm import grouped_gemm_dw

    for name, tokens, k, n, experts, skew in shapes[:1]:  # the weight gradient of the first shape
        x, _, sizes = _moe_problem(torch, tokens, k, n, experts, "bfloat16", skew, gen)
        g = torch.randn((tokens, n), device=DEVICE, generator=gen).to(torch.bfloat16)
        sizes_t = torch.tensor(sizes, device=DEVICE)
        flops = 2.0 * tokens * k * n
        z = torch.empty((experts, k, n), device=DEVICE, dtype=torch.bfloat16)
        kiln_ms = bench_ms(lambda: grouped_gemm_dw(x, g, sizes_t, out=z))
        offsets = [0] + list(map(int, sizes.cumsum()))
        z_loop = torch.empty_like(z)

        def loop():
            for e in range(experts):
                torch.matmul(x[offsets[e]:offsets[e + 1]].T, g[offsets[e]:offsets[e + 1]], out=z_loop[e])

        loop_ms = bench_ms(loop)
        err = float((z.float() - z_loop.float()).abs().max() / max(1.0, float(z_loop.float().abs().max())))
        rows.append([f"{name}: weight gradient", f"{tokens} x {k} x {n}, E={experts}", "(dw kernel)",
                     f"{flops / kiln_ms / 1e9:.0f}", "", f"{flops / loop_ms / 1e9:.0f}", "n/a",
                     f"{loop_ms / kiln_ms:.2f}x", f"{err:.1e} (rel)"])
    report.add("Grouped GEMM speed (bfloat16, TFLOP/s)",
               table(["shape", "rows x K x N", "kiln config (analytical)", "kiln", "model",
                      "torch.matmul loop", "torch._grouped_mm", "kiln vs loop", "max |kiln - loop|"],
                     rows))


def grouped_tuning(torch, report: Report, device) -> None:
    """max-autotune on one shape: is the model's first choice the measured best?"""
    from kiln.codegen.triton.grouped_gemm import make_benchmark
    from kiln.codegen.triton.tile_selector import rank

    tokens, k, n, experts = TUNING_SHAPE
    ests = rank("grouped_gemm", tokens, n, k, "bfloat16", device, num_experts=experts)
    bench = make_benchmark(tokens, n, k, "bfloat16", experts, device=DEVICE)
    flops = 2.0 * tokens * k * n
    rows = []
    for i, e in enumerate(ests[:8]):
        try:
            ms = bench(e.config) * 1e3
            rows.append([i, str(e.config), f"{e.time * 1e3:.3f}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}"])
        except Exception as exc:
            rows.append([i, str(e.config), f"{e.time * 1e3:.3f}", f"failed: {type(exc).__name__}", ""])
    report.add(f"Tile selector: model rank vs measured ({tokens} x {k} x {n}, {experts} experts, bf16)",
               table(["model rank", "config", "model ms", "measured ms", "TFLOP/s"], rows))


# -- 3. kernels generated from Kernel IR ----------------------------------------------------------

def _kernel_of(compiled):
    """The single generated GpuKernel of a compiled one-kernel function, and its program."""
    graph = compiled.compiled_graphs()[0]
    kernels = graph.executable.kernels
    if len(kernels) != 1:
        raise RuntimeError(f"expected one fused kernel, got {len(kernels)}")
    return next(iter(kernels.values())), graph


def generated_kernels(torch, report: Report, quick: bool) -> None:
    import numpy as np

    import kiln as kn

    n = 1 << (24 if quick else 27)  # float32 elements per operand
    rows_n, cols = (4096, 4096) if quick else (16384, 8192)
    rng = np.random.default_rng(0)
    rows = []

    # copy ceiling of this GPU, as torch measures it
    src = torch.empty(n, device=DEVICE, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_tbs = 2 * n * 4 / copy_ms / 1e9  # bytes per ms / 1e9 = TB/s
    rows.append(["torch copy (the ceiling on this GPU)", "", f"{copy_tbs * 1e3:.0f}",
                 f"{copy_tbs / COPY_CEILING_TBS:.0%}", "", ""])

    cases = [
        ("pointwise x * 2 + y", lambda x, y: x * 2 + y,
         lambda x, y: x * 2 + y, [(n,), (n,)], 3 * n * 4),
        ("softmax(dim=-1)", lambda x: kn.softmax(x, dim=-1),
         lambda x: torch.softmax(x, dim=-1), [(rows_n, cols)], 2 * rows_n * cols * 4),
        ("layer_norm", lambda x, w, b: kn.layer_norm(x, (cols,), w, b),
         lambda x, w, b: torch.nn.functional.layer_norm(x, (cols,), w, b),
         [(rows_n, cols), (cols,), (cols,)], 2 * rows_n * cols * 4),
    ]
    for name, fn, torch_fn, shapes, moved in cases:
        try:
            arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            compiled = kn.compile(fn, backend="cuda")
            got = compiled(*arrays).numpy()
            tensors = [torch.from_numpy(a).to(DEVICE) for a in arrays]
            want = torch_fn(*tensors).cpu().numpy()
            err = float(np.abs(got - want).max())
            ok = err <= 1e-5 * max(1.0, float(np.abs(want).max()))
            torch_ms = bench_ms(lambda: torch_fn(*tensors))
            try:  # the generated kernel alone, on device buffers (no host copies)
                kernel, graph = _kernel_of(compiled)
                out = torch.empty_like(tensors[0])
                kiln_ms = bench_ms(lambda: kernel(tensors + [out], {}))
                timing = f"{moved / kiln_ms / 1e6:.0f}"
            except Exception as exc:  # several kernels, or a launcher that wants host arrays
                kiln_ms = bench_ms(lambda: compiled(*arrays))
                timing = f"{moved / kiln_ms / 1e6:.0f} (end to end, incl. host copies: {type(exc).__name__})"
            rows.append([name, f"{'ok' if ok else '**FAIL**'} ({err:.1e})", timing,
                         f"{moved / kiln_ms / 1e9 / COPY_CEILING_TBS:.0%}",
                         f"{moved / torch_ms / 1e6:.0f}", f"{torch_ms / kiln_ms:.2f}x"])
        except Exception as exc:
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            rows.append([name, f"not run: {last}", "", "", "", ""])
    report.add("Kernels generated from Kernel IR (float32; GB/s = bytes moved / time)",
               table(["kernel", "numerics vs torch", "kiln GB/s", "of 4.3 TB/s", "torch eager GB/s",
                      "kiln vs torch"], rows))


def _device_part(torch, report: Report, quick: bool) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_check_device

    gpu_check_device.run(torch, report, table, quick)


# -- driver -------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check kiln's Triton kernels on an NVIDIA GPU "
                                                 "(numerics and speed, markdown tables).")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, no tuning (~1 minute)")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                                   "numerics,speed,tuning,generated,device")
    parser.add_argument("--cute", action="store_true", help="only the CuTeDSL GEMMs: numerics of every "
                        "epilogue and dtype, TFLOP/s vs cuBLAS and _scaled_mm (needs nvidia-cutlass-dsl: "
                        "see scripts/gpu_check_cute.py for how its wheels travel)")
    parser.add_argument("--nccl", action="store_true", help="only kiln's NCCL layer on one GPU: "
                        "single-rank communicator, split/revoke/shrink, window put/signal, the "
                        "ProcessGroup (scripts/gpu_check_nccl.py; libnccl >= 2.29 via "
                        "KILN_NCCL_LIBRARY or KILN_NCCL_WHEELS), then CUDA symmetric memory "
                        "between two processes (scripts/gpu_check_symmetric.py)")
    parser.add_argument("--device", action="store_true", help="only the device runtime: device-resident "
                        "programs with host copies counted, CUDA-graph replay, a captured while_loop, "
                        "allocator vs cuMemGetInfo, DLPack with torch (scripts/gpu_check_device.py)")
    args = parser.parse_args(argv)
    torch = gpu_or_exit()
    sys.path.insert(0, ROOT)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton

    import kiln
    from kiln.codegen.triton.tile_selector import device_for_name

    props = torch.cuda.get_device_properties(0)
    arch = f"sm_{props.major}{props.minor}"
    device = device_for_name(props.name, arch if arch in ("sm_80", "sm_90", "sm_100") else "sm_90")
    skip = set(filter(None, args.skip.split(",")))
    report = Report()
    report.add("Machine", table(["GPU", "SMs", "memory", "model", "torch", "triton", "kiln", "python"],
                                [[props.name, props.multi_processor_count,
                                  f"{props.total_memory / 2 ** 30:.0f} GiB", device.name, torch.__version__,
                                  triton.__version__, kiln.__version__, platform.python_version()]]))
    start = time.perf_counter()
    parts = [("numerics", "Grouped GEMM numerics", lambda: grouped_numerics(torch, report, args.quick)),
             ("speed", "Grouped GEMM speed", lambda: grouped_speed(torch, report, args.quick, device)),
             ("tuning", "Tile selector vs measurement", lambda: grouped_tuning(torch, report, device)),
             ("generated", "Generated kernels", lambda: generated_kernels(torch, report, args.quick)),
             ("device", "Device runtime", lambda: _device_part(torch, report, args.quick))]
    if args.device:  # the device-runtime part alone (about a minute of GPU time)
        parts = parts[-1:]
    if args.cute:  # the CuTeDSL part replaces the Triton parts (a few minutes of GPU time)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check_cute

        parts = [("cute", "CuTeDSL GEMMs",
                  lambda: gpu_check_cute.run(torch, report, table, bench_ms, args.quick))]
    if args.nccl:  # the NCCL part replaces the kernel parts (under a minute of GPU time)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check_nccl

        import gpu_check_symmetric

        parts = [("nccl", "NCCL", lambda: gpu_check_nccl.run(torch, report, table, args.quick)),
                 ("symmetric", "CUDA symmetric memory",  # two processes, no NCCL needed
                  lambda: gpu_check_symmetric.run(report, table))]
    for key, title, run in parts:
        if key in skip or (args.quick and key == "tuning"):
            continue
        try:
            run()
        except Exception as exc:  # one part failing must not hide the others
            report.failed(title, exc)
    report.add("Run", f"{time.perf_counter() - start:.0f} s on {props.name}, "
                      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(f"# kiln GPU check: {props.name}\n\n" + "\n".join(report.sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
