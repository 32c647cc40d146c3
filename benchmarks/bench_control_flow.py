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
from bench_cpu import TURN_WARM_S, settle, turns  # noqa: E402
from report import write_section  # noqa: E402

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


# every implementation is warmed up alike (kiln's split measurement, Inductor's and XLA's
# first runs), then all are timed round-robin in the same minute: each turn runs its
# implementation untimed for bench_cpu.TURN_WARM_S (the previous one's threads spin on a
# while after its calls), then times each call of a ~20 ms block one by one (bench_cpu.py's
# method: its `turns`)
BLOCK_S = 0.02


def prepare(make, convert=np.asarray, only: str | None = None) -> dict:
    """{"first": compile + first calls (s), workload: a zero-argument call returning the
    switch's branch index (or 0)}, each warmed up (at least 5 calls and 0.25 s)."""
    a, x = inputs()
    a, x = convert(a), convert(x)
    start = time.perf_counter()
    newton, dispatch, index = make()
    calls = {}
    if only in (None, "newton"):
        newton(a)
        calls["newton"] = lambda: (newton(a), 0)[1]
    if only in (None, "switch"):
        indexes = [index(k) for k in range(4)]
        for i in indexes:
            dispatch(i, x)
        cycle = iter(range(10 ** 12))

        def switch():
            k = next(cycle) % 4
            dispatch(indexes[k], x)
            return k

        calls["switch"] = switch
    result = {"first": time.perf_counter() - start}
    for key, fn in calls.items():
        settle(fn, 5, 0.25, max_calls=400)
        result[key] = fn
    return result


def interleaved(fns: dict, rounds: int, seed: int = 0) -> dict:
    """{name: [(branch, seconds), ...]}: every call timed, `rounds` rounds, each
    implementation once per round in a shuffled order, a turn TURN_WARM_S untimed and then
    a block of calls lasting about BLOCK_S (at least 4, a multiple of 4: every branch of
    the switch alike)."""
    times: dict = {name: [] for name in fns}

    def block(name, fn):
        start, n = time.perf_counter(), 0
        while n < 4 or n % 4 or time.perf_counter() - start < BLOCK_S:
            c0 = time.perf_counter()
            branch = fn()
            times[name].append((branch, time.perf_counter() - c0))
            n += 1

    turns(fns, rounds, block, seed)
    return times


def stats(calls: list) -> tuple[float, float]:
    t = [dt for _, dt in calls]
    return float(np.median(t)), float(np.min(t))


def branch_stats(calls: list) -> list[tuple[float, float]]:
    """(median, minimum) seconds per branch of the switch."""
    return [stats([c for c in calls if c[0] == k]) for k in range(4)]


