"""kn.fft as a real FFT: rfft and a complex fft over growing lengths (powers of two and
primes), kiln eager and kiln.compile against numpy.fft and torch.fft, in one run; and
the accuracy against numpy's float64 transform.

    .venv/bin/python benchmarks/bench_fft.py [--quick] [--out benchmarks/results/fft.md]

The transform is pocketfft (numpy.fft) computed in double precision and rounded once to
complex64 (kiln/ir/ops/fft.py); kiln.compile runs it as an extern step of the program.
The implementations of a row are timed in alternating rounds (the median of the rounds'
medians), so load drift on a shared machine hits them alike; ratios are from the same run.
The last column is the O(n^2) DFT-by-matmul kiln used before, timed where its two n x n
float32 matrices fit comfortably (n <= 4096): it grows as n^2 where the FFT grows as
n log n.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

import kiln as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, median_s, write_section  # noqa: E402


def _dft_matmul(x: np.ndarray, n: int) -> np.ndarray:
    """The previous implementation's arithmetic: rfft as two float32 matrix products."""
    k = n // 2 + 1
    angle = 2.0 * np.pi * np.outer(np.arange(n), np.arange(k)) / n
    cos, sin = np.cos(angle).astype(np.float32), (-np.sin(angle)).astype(np.float32)
    return x @ cos + 1j * (x @ sin)


def _rounds(fns: dict, repeat: int, rounds: int) -> dict:
    per = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(median_s(fn, repeat))
    return {name: float(np.median(v)) for name, v in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    lengths = [1024, 4093, 1 << 16] if args.quick else [1024, 4093, 4096, 65521, 1 << 16, 1 << 20]
    batch = 8
    rng = np.random.default_rng(0)
    rows, accuracy = [], []
    for n in lengths:
        x = rng.standard_normal((batch, n)).astype(np.float32)
        z = (x + 1j * rng.standard_normal((batch, n))).astype(np.complex64)
        kx, kz = kn.tensor(x), kn.tensor(z)
        rfft_c = kn.compile(lambda t: kn.fft.rfft(t))
        fft_c = kn.compile(lambda t: kn.fft.fft(t))
        rfft_c(x), fft_c(z)
        repeat = 3 if n >= 1 << 20 else 10
        fns = {"numpy rfft": lambda: np.fft.rfft(x), "kiln eager rfft": lambda: kn.fft.rfft(kx),
               "kiln compiled rfft": lambda: rfft_c(x),
               "numpy fft": lambda: np.fft.fft(z), "kiln eager fft": lambda: kn.fft.fft(kz),
               "kiln compiled fft": lambda: fft_c(z)}
        if torch is not None:
            tx, tz = torch.tensor(x), torch.tensor(z)
            fns["torch rfft"] = lambda: torch.fft.rfft(tx)
            fns["torch fft"] = lambda: torch.fft.fft(tz)
        if n <= 4096:
            fns["old DFT matmul rfft"] = lambda: _dft_matmul(x, n)
        t = _rounds(fns, repeat, 3)
        rows.append((n, t))
        want = np.fft.rfft(x.astype(np.float64))
        got = kn.fft.rfft(kx).numpy()
        err = float(np.abs(got - want).max() / np.abs(want).max())
        old = float(np.abs(_dft_matmul(x, n) - want).max() / np.abs(want).max()) if n <= 4096 else None
        accuracy.append((n, err, old))

    def ms(v):
        return f"{v * 1e3:.3f}"

    lines = [
        "## FFT (kn.fft: pocketfft extern) vs numpy.fft and torch.fft",
        "",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/bench_fft.py'] + (['--quick'] if args.quick else []))}`"
        f" on {cpu_model()}, {datetime.date.today().isoformat()}; batch {batch} rows of float32 "
        "(rfft) / complex64 (fft), torch with 1 thread; medians in ms, alternating rounds; "
        f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (compare "
        "within a row only).",
        "",
        "| n | numpy rfft | kiln eager rfft | kiln compiled rfft | torch rfft | kiln eager / numpy | "
        "old DFT matmul rfft | numpy fft | kiln eager fft | kiln compiled fft | torch fft |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, t in rows:
        lines.append(
            f"| {n} | {ms(t['numpy rfft'])} | {ms(t['kiln eager rfft'])} | {ms(t['kiln compiled rfft'])} | "
            f"{ms(t['torch rfft']) if 'torch rfft' in t else '-'} | "
            f"{t['kiln eager rfft'] / t['numpy rfft']:.2f}x | "
            f"{ms(t['old DFT matmul rfft']) if 'old DFT matmul rfft' in t else '-'} | "
            f"{ms(t['numpy fft'])} | {ms(t['kiln eager fft'])} | {ms(t['kiln compiled fft'])} | "
            f"{ms(t['torch fft']) if 'torch fft' in t else '-'} |")
    lines += ["", "Accuracy of rfft against numpy's float64 transform (max abs error / max abs value):", "",
              "| n | kiln (pocketfft, rounded to complex64) | old float32 DFT matmul |", "|---|---|---|"]
    for n, err, old in accuracy:
        lines.append(f"| {n} | {err:.1e} | {f'{old:.1e}' if old is not None else '-'} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_section(args.out, "bench_fft", text, title="# FFT benchmark results")


if __name__ == "__main__":
    main()
