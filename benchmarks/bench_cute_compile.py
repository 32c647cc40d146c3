"""Compile time of kiln's CuTeDSL GEMMs ahead of time, on this CPU-only machine.

    .venv/bin/python benchmarks/bench_cute_compile.py [--repeat N] [--out benchmarks/results/cute.md]

Each case is compiled cold `--repeat` times, each time in a fresh Python process with an
empty KILN_CACHE_DIR (CuTeDSL keeps compiled functions in memory, so a second compile
in one process would measure its cache). "compile" is `cute.compile` alone (tracing,
MLIR passes, NVVM to PTX, ptxas to cubin); "cold total" adds kiln's part (epilogue,
fake tensors, the tile choice of a dense GEMM, cache store) but not the Python and CuTeDSL import. "cache
hit" is loading the stored PTX + cubin in the same process afterwards (authenticated
read, ELF check, decode). Medians of the runs; the machine is shared, so compare rows
of one run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def cases() -> dict:
    """name -> GemmKernel (built like the tests' kernels)."""
    from kiln.ir import dtypes as dt
    from tests.codegen.cute.gemms import full_epilogue, gemm

    out = {}
    for arch in ("sm_90", "sm_100"):
        out.update({
            f"{arch}: bf16 4096^3, no epilogue": gemm(4096, 4096, 4096),
            f"{arch}: bf16 4096^3, bias+scales+gelu+silu+relu+residual": full_epilogue(4096, 4096, 4096),
            f"{arch}: fp16 8 x 1024^3 batched": gemm(1024, 1024, 1024, in_dtype=dt.float16,
                                                      out_dtype=dt.float16, batch=8),
            f"{arch}: fp8 e4m3 4096^3 (K-major b), bf16 out": gemm(4096, 4096, 4096, in_dtype=dt.float8_e4m3fn,
                                                                  b_rows=False),
        })
    for arch in ("sm_90a", "sm_100a"):  # the MoE grouped GEMM: (compile function, arguments)
        out[f"{arch[:-1]}: grouped bf16, 64 experts, K=2048 N=1408, silu+bias+router scale"] = (
            "grouped", (arch, dt.bfloat16, dt.bfloat16, 2048, 1408, 64),
            dict(activation="silu", bias=True, row_scale=True))
    for fmt in ("nvfp4", "mxfp8"):
        out[f"sm_100: block-scaled {fmt} 4096^3 -> bf16"] = (
            "blockscaled", (fmt, 4096, 4096, 4096, dt.bfloat16), dict(tensor_scale=fmt == "nvfp4"))
    return out


def _compiler(cc, name: str, case):
    """A function compiling `case` (for a dense GEMM: with the tile the selector picks,
    chosen when the function is first called, so the cache-hit timing excludes it)."""
    from kiln.codegen.cute.select import choose

    if isinstance(case, tuple):
        kind, args, kwargs = case
        fn = cc.compile_grouped_gemm if kind == "grouped" else cc.compile_blockscaled_gemm
        return lambda: fn(*args, **kwargs)
    picked = []

    def run():
        if not picked:
            picked.append(choose(case, name.split(":")[0]))
        return cc.compile_gemm(case, picked[0].arch, picked[0].tile)

    return run


def one(name: str) -> dict:
    """Compile one case cold in this process; its timings as a dict."""
    from kiln.codegen.cute import compile as cc

    run = _compiler(cc, name, cases()[name])
    start = time.perf_counter()
    art = run()
    total = time.perf_counter() - start
    start = time.perf_counter()
    again = run()
    hit = time.perf_counter() - start
    assert again.cubin == art.cubin
    return {"compile": art.compile_seconds, "total": total, "hit": hit, "tile": list(art.tile),
            "ptx_lines": art.ptx.count("\n"), "cubin": len(art.cubin)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cute.md"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one case, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    import cutlass

    rows = []
    for name in cases():
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, KILN_CACHE_DIR=os.path.join(cache, "kiln"))
                out = subprocess.run([sys.executable, __file__, "--one", name], env=env, capture_output=True,
                                     text=True, timeout=600, check=True).stdout
                runs.append(json.loads(out.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in ("compile", "total", "hit")}
        r0 = runs[0]
        rows.append(f"| {name} | {r0['tile'][0]}x{r0['tile'][1]} | {med['compile']:.2f} | {med['total']:.2f} | "
                    f"{med['hit'] * 1e3:.1f} | {r0['ptx_lines']} | {r0['cubin'] // 1024} |")
        print(rows[-1], flush=True)
    command = "python benchmarks/bench_cute_compile.py" + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
    text = "\n".join([
        "# CuTeDSL GEMM compile times (ahead of time, no GPU)", "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_model()} (`lscpu`), {os.cpu_count()} logical CPUs, shared with other jobs, no GPU  ",
        f"Date: {datetime.date.today().isoformat()}; nvidia-cutlass-dsl {getattr(cutlass, '__version__', '?')}, "
        f"targets sm_90a (wgmma) and sm_100a (tcgen05); medians of {args.repeat} cold compiles, each in a fresh process and cache", "",
        "| arch: kernel | tile | cute.compile (s) | cold total (s) | cache hit (ms) | PTX lines | cubin KiB |",
        "|---|---|---|---|---|---|---|", *rows, "",
        "The epilogue is traced once per accumulator element inside a fully unrolled loop; its cost",
        "is the difference between the first two rows. A cache hit is what every later process pays.",
    ])
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
