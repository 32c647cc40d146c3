"""Capture and replay on the CPU: per-call time of a replayed program against the same
compiled function called normally, numpy and jax.jit, measured side by side in one run.

    .venv/bin/python benchmarks/bench_capture.py [--quick] [--out benchmarks/results/cpu.md]

Workloads: the 4096-element `gelu(x*a+b)*sigmoid(x)` chain (a call's fixed cost
dominates: the issue's target is <= 10 us replayed) and the 20-step Newton `while_loop`
for sqrt over 2^20 float32 (target: replayed at least as fast as jax.jit). Every number
is a median of many calls after a warm-up; the minimum is shown beside it because this
machine is shared. Peers are measured when importable.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import chain_np  # noqa: E402
from report import timings, write_section  # noqa: E402

STEPS = 20


def per_call(fn, calls: int, repeat: int) -> tuple[float, float]:
    """(median, minimum) seconds per call over `repeat` batches of `calls` calls."""
    def batch():
        for _ in range(calls):
            fn()

    median, minimum = timings(batch, repeat, warmup=2)
    return median / calls, minimum / calls


def kiln_fns():
    import kiln as kn

    def chain(x, a, b):
        return kn.gelu(x * a + b) * kn.sigmoid(x)

    def newton(a):
        def body(i, y):
            return i + 1, 0.5 * (y + a / y)

        return kn.while_loop(lambda i, y: i < STEPS, body,
                             (kn.tensor(0, dtype=kn.int32), kn.ones_like(a)))[1]

    return kn, chain, newton


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", help="replace or append this benchmark's section in this file")
    args = parser.parse_args()
    kn, chain, newton = kiln_fns()
    repeat = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    x, a, b = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    big = rng.uniform(0.5, 100.0, 1 << 20).astype(np.float32)
    tx, ta, tb, tbig = (kn.tensor(v) for v in (x, a, b, big))

    compiled_chain, compiled_newton = kn.compile(chain), kn.compile(newton)
    t0 = time.perf_counter()
    captured_chain = kn.capture(chain, tx, ta, tb)
    captured_newton = kn.capture(newton, tbig)
    capture_s = time.perf_counter() - t0
    np.testing.assert_array_equal(captured_chain(tx, ta, tb).numpy(), compiled_chain(tx, ta, tb).numpy())
    np.testing.assert_array_equal(captured_newton(tbig).numpy(), compiled_newton(tbig).numpy())

    def np_chain():  # exact gelu through bench_cpu's vectorized erf, as the kiln chain
        return chain_np(x, a, b)

    def np_newton():
        y = np.ones_like(big)
        for _ in range(STEPS):
            y = 0.5 * (y + big / y)
        return y

    rows = {"chain": {}, "newton": {}}
    calls = 500 if args.quick else 2000
    rows["chain"]["kiln replayed"] = per_call(lambda: captured_chain(tx, ta, tb), calls, repeat)
    rows["chain"]["kiln compiled"] = per_call(lambda: compiled_chain(tx, ta, tb), calls, repeat)
    rows["chain"]["numpy"] = per_call(np_chain, calls // 4, repeat)
    rows["newton"]["kiln replayed"] = per_call(lambda: captured_newton(tbig), 3, repeat)
    rows["newton"]["kiln compiled"] = per_call(lambda: compiled_newton(tbig), 3, repeat)
    rows["newton"]["numpy"] = per_call(np_newton, 1, max(3, repeat // 3))
    try:
        import jax
        import jax.numpy as jnp

        @jax.jit
        def jchain(x, a, b):
            return jax.nn.gelu(x * a + b, approximate=False) * jax.nn.sigmoid(x)

        @jax.jit
        def jnewton(a):
            def body(state):
                i, y = state
                return i + 1, 0.5 * (y + a / y)

            return jax.lax.while_loop(lambda s: s[0] < STEPS, body, (0, jnp.ones_like(a)))[1]

        jx, ja, jb, jbig = (jnp.asarray(v) for v in (x, a, b, big))
        rows["chain"]["jax.jit"] = per_call(lambda: jchain(jx, ja, jb).block_until_ready(), calls, repeat)
        rows["newton"]["jax.jit"] = per_call(lambda: jnewton(jbig).block_until_ready(), 3, repeat)
        peers = f"jax {jax.__version__}"
    except ImportError:
        peers = "jax not installed"

    scale = {"chain": (1e6, "us"), "newton": (1e3, "ms")}
    lines = [
        "## Capture and replay (kn.capture)", "",
        f"- command: `.venv/bin/python benchmarks/bench_capture.py{' --quick' if args.quick else ''}`",
        f"- machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
        f"{_cpu_model()}",
        f"- date: {datetime.date.today()}; numpy {np.__version__}, {peers}",
        f"- capture of both programs (trace, compile, launch list): {capture_s:.2f} s",
        "- `chain`: gelu(x*a+b)*sigmoid(x) over 4096 float32 per call; `newton`: 20 Newton "
        "steps for sqrt over 2^20 float32 in a `while_loop` per call", "",
        "Per call, median (minimum); last columns: kiln compiled / kiln replayed, and the best "
        "peer / kiln replayed (higher is better for kiln).", "",
        "| workload | kiln replayed | kiln compiled | numpy | jax.jit | compiled / replayed | best peer / replayed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        factor, unit = scale[name]
        cell = lambda k: (f"{row[k][0] * factor:.2f} ({row[k][1] * factor:.2f}) {unit}"  # noqa: E731
                          if k in row else "—")
        replay = row["kiln replayed"][0]
        best = min(v[0] for k, v in row.items() if not k.startswith("kiln"))
        lines.append(f"| {name} | {cell('kiln replayed')} | {cell('kiln compiled')} | {cell('numpy')} | "
                     f"{cell('jax.jit')} | {row['kiln compiled'][0] / replay:.2f}x | {best / replay:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_section(args.out, "bench_capture", text)
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
