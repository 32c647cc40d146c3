"""CNN and loss building blocks on the CPU: kiln.compile against torch eager and jax.jit,
side by side in one process (bench_cpu's `interleaved` turns).

    .venv/bin/python benchmarks/bench_nn_ops.py [--rounds 5] [--out benchmarks/results/cpu.md]

Rows: pooling, batch norm (training statistics), nearest upsampling and cross entropy
over class indices (forward, and the gradient with respect to the logits) at the sizes
of a small ResNet batch and an ImageNet-sized classifier head; sort, topk, gather, an
embedding lookup, cumsum and a complex fft. Each row's kiln result is
checked against torch's first.
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


def rows(torch):
    F, T = kn.nn.functional, torch.nn.functional
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64, 56, 56)).astype(np.float32)
    g, b = np.ones(64, np.float32), np.zeros(64, np.float32)
    logits = (3 * rng.standard_normal((4096, 1000))).astype(np.float32)
    target = rng.integers(0, 1000, 4096)
    yield "max_pool2d 3x3 stride 2, (32, 64, 56, 56)", (lambda a: F.max_pool2d(a, 3, 2, 1)), \
        (lambda a: T.max_pool2d(a, 3, 2, 1)), (x,)
    yield "avg_pool2d 2x2, (32, 64, 56, 56)", (lambda a: F.avg_pool2d(a, 2)), (lambda a: T.avg_pool2d(a, 2)), (x,)
    yield "adaptive_avg_pool2d to 1x1, (32, 64, 56, 56)", (lambda a: F.adaptive_avg_pool2d(a, 1)), \
        (lambda a: T.adaptive_avg_pool2d(a, 1)), (x,)
    yield "batch_norm (training), (32, 64, 56, 56)", \
        (lambda a, g, b: F.batch_norm(a, None, None, g, b, training=True)), \
        (lambda a, g, b: T.batch_norm(a, None, None, g, b, training=True)), (x, g, b)
    yield "interpolate nearest x2, (8, 64, 56, 56)", \
        (lambda a: F.interpolate(a, scale_factor=2, mode="nearest")), \
        (lambda a: T.interpolate(a, scale_factor=2, mode="nearest")), (x[:8].copy(),)
    yield "cross_entropy, (4096, 1000) logits", (lambda z, t: F.cross_entropy(z, t)), \
        (lambda z, t: T.cross_entropy(z, t)), (logits, target)
    yield "cross_entropy gradient, (4096, 1000)", kn.grad(lambda z, t: F.cross_entropy(z, t)), \
        "grad", (logits, target)
    m = rng.standard_normal((1024, 1024)).astype(np.float32)
    cols = rng.integers(0, 1024, (1024, 64))
    table, tokens = rng.standard_normal((50000, 256)).astype(np.float32), rng.integers(0, 50000, (32, 128))
    yield "sort along rows, (1024, 1024)", (lambda a: kn.sort(a, dim=1)[0]), (lambda a: torch.sort(a, dim=1)[0]), (m,)
    yield "topk 10 along rows, (1024, 1024)", (lambda a: kn.topk(a, 10)[0]), (lambda a: torch.topk(a, 10)[0]), (m,)
    yield "gather 64 of 1024 a row, (1024, 1024)", (lambda a, i: kn.gather(a, 1, i)), \
        (lambda a, i: torch.gather(a, 1, i)), (m, cols)
    yield "embedding, 32 x 128 tokens of (50000, 256)", (lambda e, t: F.embedding(t, e)), \
        (lambda e, t: T.embedding(t, e)), (table, tokens)
    yield "cumsum along rows, (1024, 1024)", (lambda a: kn.cumsum(a, dim=1)), (lambda a: torch.cumsum(a, 1)), (m,)
    yield "cumsum along columns, (1024, 1024)", (lambda a: kn.cumsum(a, dim=0)), (lambda a: torch.cumsum(a, 0)), (m,)
    z = (rng.standard_normal((256, 1024)) + 1j * rng.standard_normal((256, 1024))).astype(np.complex64)
    yield "fft of 256 x 1024 complex64 along rows", (lambda a: kn.fft.fft(a)), (lambda a: torch.fft.fft(a)), (z,)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the table into this results file (section bench_nn_ops)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    load0 = os.getloadavg()[0]
    table = []
    for label, kfn, tfn, args_np in rows(torch):
        f = kn.compile(kfn)
        targs = [torch.from_numpy(a) for a in args_np]
        if tfn == "grad":
            z = targs[0].clone().requires_grad_()

            def tcall(z=z, t=targs[1]):
                z.grad = None
                torch.nn.functional.cross_entropy(z, t).backward()
                return z.grad
        else:
            def tcall(tfn=tfn, targs=targs):
                with torch.no_grad():
                    return tfn(*targs)
        want, got = tcall().numpy(), f(*args_np).numpy()
        err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
        times = interleaved({"kiln": lambda: f(*args_np), "torch eager": tcall}, args.rounds)
        table.append({"workload": label, "err": err, **times})
        print(label, {k: (round(v[0] * 1e3, 3), round(v[1] * 1e3, 3)) for k, v in times.items()}, flush=True)
    lines = ["## CNN and loss building blocks: kiln.compile vs torch eager (bench_nn_ops.py)", "",
             f"- command: `.venv/bin/python benchmarks/bench_nn_ops.py --rounds {args.rounds}`",
             f"- machine: {os.cpu_count()} CPUs, {cpu_model()}; load average {load0:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after; date {datetime.date.today()}",
             "- float32; ms per call, median (minimum) over the rounds; `x`: torch's time over "
             "kiln's; `err`: kiln's largest difference from torch relative to torch's largest value", "",
             "| workload | kiln | torch eager | torch / kiln | err |", "|---|---|---|---|---|"]
    for r in table:
        k, t = r["kiln"], r["torch eager"]
        lines.append(f"| {r['workload']} | {k[0] * 1e3:.3f} ({k[1] * 1e3:.3f}) | {t[0] * 1e3:.3f} "
                     f"({t[1] * 1e3:.3f}) | {t[0] / k[0]:.2f}x ({t[1] / k[1]:.2f}x) | {r['err']:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(args.out, "bench_nn_ops", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
