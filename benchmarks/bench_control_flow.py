"""Control flow and dynamic shapes on the CPU: kiln.compile against numpy, jax.jit
(`lax.while_loop` / `lax.switch`) and torch.compile, plus the per-call cost of shape
guards on a dynamic-shape function.

    .venv/bin/python benchmarks/bench_control_flow.py [--quick] [--out benchmarks/results/cpu.md]

Workloads: a 20-step Newton iteration for sqrt as a `while_loop` over 2^20 float32, and a
4-way `switch` over 2^20 float32 (the index cycles through every branch). Peers are
measured when importable. torch.compile runs in a child process with a time bound,
because Dynamo unrolls the Python loop and compiling the unrolled graph can take
minutes on a small machine (see /work/shared/design/NOTES.md); a peer that does not
finish in time is reported as such. Every number is a median after a warm-up. With
--out the section between its markers in that file is replaced (or appended), so the
other sections of the results file stay as they are.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import timings, write_section  # noqa: E402

N = 1 << 20
STEPS = 20


def inputs():
    rng = np.random.default_rng(0)
    return rng.uniform(0.5, 100.0, N).astype(np.float32), rng.standard_normal(N).astype(np.float32)


# -- the workloads, once per framework ---------------------------------------------------------


def kiln_workloads():
    import kiln as kn

    def newton(a):
        def body(i, y):
            return i + 1, 0.5 * (y + a / y)

        return kn.while_loop(lambda i, y: i < STEPS, body, (kn.tensor(0, dtype=kn.int32), kn.ones_like(a)))[1]

    def dispatch(i, x):
        return kn.switch(i, [lambda v: v * 2.0 + 1.0, lambda v: kn.exp(-v * v),
                             lambda v: kn.sqrt(kn.abs(v)), lambda v: kn.tanh(v) * 3.0], x)

    return kn.compile(newton), kn.compile(dispatch), lambda k: np.array(k, np.int32)


def numpy_workloads():
    def newton(a):
        y = np.ones_like(a)
        for _ in range(STEPS):
            y = 0.5 * (y + a / y)
        return y

    branches = [lambda v: v * 2.0 + 1.0, lambda v: np.exp(-v * v), lambda v: np.sqrt(np.abs(v)),
                lambda v: np.tanh(v) * 3.0]

    def dispatch(i, x):
        return branches[min(max(int(i), 0), 3)](x)

    return newton, dispatch, lambda k: k


def jax_workloads():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def newton(a):
        def body(state):
            i, y = state
            return i + 1, 0.5 * (y + a / y)

        return jax.lax.while_loop(lambda s: s[0] < STEPS, body, (0, jnp.ones_like(a)))[1]

    @jax.jit
    def dispatch(i, x):
        return jax.lax.switch(i, [lambda v: v * 2.0 + 1.0, lambda v: jnp.exp(-v * v),
                                  lambda v: jnp.sqrt(jnp.abs(v)), lambda v: jnp.tanh(v) * 3.0], x)

    def run(fn):
        return lambda *args: fn(*args).block_until_ready()

    return run(newton), run(dispatch), lambda k: jnp.int32(k)


def torch_workloads():
    import torch

    @torch.compile
    def newton(a):
        y = torch.ones_like(a)
        for _ in range(STEPS):
            y = 0.5 * (y + a / y)
        return y

    branches = [lambda v: v * 2.0 + 1.0, lambda v: torch.exp(-v * v),
                lambda v: torch.sqrt(torch.abs(v)), lambda v: torch.tanh(v) * 3.0]

    @torch.compile
    def dispatch(i: int, x):  # a Python index: Dynamo guards on it, one graph per branch
        return branches[min(max(i, 0), 3)](x)

    return newton, dispatch, lambda k: k


def measure(make, repeat: int, convert=np.asarray, only: str | None = None) -> dict:
    """Compile-and-first-call time and steady (median, minimum) of the workloads (or of
    `only`)."""
    a, x = inputs()
    a, x = convert(a), convert(x)
    start = time.perf_counter()
    newton, dispatch, index = make()
    result = {}
    if only in (None, "newton"):
        newton(a)
    if only in (None, "switch"):
        for k in range(4):
            dispatch(index(k), x)
    result["first"] = time.perf_counter() - start
    cycle = iter(range(10 ** 9))
    if only in (None, "newton"):
        result["newton"] = timings(lambda: newton(a), repeat)
    if only in (None, "switch"):
        result["switch"] = timings(lambda: dispatch(index(next(cycle) % 4), x), 4 * repeat)
    return result


def torch_in_child(repeat: int, limit: float) -> dict:
    """torch.compile measured in child processes (one per workload), each killed after
    `limit` seconds; a workload that does not finish is reported by a note."""
    result: dict = {"first": 0.0}
    for key in ("newton", "switch"):
        try:
            out = subprocess.run([sys.executable, __file__, "--torch-worker", key, "--repeat", str(repeat)],
                                 capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            result[key] = f"not compiled in {limit:.0f} s"
            continue
        if out.returncode != 0:
            result[key] = "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:60]
            continue
        median, minimum, first = (float(v) for v in out.stdout.split()[-3:])
        result[key] = (median, minimum)
        result["first"] += first
    return result


def guard_costs() -> dict:
    """Per-call time of a tiny compiled function with and without a dynamic dim, and the
    cost of the guard parts alone (cache key + shape-variable binding)."""
    import timeit

    import kiln as kn

    B = kn.ShapeVar("B", min=1, max=1 << 20)
    dynamic = kn.compile(lambda x, w: x * w + 1.0,
                         dynamic_shapes=[kn.TensorSpec([B, kn.STATIC]), None])
    static = kn.compile(lambda x, w: x * w + 1.0)
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    dynamic(x, w)
    static(x, w)
    (compiled,) = dynamic.compiled_graphs()

    def per_call(fn, number=20000):
        return min(timeit.repeat(fn, number=number, repeat=5)) / number

    sizes = [np.ones((n, 8), np.float32) for n in (1, 3, 17, 100)]
    varying = iter(range(10 ** 9))
    return {"dynamic": per_call(lambda: dynamic(x, w)), "static": per_call(lambda: static(x, w)),
            "varying": per_call(lambda: dynamic(sizes[next(varying) % 4], w)),
            "guard": per_call(lambda: dynamic._key((x, w), None)) + per_call(lambda: compiled.binder([x, w])),
            "compiles": dynamic.stats()["compiles"]}


# -- report ---------------------------------------------------------------------------------------


def render(rows: dict, guards: dict, args) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    peers = [p for p in ("numpy", "jax.jit", "torch.compile") if p in rows]

    def cell(result, key):
        value = result[key]
        return value if isinstance(value, str) else f"{value[0] * 1e3:.2f} ({value[1] * 1e3:.2f})"

    def ratio(key):
        times = [rows[p][key] for p in peers if not isinstance(rows[p][key], str)]
        if not times:
            return "-"
        kiln = rows["kiln"][key]
        return (f"{min(t[0] for t in times) / kiln[0]:.2f}x "
                f"({min(t[1] for t in times) / kiln[1]:.2f}x)")

    lines = ["## Control flow and dynamic shapes (bench_control_flow.py)", "",
             f"- command: `.venv/bin/python benchmarks/bench_control_flow.py{' --quick' if args.quick else ''}`",
             f"- machine: {os.cpu_count()} cores, {cpu}",
             f"- date: {datetime.date.today().isoformat()}; numpy {np.__version__}"
             + "".join(f", {m} {sys.modules[m].__version__}" for m in ("torch", "jax") if m in sys.modules),
             f"- workloads over 2^20 float32: `newton` = sqrt by {STEPS} Newton steps in a "
             "`while_loop` (numpy and torch run the Python loop); `switch` = a 4-way `switch` "
             "whose index cycles through the branches (numpy and torch dispatch in Python)",
             f"- load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: all rows "
             "from the same run)",
             "", "Medians (minimums) in milliseconds, lower is better; last column: best peer's "
             "time / kiln's, of the medians (of the minimums).",
             "", "| workload | kiln | " + " | ".join(peers) + " | best peer / kiln |",
             "|---" * (len(peers) + 3) + "|"]
    for key in ("newton", "switch"):
        lines.append(f"| {key} | {cell(rows['kiln'], key)} | "
                     + " | ".join(cell(rows[p], key) for p in peers) + f" | {ratio(key)} |")
    lines.append(f"| compile + first calls (s) | {rows['kiln']['first']:.2f} | "
                 + " | ".join(f"{rows[p]['first']:.2f}" for p in peers) + " | |")
    lines += ["", "Per-call cost of a compiled `x * w + 1` on a 4x8 input (microseconds):", "",
              "| static dims | dynamic dim B | dynamic, B changing every call | guards alone "
              "(cache key + bind B, check its range) | compiles |", "|---|---|---|---|---|",
              f"| {guards['static'] * 1e6:.1f} | {guards['dynamic'] * 1e6:.1f} | "
              f"{guards['varying'] * 1e6:.1f} | {guards['guard'] * 1e6:.2f} | {guards['compiles']} |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", help="replace or append this benchmark's section in this file")
    parser.add_argument("--torch-limit", type=float, default=90.0,
                        help="seconds torch.compile may take for one workload (a child process)")
    parser.add_argument("--torch-worker", choices=("newton", "switch"), help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=15, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker is not None:
        import torch

        r = measure(torch_workloads, args.repeat, torch.from_numpy, only=args.torch_worker)
        print(*r[args.torch_worker], r["first"])
        return 0
    repeat = 5 if args.quick else 15
    rows = {"kiln": measure(kiln_workloads, repeat), "numpy": measure(numpy_workloads, repeat)}
    try:
        rows["jax.jit"] = measure(jax_workloads, repeat)
    except ImportError:
        pass
    try:
        import torch  # noqa: F401  (only to know that it is there, and its version)

        rows["torch.compile"] = torch_in_child(repeat, args.torch_limit)
    except ImportError:
        pass
    section = render(rows, guard_costs(), args)
    print(section)
    if args.out:
        write_section(args.out, "bench_control_flow", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
