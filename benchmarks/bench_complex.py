"""Complex numbers compiled as real kernels: a complex elementwise chain and a complex
GEMM, kiln.compile against numpy, torch eager and jax.jit, side by side in one run.

    .venv/bin/python benchmarks/bench_complex.py [--quick] [--out benchmarks/results/cpu.md]

kiln's `complex` pass turns complex64 arithmetic into float32 (re, im) arithmetic on the
interleaved memory: the chain is one loop kernel reading the pairs of z and w in place and
storing the result's pairs (no split or pack step); the GEMM is 4M as ONE real GEMM of A's
memory as (m, 2k) by a (2k, 2n) block of B, whose output is the result's memory (see
docs/complex.md), measured beside the four-GEMM 4M form and KILN_COMPLEX_GEMM=3m. Every implementation of a row is timed in alternating rounds
(the median of the rounds' medians, and the minimum over all repeats, less disturbed by
other jobs), so load drift on a shared machine hits them alike; ratios are from the same run. torch.compile is not run: Inductor falls back to eager for
complex tensors.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

import kiln as kn
import kiln.passes.complex_decompose as complex_decompose

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, timings, write_section  # noqa: E402


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
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per row")
    args = parser.parse_args()
    repeat = 3 if args.quick else 5
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
    load_before = os.getloadavg()[0]
    for key, label, kfn, npfn, inputs in cases:
        row = {"workload": label}
        want = npfn(*inputs)
        fns = {}
        variants = [("kiln", "4m", True)]
        if key == "gemm":
            variants += [("kiln 4 GEMMs", "4m", False), ("kiln 3M", "3m", True)]
        for name, method, block in variants:
            os.environ["KILN_COMPLEX_GEMM"] = method
            complex_decompose.BLOCK_GEMM = block
            try:
                fn = kn.compile(kfn)
                got = fn(*inputs).numpy()
            finally:
                os.environ.pop("KILN_COMPLEX_GEMM", None)
                complex_decompose.BLOCK_GEMM = True
            row[f"{name} rel err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            fns[name] = (lambda fn: lambda: fn(*inputs))(fn)
        fns["numpy"] = lambda: npfn(*inputs)
        if torch is not None:
            tin = [torch.from_numpy(x) for x in inputs]
            tfn = (lambda z, w: chain_t(torch, z, w)) if key == "chain" else (lambda a, b: a @ b)
            fns["torch eager"] = lambda: tfn(*tin)
        if jax is not None:
            jfn = jax.jit((lambda z, w: jnp.exp(z) * w + z * 0.5 - jnp.abs(z)) if key == "chain"
                          else (lambda a, b: a @ b))
            jin = [jnp.asarray(x) for x in inputs]
            fns["jax.jit"] = lambda: jfn(*jin).block_until_ready()
        rounds: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                rounds[name].append(timings(fn, repeat))
        row.update({name: float(np.median([t[0] for t in ts])) for name, ts in rounds.items()})
        row.update({f"{name} min": min(t[1] for t in ts) for name, ts in rounds.items()})
        rows.append(row)
        print(row, flush=True)
    table = render(rows, args, load_before)
    table += "\n" + render_small(small_products(rng, torch, jax, args.rounds, args.quick))
    print(table)
    if args.out:
        write_section(args.out, "bench_complex", table)
    return 0


def render(rows, args, load_before: float) -> str:
    model = cpu_model()
    cols = ["kiln", "kiln 4 GEMMs", "kiln 3M", "numpy", "torch eager", "jax.jit"]
    lines = ["## Complex numbers as real kernels (issue 21)", "",
             f"`.venv/bin/python benchmarks/bench_complex.py{' --quick' if args.quick else ''}` on "
             f"{model}, {datetime.date.today()}, load average {load_before:.1f} before and "
             f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs (a shared machine: compare "
             f"within a row only); {args.rounds} alternating rounds; `kiln` is the default (complex "
             "on the interleaved memory; for the GEMM: 4M as one real GEMM of A's memory), `kiln 4 "
             "GEMMs` the four-GEMM 4M form; ratios are the other's time over kiln's (same run).", ""]
    for title, suffix in (("Medians, ms", ""), ("Minimums, ms", " min")):
        lines += [f"{title}:", "",
                  "| workload | " + " | ".join(cols) + " | kiln rel err | numpy / kiln | jax.jit / kiln |",
                  "|---" * (len(cols) + 4) + "|"]
        for r in rows:
            cells = [f"{r[c + suffix] * 1e3:.2f}" if c + suffix in r else "-" for c in cols]
            jax_ratio = (f"{r['jax.jit' + suffix] / r['kiln' + suffix]:.2f}x"
                         if "jax.jit" + suffix in r else "-")
            lines.append(f"| {r['workload']} | " + " | ".join(cells)
                         + f" | {r['kiln rel err']:.1e} | {r['numpy' + suffix] / r['kiln' + suffix]:.2f}x"
                         + f" | {jax_ratio} |")
        lines.append("")
    return "\n".join(lines)


SMALL_SIZES = (16, 32, 64, 128)
SMALL_CALLS = 200  # calls per timed block


def small_products(rng, torch, jax, rounds: int, quick: bool) -> list[dict]:
    """Per-call time of small complex64 products (n x n x n), where the call's fixed
    cost decides: kiln.compile (below 32^3 multiply-adds the real form, above it cgemm
    tiles), numpy, torch eager and jax.jit, in alternating rounds of SMALL_CALLS-call blocks."""
    rows = []
    for n in SMALL_SIZES[:2] if quick else SMALL_SIZES:
        a, b = _cplx(rng, n, n), _cplx(rng, n, n)
        want = a.astype(np.complex128) @ b.astype(np.complex128)
        fn = kn.compile(gemm_k)
        got = fn(a, b).numpy()
        fns = {"kiln": lambda fn=fn: fn(a, b), "numpy": lambda: a @ b}
        if torch is not None:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            fns["torch eager"] = lambda: ta @ tb
        if jax is not None:
            jf, ja, jb = jax.jit(lambda x, y: x @ y), jax.numpy.asarray(a), jax.numpy.asarray(b)
            fns["jax.jit"] = lambda: jf(ja, jb).block_until_ready()
        blocks = {name: (lambda f=f: [f() for _ in range(SMALL_CALLS)]) for name, f in fns.items()}
        rounds_t: dict[str, list] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, block in blocks.items():
                rounds_t[name].append(timings(block, 3))
        row = {"n": n, "rel err": float(np.max(np.abs(got - want)) / np.max(np.abs(want)))}
        for name, ts in rounds_t.items():
            row[name] = float(np.median([t[0] for t in ts])) / SMALL_CALLS
            row[name + " min"] = min(t[1] for t in ts) / SMALL_CALLS
        rows.append(row)
        print(row, flush=True)
    return rows


def render_small(rows: list[dict]) -> str:
    cols = [c for c in ("kiln", "numpy", "torch eager", "jax.jit") if rows and c in rows[0]]
    lines = ["Small complex64 products, us per call (compiled call included), median (minimum) "
             f"over the rounds of {SMALL_CALLS}-call blocks:", "",
             "| n x n x n | " + " | ".join(cols) + " | kiln rel err | best peer / kiln |",
             "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        peers = [c for c in cols if c != "kiln"]
        best = min(peers, key=lambda c: r[c])
        lines.append(f"| {r['n']} | " + " | ".join(f"{r[c] * 1e6:.1f} ({r[c + ' min'] * 1e6:.1f})" for c in cols)
                     + f" | {r['rel err']:.1e} | {r[best] / r['kiln']:.2f}x ({best}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
