"""Convolutions on the CPU: kiln.compile (im2col blocks and BLAS GEMMs over kiln's threads,
kiln/codegen/cpu/conv_native.py) against the op's numpy reference (what compiled
programs ran before), torch eager and jax.jit, side by side in one process.

    .venv/bin/python benchmarks/bench_conv.py [--quick] [--rounds 5] [--out benchmarks/results/cpu.md]

Rows: ResNet-like 2-d convolutions (3x3 at stride 1 and 2, 1x1, depthwise), a 1-d one,
a tiny one (the call's fixed cost), and the gradient of a 3x3 convolution (input and
kernel cotangents: convolutions too). Every implementation runs in turns (bench_cpu's
`interleaved`: shuffled rounds, an untimed warm-up per turn, then a timed block), so
load drift and other libraries' spinning threads hit all alike; ratios are same-run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

import kiln as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import interleaved  # noqa: E402
from report import cpu_model, write_section  # noqa: E402


def rows(quick: bool):
    """(label, x shape, w shape, stride, padding, groups, grad?)"""
    n = 8 if quick else 32
    yield "tiny 3x3", (1, 3, 8, 8), (4, 3, 3, 3), 1, 1, 1, False
    yield "3x3, 16 -> 32 ch, 32x32", (8, 16, 32, 32), (32, 16, 3, 3), 1, 1, 1, False
    yield "3x3, 64 -> 64 ch, 56x56", (n, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, False
    yield "3x3 stride 2, 64 -> 128 ch, 56x56", (n, 64, 56, 56), (128, 64, 3, 3), 2, 1, 1, False
    yield "1x1, 256 -> 64 ch, 14x14", (n, 256, 14, 14), (64, 256, 1, 1), 1, 0, 1, False
    yield "depthwise 3x3, 64 ch, 56x56", (n, 64, 56, 56), (64, 1, 3, 3), 1, 1, 64, False
    yield "1-d k=5, 64 -> 64 ch, 1024", (8, 64, 1024), (64, 64, 5), 1, 2, 1, False
    yield "grad of a 3x3, 32 -> 32 ch, 28x28", (8 if quick else 16, 32, 28, 28), (32, 32, 3, 3), 1, 1, 1, True


def implementations(xs, ws, stride, pad, groups, grad, peers: bool) -> tuple[dict, dict]:
    """({name: fn}, {name: result as numpy}) for one row."""
    from kiln.ir.ops.linalg import conv_attrs, conv_reference

    rng = np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32)
    d = len(xs) - 2
    F = kn.nn.functional
    conv_k = F.conv1d if d == 1 else F.conv2d
    if grad:
        kfn = kn.compile(kn.grad(lambda x, w: (conv_k(x, w, stride=stride, padding=pad, groups=groups) ** 2).sum(),
                                 argnums=(0, 1)))
    else:
        kfn = kn.compile(lambda x, w: conv_k(x, w, stride=stride, padding=pad, groups=groups))
    fns = {"kiln": lambda: kfn(x, w)}
    results = {}
    out = kfn(x, w)
    results["kiln"] = [o.numpy() for o in out] if grad else [out.numpy()]
    if not grad:
        attrs = conv_attrs("convolution", d, (stride,) * d, ((pad, pad),) * d, (1,) * d, groups)
        fns["reference (kiln before)"] = lambda: conv_reference(x, w, *attrs)
        results["reference (kiln before)"] = [fns["reference (kiln before)"]()]
    if peers:
        try:
            import torch

            torch.set_num_threads(os.cpu_count() or 1)
            tx, tw = torch.from_numpy(x), torch.from_numpy(w)
            conv_t = torch.nn.functional.conv1d if d == 1 else torch.nn.functional.conv2d
            if grad:
                txg, twg = tx.clone().requires_grad_(), tw.clone().requires_grad_()

                def tgrad():
                    txg.grad = twg.grad = None
                    (conv_t(txg, twg, stride=stride, padding=pad, groups=groups) ** 2).sum().backward()
                    return txg.grad, twg.grad
                fns["torch eager"] = tgrad
                results["torch eager"] = [g.numpy().copy() for g in tgrad()]
            else:
                with torch.no_grad():
                    fns["torch eager"] = lambda: conv_t(tx, tw, stride=stride, padding=pad, groups=groups)
                    results["torch eager"] = [fns["torch eager"]().numpy()]
        except ImportError:
            pass
        try:
            import jax

            dims = ("NCH", "OIH", "NCH") if d == 1 else ("NCHW", "OIHW", "NCHW")

            def jconv(x, w):
                return jax.lax.conv_general_dilated(x, w, (stride,) * d, ((pad, pad),) * d,
                                                    dimension_numbers=dims, feature_group_count=groups)
            jf = jax.jit(jax.grad(lambda x, w: (jconv(x, w) ** 2).sum(), argnums=(0, 1)) if grad else jconv)
            jx, jw = jax.numpy.asarray(x), jax.numpy.asarray(w)
            fns["jax.jit"] = lambda: jax.block_until_ready(jf(jx, jw))
            got = fns["jax.jit"]()
            results["jax.jit"] = [np.asarray(g) for g in got] if grad else [np.asarray(got)]
        except ImportError:
            pass
    return fns, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the table into this results file (section bench_conv)")
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    table = []
    for label, xs, ws, stride, pad, groups, grad in rows(args.quick):
        fns, results = implementations(xs, ws, stride, pad, groups, grad, not args.no_peers)
        oracle = results.get("torch eager", results.get("reference (kiln before)"))
        err = max(float(np.max(np.abs(k - o)) / max(np.max(np.abs(o)), 1e-30))
                  for k, o in zip(results["kiln"], oracle))
        times = interleaved(fns, args.rounds)
        row = {"workload": label, "err": err, **{k: v for k, v in times.items()}}
        table.append(row)
        print({k: (v if not isinstance(v, tuple) else (round(v[0] * 1e3, 3), round(v[1] * 1e3, 3)))
               for k, v in row.items()}, flush=True)
    text = render(table, args, load0)
    print(text)
    if args.out:
        write_section(args.out, "bench_conv", text)
    return 0


def render(table, args, load0: float) -> str:
    cols = ["kiln", "reference (kiln before)", "torch eager", "jax.jit"]
    cols = [c for c in cols if any(c in r for r in table)]
    lines = ["## Convolutions: kiln.compile vs the reference, torch and jax (bench_conv.py)", "",
             f"- command: `.venv/bin/python benchmarks/bench_conv.py{' --quick' if args.quick else ''}"
             f" --rounds {args.rounds}`",
             f"- machine: {os.cpu_count()} CPUs, {cpu_model()}; load average {load0:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after; date {datetime.date.today()}",
             "- float32, NCHW; ms per call, median (minimum) over the rounds; `x` is the best peer's "
             "(torch, jax) time over kiln's, by medians (by minimums); `err`: kiln's largest "
             "difference from torch, relative to torch's largest value", "",
             "| workload | " + " | ".join(cols) + " | best peer / kiln | before / kiln | err |",
             "|---" * (len(cols) + 4) + "|"]
    for r in table:
        cells = [f"{r[c][0] * 1e3:.3f} ({r[c][1] * 1e3:.3f})" if c in r else "-" for c in cols]
        peers = [c for c in ("torch eager", "jax.jit") if c in r]
        best = min(peers, key=lambda c: r[c][0]) if peers else None
        ratio = (f"{r[best][0] / r['kiln'][0]:.2f}x ({min(r[c][1] for c in peers) / r['kiln'][1]:.2f}x)"
                 if best else "-")
        before = (f"{r['reference (kiln before)'][0] / r['kiln'][0]:.1f}x" if "reference (kiln before)" in r else "-")
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + f" | {ratio} | {before} | {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