def torch_in_child(repeat: int, limit: float) -> dict:
    """torch.compile's Newton loop measured in a child process killed after `limit`
    seconds (Dynamo unrolls the Python loop: its compile may take minutes); a workload that
    does not finish is reported by a note. Timed alone, not in the rounds (a note says so)."""
    result: dict = {"first": 0.0}
    key = "newton"
    try:
        out = subprocess.run([sys.executable, __file__, "--torch-worker", key, "--repeat", str(repeat)],
                             capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        result[key] = f"not compiled in {limit:.0f} s"
        return result
    if out.returncode != 0:
        result[key] = "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:60]
        return result
    median, minimum, first = (float(v) for v in out.stdout.split()[-3:])
    result[key] = (median, minimum)
    result["first"] += first
    return result


def torch_alone(key: str, repeat: int) -> tuple[float, float, float]:
    """(median, minimum, compile + first call) of torch.compile's `key` in this process."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    prepared = prepare(torch_workloads, torch.from_numpy, only=key)
    fn = prepared[key]
    times = [dt for _, dt in interleaved({key: fn}, max(3, repeat // 5))[key]]
    return float(np.median(times)), float(np.min(times)), prepared["first"]


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


def render(rows: dict, branches: dict, guards: dict, args) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    peers = [p for p in ("numpy", "jax.jit", "torch.compile") if p in rows]

    def cell(result, key):
        value = result[key]
        return value if isinstance(value, str) else f"{value[0] * 1e3:.2f} ({value[1] * 1e3:.2f})"

    def ratio(times, kiln):
        times = [t for t in times if not isinstance(t, str)]
        if not times:
            return "-"
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
             f"- method: every implementation warmed up alike (5 calls and 0.25 s), then timed "
             f"round-robin in one process, {args.rounds} rounds, each turn {TURN_WARM_S} s untimed, "
             f"then every call of a ~{BLOCK_S * 1e3:.0f} ms block timed (torch.compile's Newton "
             "loop, when it compiles at all, in a child process, alone)",
             f"- load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: all rows "
             "from the same run)",
             "", "Medians (minimums) in milliseconds, lower is better; last column: best peer's "
             "time / kiln's, of the medians (of the minimums).",
             "", "| workload | kiln | " + " | ".join(peers) + " | best peer / kiln |",
             "|---" * (len(peers) + 3) + "|"]
    for key in ("newton", "switch"):
        lines.append(f"| {key} | {cell(rows['kiln'], key)} | "
                     + " | ".join(cell(rows[p], key) for p in peers)
                     + f" | {ratio([rows[p][key] for p in peers], rows['kiln'][key])} |")
    lines.append(f"| compile + first calls (s) | {rows['kiln']['first']:.2f} | "
                 + " | ".join(f"{rows[p]['first']:.2f}" for p in peers) + " | |")
    names = ["v * 2 + 1", "exp(-v * v)", "sqrt(abs(v))", "tanh(v) * 3"]
    lines += ["", "The switch per branch (the row above is the median of all four alike: the "
              "middle of the mix), medians (minimums) in milliseconds:", "",
              "| branch | " + " | ".join(["kiln", *[p for p in peers if p in branches]])
              + " | best peer / kiln |", "|---" * (len([p for p in peers if p in branches]) + 3) + "|"]
    for k, name in enumerate(names):
        kiln = branches["kiln"][k]
        others = [branches[p][k] for p in peers if p in branches]
        lines.append(f"| {k}: {name} | " + " | ".join(f"{t[0] * 1e3:.3f} ({t[1] * 1e3:.3f})"
                                                    for t in [kiln, *others])
                     + f" | {ratio(others, kiln)} |")
    lines += ["", "Per-call cost of a compiled `x * w + 1` on a 4x8 input (microseconds):", "",
              "| static dims | dynamic dim B | dynamic, B changing every call | guards alone "
              "(cache key + bind B, check its range) | compiles |", "|---|---|---|---|---|",
              f"| {guards['static'] * 1e6:.1f} | {guards['dynamic'] * 1e6:.1f} | "
              f"{guards['varying'] * 1e6:.1f} | {guards['guard'] * 1e6:.2f} | {guards['compiles']} |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--out", help="replace or append this benchmark's section in this file")
    parser.add_argument("--rounds", type=int, help="round-robin rounds (default 7, --quick 3)")
    parser.add_argument("--torch-limit", type=float, default=90.0,
                        help="seconds torch.compile may take for the Newton loop (a child process)")
    parser.add_argument("--torch-worker", choices=("newton", "switch"), help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=15, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker is not None:
        print(*torch_alone(args.torch_worker, args.repeat))
        return 0
    args.rounds = args.rounds or (3 if args.quick else 7)
    prepared = {"kiln": prepare(kiln_workloads), "numpy": prepare(numpy_workloads)}
    try:
        prepared["jax.jit"] = prepare(jax_workloads)
    except ImportError:
        pass
    torch_newton = None
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        # the switch compiles in seconds: in the rounds with the others; the Newton loop
        # (Dynamo unrolls it, minutes) in a child process with a time limit
        prepared["torch.compile"] = prepare(torch_workloads, torch.from_numpy, only="switch")
        torch_newton = torch_in_child(15, args.torch_limit)
    except ImportError:
        pass
    rows, branches = {}, {}
    for name, p in prepared.items():
        rows[name] = {"first": p["first"]}
    for key in ("newton", "switch"):
        fns = {name: p[key] for name, p in prepared.items() if key in p}
        times = interleaved(fns, args.rounds)
        for name, calls in times.items():
            rows[name][key] = stats(calls)
            if key == "switch":
                branches[name] = branch_stats(calls)
    if torch_newton is not None:
        rows["torch.compile"]["newton"] = torch_newton["newton"]
        rows["torch.compile"]["first"] += torch_newton["first"]
    section = render(rows, branches, guard_costs(), args)
    print(section)
    if args.out:
        write_section(args.out, "bench_control_flow", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
