"""Issue 22 item 4's rows measured round-robin: each repetition runs kiln and every peer
once, one after the other, so a shared machine's load falls on all of them alike.

Rows: sum of squares over 2^25 float32 (memory bandwidth), 20 Newton steps for sqrt over
2^20 float32 written as a Python loop (every framework traces it into one graph) and
as a `while_loop` (jax.lax.while_loop; numpy runs the loop), Newton to a tolerance over 256
float32 (a data-dependent trip count: kiln's loop runs as a native launch list), and a
4-way switch over
2^20 float32 whose index cycles through the branches (jax.lax.switch; numpy dispatches
in Python). torch.compile is left out: the workloads of bench_cpu.py and
bench_control_flow.py show its compile times here (minutes for the Newton loop).

    .venv/bin/python benchmarks/bench_interleaved.py [--repeat 40] [--out benchmarks/results/cpu.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, write_section  # noqa: E402
from bench_control_flow import inputs, jax_workloads, kiln_workloads, numpy_workloads  # noqa: E402

STEPS = 20


def newton_unrolled(x):
    y = x
    for _ in range(STEPS):
        y = 0.5 * (y + x / y)
    return y


def workloads():
    """name -> (inputs, {framework: fn})."""
    import jax
    import jax.numpy as jnp

    import kiln as kn

    rng = np.random.default_rng(0)
    big = rng.standard_normal(1 << 25).astype(np.float32)
    a, x = inputs()  # bench_control_flow's while_loop Newton and 4-way switch, its inputs
    loop_k, kn_switch, _ = kiln_workloads()
    loop_j, jax_switch, _ = jax_workloads()
    np_loop, np_switch, _ = numpy_workloads()
    cycle = iter(range(10 ** 9))
    index = [np.array(k, np.int32) for k in range(4)]
    jindex = [jnp.int32(k) for k in range(4)]
    ja, jx, jbig = jnp.asarray(a), jnp.asarray(x), jnp.asarray(big)

    def ready(fn):
        return lambda *args: fn(*args).block_until_ready()

    small = rng.uniform(0.5, 100.0, 256).astype(np.float32)
    tol = np.array(1e-3, np.float32)

    def kn_tol(a, tol):  # a data-dependent trip count: stays a loop (7 trips here)
        body = lambda i, y: (i + 1, 0.5 * (y + a / y))  # noqa: E731
        cond = lambda i, y: (kn.max(kn.abs(y * y - a)) > tol) & (i < 100)  # noqa: E731
        return kn.while_loop(cond, body, (kn.tensor(0, dtype=kn.int32), kn.ones_like(a)))[1]

    def jax_tol(a, tol):
        body = lambda s: (s[0] + 1, 0.5 * (s[1] + a / s[1]))  # noqa: E731
        cond = lambda s: (jnp.max(jnp.abs(s[1] * s[1] - a)) > tol) & (s[0] < 100)  # noqa: E731
        return jax.lax.while_loop(cond, body, (0, jnp.ones_like(a)))[1]

    def np_tol(a, tol):
        y, i = np.ones_like(a), 0
        while np.max(np.abs(y * y - a)) > tol and i < 100:
            y, i = 0.5 * (y + a / y), i + 1
        return y

    tol_k, tol_j = kn.compile(kn_tol), jax.jit(jax_tol)
    jsmall, jtol = jnp.asarray(small), jnp.asarray(tol)
    ssq_k, ssq_j = kn.compile(lambda v: (v * v).sum()), jax.jit(lambda v: (v * v).sum())
    unrolled_k, unrolled_j = kn.compile(newton_unrolled), jax.jit(newton_unrolled)
    return {
        "sum of squares 2^25": {"kiln": lambda: ssq_k(big), "jax.jit": lambda: ready(ssq_j)(jbig),
                                "numpy": lambda: np.dot(big, big)},
        "20-step Newton, Python loop (traced)": {
            "kiln": lambda: unrolled_k(a), "jax.jit": lambda: ready(unrolled_j)(ja),
            "numpy": lambda: newton_unrolled(a)},
        "20-step Newton, while_loop": {"kiln": lambda: loop_k(a), "jax.jit": lambda: loop_j(ja),
                                       "numpy": lambda: np_loop(a)},
        "Newton to a tolerance, 256 floats (while_loop, 7 trips)": {
            "kiln": lambda: tol_k(small, tol), "jax.jit": lambda: ready(tol_j)(jsmall, jtol),
            "numpy": lambda: np_tol(small, tol)},
        "4-way switch, index cycling": {
            "kiln": lambda: kn_switch(index[next(cycle) % 4], x),
            "jax.jit": lambda: jax_switch(jindex[next(cycle) % 4], jx),
            "numpy": lambda: np_switch(next(cycle) % 4, x)},
    }


def measure(repeat: int) -> dict:
    rows = {}
    for name, fns in workloads().items():
        for fn in fns.values():  # compile and warm up
            for _ in range(4):
                fn()
        times = {k: [] for k in fns}
        for _ in range(repeat):
            for k, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - start)
        rows[name] = {k: (float(np.median(v)), float(np.min(v))) for k, v in times.items()}
    return rows


def render(rows: dict, repeat: int, load: tuple, command: str) -> str:
    peers = ["jax.jit", "numpy"]
    lines = ["## Reductions and control flow, interleaved (bench_interleaved.py, issue 22 item 4)", "",
             f"- command: `{command}`",
             f"- machine: {os.cpu_count()} CPUs, {cpu_model()}; date {datetime.date.today().isoformat()}",
             f"- load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (a machine shared "
             "by several agents: every repetition runs all frameworks back to back, {repeat} "
             "repetitions)".replace("{repeat}", str(repeat)),
             "", "Medians (minimums) in milliseconds; ratio = best peer / kiln, of the medians "
             "(of the minimums), same run.", "",
             "| workload | kiln | " + " | ".join(peers) + " | best peer / kiln |",
             "|---" * (len(peers) + 3) + "|"]
    for name, row in rows.items():
        k = row["kiln"]
        best_med = min(row[p][0] for p in peers)
        best_min = min(row[p][1] for p in peers)
        digits = 2 if k[1] >= 1e-3 else 4  # sub-millisecond rows: microsecond resolution
        lines.append(f"| {name} | " + " | ".join(f"{row[f][0] * 1e3:.{digits}f} ({row[f][1] * 1e3:.{digits}f})"
                                                 for f in ["kiln"] + peers)
                     + f" | {best_med / k[0]:.2f}x ({best_min / k[1]:.2f}x) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--out", help="replace or append this benchmark's section in this file")
    args = parser.parse_args()
    start = os.getloadavg()[0]
    rows = measure(args.repeat)
    command = "python benchmarks/bench_interleaved.py" + (f" --repeat {args.repeat}" if args.repeat != 40 else "")
    section = render(rows, args.repeat, (start, os.getloadavg()[0]), ".venv/bin/" + command)
    print(section)
    if args.out:
        write_section(args.out, "bench_interleaved", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
