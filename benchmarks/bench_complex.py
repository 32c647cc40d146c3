"""Complex numbers compiled as real kernels: a complex elementwise chain and a complex
GEMM, kiln.compile against numpy, torch eager and jax.jit, side by side in one run.

    .venv/bin/python benchmarks/bench_complex.py [--quick] [--out benchmarks/results/cpu.md]

kiln's `complex` pass turns complex64 arithmetic into float32 (re, im) arithmetic that
fuses into one loop kernel; the GEMM becomes 4 real GEMMs (4M, see docs/complex.md),
and KILN_COMPLEX_GEMM=3m is measured too. Medians after a warm-up; ratios are from the
same run. torch.compile is not run: Inductor falls back to eager for complex tensors.
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
from report import median_s, write_section  # noqa: E402


def chain_k(z, w):
    return kn.exp(z) * w + z * 0.5 - kn.abs(z)


def chain_np(z, w):
    return np.exp(z) * w + z * np.float32(0.5) - np.abs(z)


def chain_t(torch, z, w):
    return torch.exp(z) * w + z * 0.5 - torch.abs(z)


def gemm_k(a, b):
    return a @ b


def _cplx(rng, *shape):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="write the markdown table into this results file")
    args = parser.parse_args()
    repeat = 5 if args.quick else 9
    rng = np.random.default_rng(0)
    n = 1 << (20 if args.quick else 22)
    m = 256 if args.quick else 512
    cases = [("chain", f"exp(z)*w + z*0.5 - abs(z), complex64 2^{n.bit_length() - 1}",
              chain_k, chain_np, (_cplx(rng, n), _cplx(rng, n))),
             ("gemm", f"complex64 matmul {m}^3", gemm_k, gemm_k, (_cplx(rng, m, m), _cplx(rng, m, m)))]
    try:
        import torch
    except ImportError:
        torch = None
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        jax = None
    rows = []
    for key, label, kfn, npfn, inputs in cases:
        row = {"workload": label}
        want = npfn(*inputs)
        for variant in (["4m", "3m"] if key == "gemm" else ["4m"]):
            os.environ["KILN_COMPLEX_GEMM"] = variant
            fn = kn.compile(kfn)
            got = fn(*inputs).numpy()
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            name = "kiln" if variant == "4m" else "kiln 3M"
            row[name] = median_s(lambda: fn(*inputs), repeat)
            row[f"{name} rel err"] = err
        os.environ.pop("KILN_COMPLEX_GEMM", None)
        row["numpy"] = median_s(lambda: npfn(*inputs), repeat)
        if torch is not None:
            tin = [torch.from_numpy(x) for x in inputs]
            tfn = (lambda z, w: chain_t(torch, z, w)) if key == "chain" else (lambda a, b: a @ b)
            row["torch eager"] = median_s(lambda: tfn(*tin), repeat)
        if jax is not None:
            jfn = jax.jit((lambda z, w: jnp.exp(z) * w + z * 0.5 - jnp.abs(z)) if key == "chain"
                          else (lambda a, b: a @ b))
            jin = [jnp.asarray(x) for x in inputs]
            row["jax.jit"] = median_s(lambda: jfn(*jin).block_until_ready(), repeat)
        rows.append(row)
        print(row, flush=True)
    table = render(rows, args)
    print(table)
    if args.out:
        write_section(args.out, "bench_complex", table)
    return 0


def render(rows, args) -> str:
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                      if line.startswith("Model name")), platform.processor())
    except OSError:
        model = platform.processor()
    cols = ["kiln", "kiln 3M", "numpy", "torch eager", "jax.jit"]
    lines = ["## Complex numbers as real kernels (issue 21)", "",
             f"`.venv/bin/python benchmarks/bench_complex.py{' --quick' if args.quick else ''}` on "
             f"{model}, {datetime.date.today()}, load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPUs (a shared machine: compare within a row only); medians in "
             "ms; the last column is numpy's time over kiln's (same run).", "",
             "| workload | " + " | ".join(cols) + " | kiln rel err | numpy / kiln |",
             "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        cells = [f"{r[c] * 1e3:.2f}" if c in r else "-" for c in cols]
        lines.append(f"| {r['workload']} | " + " | ".join(cells)
                     + f" | {r['kiln rel err']:.1e} | {r['numpy'] / r['kiln']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
