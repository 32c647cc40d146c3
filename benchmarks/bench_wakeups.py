"""What a training step pays after an idle pause, and how much of it is waking threads.

    .venv/bin/python benchmarks/bench_wakeups.py [--rounds 20] [--processes 3]
        [--variants team,team-awake,one-thread,libgomp] [--baseline /tmp/before]

bench_train.py times each implementation in a persistent process, a few steps after a
0.2 s pause. The first step after the pause is slower for every implementation; kiln's
spread from it was the larger, and the suspicion was its team's sleeping workers (a
futex wake-up costs 0.1-2.5 ms on these VMs). This script runs the small-GPT step of
bench_train (examples/nanogpt) in that pattern -- rounds of `time.sleep(pause)` then 3
steps -- in fresh processes, variants round-robin, and reports per position in the round
the step's median (minimum) and, from kiln's team timeline (native_team.start_trace),
where the time goes:

- `regions`: split regions per step, the time inside them, the caller's wait at their
  joins, and regions no worker took part in ("lonely": the worker still asleep);
- `wake -> claim`: from the prepared call's wake of sleeping workers to a worker's first
  claimed unit (the wake-up latency the step sees);
- `native`, `extern`, `python`: the step's native runs, its externs (ops run by numpy
  references between runs), and the Python around them (kiln/runtime/fast_call.py).

Variants: `team` (the default), `team-awake` (workers spin through the pause,
KILN_TEAM_SPIN_US=1 s: the most any wake-up scheme could gain), `team-short` (workers
spin 0.2 ms after a region instead of 5), `one-thread`
(kn.set_num_threads(1): no split region at all), `libgomp` (KILN_NATIVE_TEAM=0), and
`baseline` (the default on another tree, --baseline, which needs no timeline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"team": {}, "team-awake": {"KILN_TEAM_SPIN_US": "1000000"}, "team-short": {"KILN_TEAM_SPIN_US": "200"},
            "one-thread": {},
            "libgomp": {"KILN_NATIVE_TEAM": "0"}, "baseline": {}}


def worker(variant: str, rounds: int, pause: float) -> dict:
    """One process: the GPT step warmed up, then `rounds` rounds of pause + 3 steps."""
    sys.path.insert(0, HERE)
    import bench_train

    import kiln as kn
    from kiln.runtime import fast_call

    if variant == "one-thread":
        kn.set_num_threads(1)
    try:
        from kiln.codegen.cpu import native_team
        tracing = hasattr(native_team, "start_trace")
    except ImportError:
        tracing = False
    parts: list = []  # (kind, ns) of the current step, from FastPlan's parts
    plain_call, plain_extern = fast_call.FastPlan._call, fast_call.FastPlan._run_extern

    def timed_extern(part, objects):
        t0 = time.perf_counter_ns()
        try:
            return plain_extern(part, objects)
        finally:
            parts.append(("extern", time.perf_counter_ns() - t0))

    def timed_call(self, objects, threads, loose):
        t0 = time.perf_counter_ns()
        try:
            return plain_call(self, objects, threads, loose)
        finally:
            parts.append(("call", time.perf_counter_ns() - t0))

    fast_call.FastPlan._call = timed_call
    fast_call.FastPlan._run_extern = staticmethod(timed_extern)
    step, params, state, x, y, key = bench_train.kiln_gpt_step()
    carry = [params, state]

    def one():
        carry[0], carry[1], _ = step(carry[0], carry[1], x, y, key)

    for _ in range(40):  # compiled, split verdicts in
        one()
    rows: list = [[] for _ in range(3)]
    for _ in range(rounds):
        time.sleep(pause)
        traced = tracing and native_team.start_trace()  # False without kiln's team
        marks = []
        for k in range(3):
            parts.clear()
            t0 = time.monotonic_ns()
            one()
            t1 = time.monotonic_ns()
            call = sum(ns for kind, ns in parts if kind == "call")
            extern = sum(ns for kind, ns in parts if kind == "extern")
            marks.append((t0, t1))
            rows[k].append({"ms": (t1 - t0) / 1e6, "native": (call - extern) / 1e6,
                            "extern": extern / 1e6, "python": (t1 - t0 - call) / 1e6})
        if traced:
            records = native_team.stop_trace()
            wakes = [r["start"] for r in records if r["kind"] == "wake"]
            for k, (t0, t1) in enumerate(marks):
                mine = [r for r in records if t0 <= r["start"] <= t1 and r["kind"] != "wake"]
                claims = [r["first_claim"] for r in mine if r["first_claim"]]
                woke = [w for w in wakes if t0 <= w <= t1]
                rows[k][-1].update(
                    regions=len(mine), in_regions=sum(r["end"] - r["start"] for r in mine) / 1e6,
                    join_wait=sum(r["end"] - r["own_done"] for r in mine) / 1e6,
                    lonely=sum(1 for r in mine if r["by_caller"] == r["units"]),
                    wake_claim=((min(claims) - woke[0]) / 1e6) if woke and claims else None)
    return {"variant": variant, "rows": rows}


def summarize(results: list[dict]) -> dict:
    """variant -> per position: median (min) of the step, medians of the parts."""
    out: dict = {}
    for res in results:
        for k, rows in enumerate(res["rows"]):
            out.setdefault(res["variant"], [[] for _ in range(3)])[k].extend(rows)
    table = {}
    for variant, positions in out.items():
        table[variant] = []
        for rows in positions:
            cell = {"median": float(np.median([r["ms"] for r in rows])), "min": float(np.min([r["ms"] for r in rows]))}
            for key in ("native", "extern", "python", "regions", "in_regions", "join_wait", "lonely"):
                values = [r[key] for r in rows if r.get(key) is not None]
                cell[key] = float(np.median(values)) if values else None
            lat = [r["wake_claim"] for r in rows if r.get("wake_claim") is not None]
            cell["wake_claim"] = float(np.median(lat)) if lat else None
            cell["woke"] = f"{len(lat)}/{len(rows)}"
            table[variant].append(cell)
    return table


def render(table: dict, args) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    lines = [f"`{' '.join(sys.argv)}`, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
             "", "| variant | step after pause | ms, median (min) | native | extern | python | regions | "
             "in regions | join waits | lonely | wake -> claim ms (rounds) |", "|---" * 11 + "|"]
    for variant, cells in table.items():
        for k, c in enumerate(cells):
            lines.append(f"| {variant if k == 0 else ''} | {k + 1} | {c['median']:.2f} ({c['min']:.2f}) | "
                         f"{f(c['native'])} | {f(c['extern'])} | {f(c['python'])} | {f(c['regions'], '{:.0f}')} | "
                         f"{f(c['in_regions'])} | {f(c['join_wait'], '{:.3f}')} | {f(c['lonely'], '{:.0f}')} | "
                         f"{f(c['wake_claim'])} ({c['woke']}) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of pause + 3 steps per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per variant, round-robin")
    parser.add_argument("--pause", type=float, default=0.2, help="seconds before each round (bench_train's)")
    parser.add_argument("--variants", default="team,team-awake,one-thread")
    parser.add_argument("--baseline", help="another tree's root, for the `baseline` variant")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rounds, args.pause)))
        return 0
    variants = args.variants.split(",")
    if "baseline" in variants and not args.baseline:
        parser.error("the baseline variant needs --baseline TREE")
    results = []
    for _ in range(args.processes):
        for v in variants:
            env = dict(os.environ, **VARIANTS[v])
            if v == "baseline":  # the script's directory stays first: put the tree before it
                env["PYTHONPATH"] = os.path.abspath(args.baseline)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", v,
                                  "--rounds", str(args.rounds), "--pause", str(args.pause)],
                                 env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"{v}: {out.stderr.strip().splitlines()[-1:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(render(summarize(results), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
