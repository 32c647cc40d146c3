"""Eager per-op overhead of device placement and memory accounting (issue 13): a chain
of 64 eager ops on 32x32 float32 tensors, timed in this tree and in a baseline revision
(default: the commit before devices and caching allocators), alternating in one run;
also the per-call time of a small compiled function, whose buffers now come from the
CPU caching allocator.

    python benchmarks/bench_eager_devices.py                 # baseline dc449be^
    python benchmarks/bench_eager_devices.py --baseline REV --rounds 5

Each round runs one worker process per tree (PYTHONPATH points at the tree); a worker
reports the median time of the whole chain over 200 repetitions. The table gives the
median over rounds per op and the same-run ratio. Results: benchmarks/results/devices.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

_WORKER = r"""
import json, time
import numpy as np
import kiln as kn

x0 = kn.tensor(np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32))
w = kn.tensor(np.full((32, 32), 0.01, np.float32))

def chain():
    x = x0
    for _ in range(16):  # 4 ops per step: 64 eager ops
        x = x * 1.0001
        x = x + w
        x = x.tanh()
        x = x - 0.001
    return x

for _ in range(20):
    chain()
times = []
for _ in range(200):
    t = time.perf_counter()
    chain()
    times.append(time.perf_counter() - t)
times.sort()
f = kn.compile(lambda v: kn.gelu(v) * kn.sigmoid(v))
v = kn.randn(4096, seed=0)
for _ in range(50):
    f(v)
calls = []
for _ in range(2000):
    t = time.perf_counter()
    f(v)
    calls.append(time.perf_counter() - t)
calls.sort()
print(json.dumps({"chain_s": times[len(times) // 2], "call_s": calls[len(calls) // 2],
                  "chain_min": times[0], "call_min": calls[0]}))
"""


_SPLIT = _WORKER.split("for _ in range(20):")[0] + r"""
import kiln.frontend.dispatch as dispatch
charge = dispatch.charge
on, off = [], []
for _ in range(20):
    chain()
for _ in range(300):  # interleaved: the load of the machine hits both alike
    dispatch.charge = charge
    t = time.perf_counter(); chain(); on.append(time.perf_counter() - t)
    dispatch.charge = lambda array, device: None
    t = time.perf_counter(); chain(); off.append(time.perf_counter() - t)
dispatch.charge = charge
on.sort(); off.sort()
print(json.dumps({"on": on[len(on) // 2], "off": off[len(off) // 2], "on_min": on[0],
                  "off_min": off[0]}))
"""


def run_split(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "KILN_MEM_PUBLISH": "0"}
    out = subprocess.run([sys.executable, "-c", _SPLIT], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tree, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_worker(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "KILN_MEM_PUBLISH": "0"}
    out = subprocess.run([sys.executable, "-c", _WORKER], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tree, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="dc449be^")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "devices.md"))
    args = parser.parse_args()
    from report import write_section

    with tempfile.TemporaryDirectory(prefix="kiln-baseline-") as base:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", base,
                        args.baseline], check=True, timeout=120)
        try:
            before, after = [], []
            for _ in range(args.rounds):
                before.append(run_worker(base))
                after.append(run_worker(str(ROOT)))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", base],
                           check=False, timeout=120)
    split = run_split(str(ROOT))
    on, off = split["on"] / 64 * 1e6, split["off"] / 64 * 1e6
    mins = {k: min(r[k] for r in rows) for k, rows in
            (("chain_min", before), ("call_min", before))}
    mins_after = {k: min(r[k] for r in after) for k in ("chain_min", "call_min")}
    calls_b = [r["call_s"] for r in before]
    calls_a = [r["call_s"] for r in after]
    before = [r["chain_s"] for r in before]
    after = [r["chain_s"] for r in after]
    b, a = statistics.median(before) / 64 * 1e6, statistics.median(after) / 64 * 1e6
    ratios = [y / x for x, y in zip(before, after)]
    cb, ca = statistics.median(calls_b) * 1e6, statistics.median(calls_a) * 1e6
    call_ratio = statistics.median([y / x for x, y in zip(calls_b, calls_a)])
    section = f"""## Eager per-op overhead of devices and memory accounting

`python benchmarks/bench_eager_devices.py --baseline {args.baseline} --rounds {args.rounds}`
on {cpu_model()}, {datetime.date.today().isoformat()} (a shared, loaded 2-core machine).
A chain of 64 eager ops (mul, add, tanh, sub) on 32x32 float32; per round the median of
200 chains in each tree, one process each, alternating.

| tree | per op (median over rounds) |
|---|---|
| baseline `{args.baseline}` | {b:.2f} µs |
| this tree (device tag, K380 check, allocator charge per result) | {a:.2f} µs |
| same-round ratio this/baseline (median) | {statistics.median(ratios):.3f}x |

Least disturbed (minimum over every chain and call of every round): per op
{mins["chain_min"] / 64 * 1e6:.1f} µs baseline vs {mins_after["chain_min"] / 64 * 1e6:.1f} µs
this tree ({mins_after["chain_min"] / mins["chain_min"]:.3f}x); compiled call
{mins["call_min"] * 1e6:.1f} µs vs {mins_after["call_min"] * 1e6:.1f} µs
({mins_after["call_min"] / mins["call_min"]:.3f}x).

Rounds (chain µs, baseline / this): {", ".join(f"{x * 1e6:.0f}/{y * 1e6:.0f}" for x, y in zip(before, after))}

A compiled call (`kn.compile(lambda v: kn.gelu(v) * kn.sigmoid(v))` on 4096 float32,
median of 2000 calls; its output is now a block of the CPU caching allocator):
baseline {cb:.1f} µs, this tree {ca:.1f} µs, same-round ratio {call_ratio:.3f}x.

The allocator charge alone, in one process, chains interleaved 300 times with the charge
on and replaced by a no-op: medians {on:.2f} µs vs {off:.2f} µs per op, minima
{split["on_min"] / 64 * 1e6:.2f} µs vs {split["off_min"] / 64 * 1e6:.2f} µs, so
{split["on_min"] / 64 * 1e6 - split["off_min"] / 64 * 1e6:.2f} µs per op
({(split["on_min"] / split["off_min"] - 1) * 100:.1f}%) for counting each eager result when
the machine disturbs least. Medians on this shared machine swing by several times between
rounds; compare within a round, and trust the minima more.
"""
    write_section(args.out, "eager-devices", section, title="# Device runtime benchmark results")
    print(section)


if __name__ == "__main__":
    main()
