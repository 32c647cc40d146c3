"""The OpenCL backend on this machine's OpenCL device (PoCL on the CPU here) against
kiln's LLVM backend and numpy, in one run, on the workloads of benchmarks/bench_cpu.py.

    .venv/bin/python benchmarks/bench_opencl.py [--full] [--repeat N] [--out benchmarks/results/opencl.md]

Every number is a median of repeated runs after a warm-up (which also compiles). PoCL is
not the product: the ratio to the LLVM backend says whether the generated OpenCL C is
sane (memory-bound kernels should be within 2x), not how an Intel GPU would do. Sizes are
bench_cpu.py's --quick sizes unless --full.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

import numpy as np

import kiln as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import workloads  # noqa: E402
from report import median_s  # noqa: E402


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def _memory_bound(full: bool) -> list:
    """A pure streaming kernel (no transcendental): what says the generated code is sane."""
    rng = np.random.default_rng(1)
    n = 1 << (24 if full else 22)
    x, a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    return [("axpb", f"x*a+b, 2^{n.bit_length() - 1} (memory-bound)", lambda x, a, b: x * a + b,
             lambda x, a, b: x * a + b, (x, a, b), 16 * n, 0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="bench_cpu.py's full sizes (default: its --quick sizes)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args()
    from kiln.codegen.opencl.runtime import context, no_device_reason

    reason = no_device_reason()
    if reason:
        print(f"no OpenCL device: {reason}")
        return 1
    device = context().device
    rows = []
    for name, label, kfn, npfn, inputs, nbytes, flops in _memory_bound(args.full) + list(workloads(quick=not args.full)):
        tensors = [kn.tensor(a) for a in inputs]
        row = {"name": name, "label": label, "bytes": nbytes, "flops": flops}
        results = {}
        for backend in ("cpu", "opencl"):
            f = kn.compile(kfn, backend=backend)
            try:
                results[backend] = np.asarray(f(*tensors).numpy())
                row[backend] = median_s(lambda: f(*tensors), args.repeat)
            except kn.KilnError as exc:  # reported in the table, not hidden
                row[backend] = None
                row[f"{backend}_error"] = str(exc).splitlines()[0][:80]
        if npfn is not None:
            row["numpy"] = median_s(lambda: npfn(*inputs), args.repeat)
        if "cpu" in results and "opencl" in results:
            ref = results["cpu"]
            scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
            row["max_diff"] = float(np.max(np.abs(results["opencl"] - ref))) / scale if ref.size else 0.0
        rows.append(row)
        print(_line(row), flush=True)
    text = render(rows, device, args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _line(row) -> str:
    ratio = row["opencl"] / row["cpu"] if row.get("opencl") and row.get("cpu") else None
    return (f"{row['label']:<48} llvm {_ms(row.get('cpu')):>9} ms  opencl {_ms(row.get('opencl')):>9} ms  "
            f"numpy {_ms(row.get('numpy')):>9} ms  opencl/llvm {'-' if ratio is None else f'{ratio:.2f}'}")


def render(rows, device, args) -> str:
    cmd = "python benchmarks/bench_opencl.py" + (" --full" if args.full else "") + f" --repeat {args.repeat}"
    lines = [
        "# OpenCL backend benchmark (PoCL)", "",
        f"Command: `{cmd}`  ",
        f"Machine: {cpu_model()} (`lscpu`), {os.cpu_count()} logical CPUs, shared with other jobs  ",
        f"OpenCL device: {device.name}, {device.platform.version}, driver {device.driver_version}, "
        f"{device.max_compute_units} compute units  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        "Medians of the repeats after a warm-up call (which compiles); ratios are of the same run.", "",
        "| workload | kiln LLVM (ms) | kiln OpenCL (ms) | numpy (ms) | OpenCL / LLVM | OpenCL GB/s | max rel. diff vs LLVM |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ocl, cpu = r.get("opencl"), r.get("cpu")
        ratio = f"{ocl / cpu:.2f}" if ocl and cpu else "-"
        gbs = f"{r['bytes'] / ocl / 1e9:.1f}" if ocl and r["bytes"] else "-"
        diff = f"{r['max_diff']:.1e}" if "max_diff" in r else "-"
        err = f" ({r['opencl_error']})" if r.get("opencl_error") else ""
        lines.append(f"| {r['label']}{err} | {_ms(cpu)} | {_ms(ocl)} | {_ms(r.get('numpy'))} | {ratio} | {gbs} | {diff} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
