"""Eager speed and threading (issue 22 items 1 and 5), all rows from one run:

- per-op eager overhead: a 64-op chain of 32x32 float32 tensors, kiln eager vs torch eager
  (and numpy, the floor kiln's eager mode builds on);
- eager `kn.value_and_grad` of a small MLP loss: the cached traced program vs re-tracing
  on every call (a fresh wrapper each call, as before issue 22), beside torch autograd;
- eager erf over 2^20 float32: the vectorized reference vs `np.frompyfunc(math.erf)`
  (what it replaced), beside torch.erf;
- a batched small GEMM (16,32,256)x(16,256,64): np.matmul with OpenBLAS's own threads
  vs one BLAS thread, and kiln compiled, each idle and beside a busy process spinning on
  one core.

    .venv/bin/python benchmarks/bench_eager.py [--out benchmarks/results/cpu.md] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

import kiln as kn
from kiln.ir import registry
from kiln.runtime import threads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import timings, write_section  # noqa: E402

try:
    import torch
except ImportError:  # the torch columns read "-"
    torch = None


def chain(x, y, tanh):
    """64 elementwise ops, values kept bounded."""
    for i in range(16):
        x = x + y
        x = x * 0.5
        x = tanh(x)
        x = x - y
    return x


def mlp_loss(w1, w2, x):
    h = (x @ w1).tanh()
    return ((h @ w2) ** 2).mean()


def _fmt(t: float) -> str:
    return f"{t * 1e6:.1f}"


def eager_chain(repeat: int) -> list[tuple]:
    """numpy, kiln and torch measured round-robin (every repetition runs each once, back to
    back), so the shared machine's load falls on them alike."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((32, 32), dtype=np.float32), rng.standard_normal((32, 32), dtype=np.float32)
    ka, kb = kn.tensor(a), kn.tensor(b)
    fns = {"numpy": lambda: chain(a, b, np.tanh), "kiln eager": lambda: chain(ka, kb, kn.tanh)}
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)

        fns["torch eager"] = lambda: chain(ta, tb, torch.tanh)
    times: dict = {name: [] for name in fns}
    with (torch.no_grad() if torch is not None else _nothing()):
        for _ in range(3):
            for fn in fns.values():
                fn()
        for _ in range(repeat):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    rows = [(name, (float(np.median(t)), float(np.min(t)))) for name, t in times.items()]
    if torch is not None:  # torch's default threads can spin on a busy machine: one thread too
        with torch.no_grad(), _torch_threads(1):
            rows.append(("torch eager, 1 thread (after the others)",
                         timings(lambda: chain(ta, tb, torch.tanh), repeat, 3)))
    return rows


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _torch_threads:
    """torch's intra-op threads set to `n` inside the block (its default spins on a busy box)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def eager_grad(repeat: int) -> list[tuple]:
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((64, 128), dtype=np.float32) * 0.1
    w2 = rng.standard_normal((128, 16), dtype=np.float32) * 0.1
    x = rng.standard_normal((32, 64), dtype=np.float32)
    kw1, kw2, kx = kn.tensor(w1), kn.tensor(w2), kn.tensor(x)
    cached = kn.value_and_grad(mlp_loss, argnums=(0, 1))
    rows = [("kiln, cached trace", timings(lambda: cached(kw1, kw2, kx), repeat, 2)),
            ("kiln, re-traced each call",
             timings(lambda: kn.value_and_grad(mlp_loss, argnums=(0, 1))(kw1, kw2, kx), max(5, repeat // 4), 1))]
    if torch is not None:
        tw1, tw2 = torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
        tx = torch.from_numpy(x)

        def step():
            loss = mlp_loss(tw1, tw2, tx)
            return torch.autograd.grad(loss, (tw1, tw2))
        rows.append(("torch eager autograd", timings(step, repeat, 2)))
        with _torch_threads(1):
            rows.append(("torch eager autograd, 1 thread", timings(step, repeat, 2)))
    return rows


def eager_erf(repeat: int) -> list[tuple]:
    x = np.random.default_rng(2).standard_normal(1 << 20).astype(np.float32) * 2
    reference = registry.get("erf").reference
    scalar = np.frompyfunc(math.erf, 1, 1)
    rows = [("kiln reference (vectorized)", timings(lambda: reference(x), repeat, 1)),
            ("np.frompyfunc(math.erf) (before)",
             timings(lambda: np.asarray(scalar(x.astype(np.float64)), np.float64).astype(np.float32),
                     max(3, repeat // 4), 1))]
    if torch is not None:
        tx = torch.from_numpy(x)
        rows.append(("torch.erf", timings(lambda: torch.erf(tx), repeat, 1)))
    return rows


_SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def batched_gemm(repeat: int, busy: bool) -> list[tuple]:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 32, 256), dtype=np.float32)
    b = rng.standard_normal((16, 256, 64), dtype=np.float32)
    f = kn.compile(lambda a, b: a @ b)
    f(a, b)
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN.format(s=120)]) if busy else None
    try:
        default = threads.blas_num_threads()

        def one_thread():
            with threads.blas_single_thread():
                np.matmul(a, b)
        rows = [(f"np.matmul, OpenBLAS default ({default} threads)", timings(lambda: np.matmul(a, b), repeat, 2)),
                ("np.matmul, one BLAS thread", timings(one_thread, repeat, 2)),
                ("kiln compiled", timings(lambda: f(a, b), repeat, 2))]
        if torch is not None:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            rows.append((f"torch.bmm ({torch.get_num_threads()} threads)", timings(lambda: torch.bmm(ta, tb), repeat, 2)))
            with _torch_threads(1):
                rows.append(("torch.bmm, 1 thread", timings(lambda: torch.bmm(ta, tb), repeat, 2)))
        return rows
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait(timeout=30)


def _table(title: str, rows: list[tuple], base: str | None, unit_div: int = 1) -> str:
    """Rows as a markdown table; with `base`, a ratio column against the fastest row whose
    name starts with `base` (torch at its default or at one thread, whichever won)."""
    peers = [med for name, (med, _) in rows if base and name.startswith(base)]
    best = min(peers) if peers else None
    lines = [f"**{title}**", "", "| | median (us) | min (us) |" + (f" median / best {base} |" if best else ""),
             "|---|---|---|" + ("---|" if best else "")]
    for name, (med, mn) in rows:
        line = f"| {name} | {_fmt(med / unit_div)} | {_fmt(mn / unit_div)} |"
        if best:
            line += f" {med / best:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


NOTES = """Reading the tables: torch at its default thread count spins against the machine's
other load (its bmm, autograd and erf rows), hence the one-thread rows; the ratio column
is against whichever torch row won. kiln's batched BLAS GEMM runs with one BLAS thread
(issue 22 item 1), so it does not move when a busy process takes a core. kiln's eager
per-op path on plain CPU tensors (kiln/frontend/eager_path.py) checks each op signature
once and replays the plan (kiln/ir/emitter.py), sets numpy's error state without
np.errstate and calls the ufunc directly: what is left per op is the numpy call (the
numpy row), the allocator's count of the result (a weakref, kn.memory), the Tensor
object and a few attribute checks; before issue 22 it was ~40 us an op."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeat = 21 if args.quick else 101
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), platform.processor())
    load = os.getloadavg()[0]
    sections = [
        _table("64-op eager chain of 32x32 float32 tensors (per op, rows measured round-robin)",
               eager_chain(3 * repeat), "torch", 64),
        _table("eager value_and_grad, MLP 32x64 -> 128 -> 16 (per call)", eager_grad(repeat), "torch"),
        _table("erf over 2^20 float32 (per call)", eager_erf(max(5, repeat // 10)), "torch"),
        _table("batched GEMM (16,32,256) x (16,256,64), idle", batched_gemm(repeat, False), "torch"),
        _table("batched GEMM, beside a process spinning on one core", batched_gemm(repeat, True), "torch"),
    ]
    text = (f"## Eager speed and threading (bench_eager.py, issue 22 items 1 and 5)\n\n"
            f"`.venv/bin/python benchmarks/bench_eager.py{' --quick' if args.quick else ''}` on {model}, "
            f"{datetime.date.today()}, {os.cpu_count()} CPUs, kn.get_num_threads() = {kn.get_num_threads()}, "
            f"load average {load:.1f} at the start (a shared, noisy machine: medians and minimums, "
            f"all rows from the same run).\n\n" + "\n\n".join(sections) + "\n\n" + NOTES)
    print(text)
    if args.out:
        write_section(args.out, "bench_eager", text)


if __name__ == "__main__":
    main()
