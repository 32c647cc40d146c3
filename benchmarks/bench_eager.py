"""Eager speed and threading (issue 22 items 1 and 5), all rows from one run:

- per-op eager overhead, kiln eager vs torch eager (and numpy, the floor kiln's eager mode
  builds on), round-robin in one process, one thread each: a 64-op chain of 32x32 float32
  tensors, `a + b` on 1 and 1024 elements, and single ops of each kind the lean eager path
  serves (elementwise, relu, matmul, a reduction, broadcasting, promotion, a 0-d operand);
- eager `kn.value_and_grad` of a small MLP loss: the cached traced program vs re-tracing
  on every call (a fresh wrapper each call, as before issue 22), beside torch autograd;
- eager erf over 2^20 float32: the vectorized reference vs `np.frompyfunc(math.erf)`
  (what it replaced), beside torch.erf;
- a batched small GEMM (16,32,256)x(16,256,64): np.matmul with OpenBLAS's own threads
  vs one BLAS thread, and kiln compiled, each idle and beside a busy process spinning on
  one core.

    .venv/bin/python benchmarks/bench_eager.py [--out benchmarks/results/cpu.md] [--quick]
        [--repeat N] [--baseline DIR]   # DIR: an older kiln, `git archive REV kiln | tar -x -C DIR`
"""

from __future__ import annotations

import argparse
import datetime
import json
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


def _per_op_workloads():
    """(name, ops per call, kiln fn, torch fn or None, numpy fn or None) of the per-op rows:
    the 64-op chain, `a + b` at 1 and 1024 elements, and the cases of issue 22 item 5."""
    rng = np.random.default_rng(0)

    def arr(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    a, b, v, d = arr(32, 32), arr(32, 32), arr(32), arr(32, 32, dtype=np.float64)
    one, big = arr(1), arr(1024)
    k = {name: kn.tensor(x) for name, x in
         (("a", a), ("b", b), ("v", v), ("d", d), ("one", one), ("big", big), ("s", np.float32(2.0)))}
    t = {name: torch.from_numpy(np.array(x)) for name, x in
         (("a", a), ("b", b), ("v", v), ("d", d), ("one", one), ("big", big), ("s", np.float32(2.0)))} \
        if torch is not None else None

    def both(fn):
        return (lambda: fn(k, kn)), (None if t is None else lambda: fn(t, torch))
    rows = [("64-op chain of 32x32 (per op)", 64,
             *both(lambda x, m: chain(x["a"], x["b"], m.tanh)), lambda: chain(a, b, np.tanh)),
            ("a + b, 1 element", 1, *both(lambda x, m: x["one"] + x["one"]), lambda: one + one),
            ("a + b, 1024 elements", 1, *both(lambda x, m: x["big"] + x["big"]), lambda: big + big)]
    for name, fn in (("a + b, 32x32", lambda x, m: x["a"] + x["b"]),
                     ("a * b, 32x32", lambda x, m: x["a"] * x["b"]),
                     ("relu(a)", lambda x, m: m.relu(x["a"])),
                     ("a @ b", lambda x, m: x["a"] @ x["b"]),
                     ("a.sum(-1)", lambda x, m: x["a"].sum(-1)),
                     ("a + row (broadcast)", lambda x, m: x["a"] + x["v"]),
                     ("float32 + float64", lambda x, m: x["a"] + x["d"]),
                     ("a * 0-d tensor", lambda x, m: x["a"] * x["s"])):
        rows.append((name, 1, *both(fn), None))
    return rows


def eager_round_robin(repeat: int) -> list[tuple]:
    """kiln eager, torch eager and numpy measured round-robin: every repetition runs each
    workload in each framework back to back (the order alternating), one thread each, so
    the shared machine's load falls on them alike. Rows: (name, kiln, torch, numpy), each
    (median, minimum) seconds per op, of wall time and of the thread's CPU time."""
    saved = kn.get_num_threads(), (torch.get_num_threads() if torch is not None else None)
    kn.set_num_threads(1)
    if torch is not None:
        torch.set_num_threads(1)
    try:
        out = []
        with (torch.no_grad() if torch is not None else _nothing()):
            for name, ops, fk, ft, fnp in _per_op_workloads():
                fns = [f for f in (fk, ft, fnp) if f is not None]
                inner = max(1, 2000 // (ops * 40))  # a sample of ~100 us at least
                for f in fns:  # warm: the first calls plan
                    for _ in range(3):
                        f()
                wall = [[] for _ in fns]
                cpu = [[] for _ in fns]
                for r in range(repeat):
                    order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
                    for i in order:
                        f = fns[i]
                        w0, c0 = time.perf_counter(), time.thread_time()
                        for _ in range(inner):
                            f()
                        wall[i].append((time.perf_counter() - w0) / inner / ops)
                        cpu[i].append((time.thread_time() - c0) / inner / ops)
                stats = [(float(np.median(w)), float(np.min(w)), float(np.median(c)))
                         for w, c in zip(wall, cpu)]
                it = iter(stats)
                out.append((name, next(it), next(it) if ft is not None else None,
                            next(it) if fnp is not None else None))
        return out
    finally:
        kn.set_num_threads(saved[0])
        if torch is not None:
            torch.set_num_threads(saved[1])


def _round_robin_table(rows: list[tuple]) -> str:
    lines = ["**Eager per-op time, round-robin, one thread each (us per op)**", "",
             "| workload | kiln median (min) | torch median (min) | numpy median | "
             "kiln / torch, median (min) | kiln / torch, CPU time median |",
             "|---|---|---|---|---|---|"]
    for name, k, t, n in rows:
        ratio = f"{k[0] / t[0]:.2f}x ({k[1] / t[1]:.2f}x)" if t else "-"
        cpu = f"{k[2] / t[2]:.2f}x" if t else "-"
        lines.append(f"| {name} | {_fmt(k[0])} ({_fmt(k[1])}) | "
                     f"{f'{_fmt(t[0])} ({_fmt(t[1])})' if t else '-'} | "
                     f"{_fmt(n[0]) if n else '-'} | {ratio} | {cpu} |")
    return "\n".join(lines)


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


NOTES = """Reading the tables: the per-op rows ran round-robin with kiln, torch and numpy at one
thread each; "CPU time" is the thread's own (time.thread_time), which a descheduled
thread does not accumulate, so it is the steadier ratio on a loaded machine. In the
other tables torch at its default thread count spins against the machine's other load
(its bmm, autograd and erf rows), hence the one-thread rows; their ratio column is
against whichever torch row won. kiln's batched BLAS GEMM runs with one BLAS thread
(issue 22 item 1), so it does not move when a busy process takes a core. A `--baseline`
directory holds an older kiln unpacked with `git archive REV kiln`, named for its REV.

kiln's eager per-op path on plain CPU tensors (kiln/frontend/eager_path.py) checks each
op signature once and replays its plan (kiln/ir/emitter.py); binary ops with broadcasting,
promotion, a 0-d tensor or a Python scalar replay the general path's decisions with
numpy broadcasting the operands. Per op on a trusted plan what is left is the numpy call
(the numpy column), numpy's error state set quiet through its context variable (~0.25
us), the CPU allocator's count of the result (a weakref with a callback, ~0.6 us:
kiln/runtime/caching_allocator.py, kn.memory's figures), the Tensor object (~0.15 us)
and a dozen attribute checks; before issue 22 it was ~40 us an op."""


def baseline_rows(path: str, repeat: int) -> list:
    """The per-op rows of another kiln (the `kiln` package under `path`, e.g. an older
    commit unpacked with `git archive REV kiln | tar -x -C DIR`), measured by this script
    in a child process right before this one's."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--per-op-json",
                           "--repeat", str(repeat)], env=env, capture_output=True, text=True,
                          timeout=1800, cwd=os.path.dirname(os.path.abspath(path)) or None)
    if done.returncode:
        raise RuntimeError(f"the baseline run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _baseline_table(before: list, after: list, path: str) -> str:
    lines = [f"**Before and after: the same per-op rows with the kiln under `{path}`, run just "
             "before (same-run ratios of each run)**", "",
             "| workload | before: kiln (us) | before: kiln / torch | after: kiln (us) | after: kiln / torch |",
             "|---|---|---|---|---|"]
    for (name, k0, t0, _), (_, k1, t1, _) in zip(before, after):
        lines.append(f"| {name} | {_fmt(k0[0])} ({_fmt(k0[1])}) | {k0[0] / t0[0]:.2f}x | "
                     f"{_fmt(k1[0])} ({_fmt(k1[1])}) | {k1[0] / t1[0]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 101)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also measure the per-op rows of the kiln package under DIR")
    parser.add_argument("--per-op-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeat = args.repeat or (21 if args.quick else 101)
    if args.per_op_json:  # the child of --baseline
        print(json.dumps(eager_round_robin(repeat)))
        return
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), platform.processor())
    load = os.getloadavg()[0]
    before = baseline_rows(args.baseline, repeat) if args.baseline and torch is not None else None
    per_op = eager_round_robin(repeat)
    sections = [
        _round_robin_table(per_op),
        *([_baseline_table(before, per_op, args.baseline)] if before else []),
        _table("eager value_and_grad, MLP 32x64 -> 128 -> 16 (per call)", eager_grad(repeat), "torch"),
        _table("erf over 2^20 float32 (per call)", eager_erf(max(5, repeat // 10)), "torch"),
        _table("batched GEMM (16,32,256) x (16,256,64), idle", batched_gemm(repeat, False), "torch"),
        _table("batched GEMM, beside a process spinning on one core", batched_gemm(repeat, True), "torch"),
    ]
    text = (f"## Eager speed and threading (bench_eager.py, issue 22 items 1 and 5)\n\n"
            f"`.venv/bin/python benchmarks/bench_eager.py{' --quick' if args.quick else ''}"
            f"{f' --repeat {args.repeat}' if args.repeat else ''}"
            f"{f' --baseline {args.baseline}' if args.baseline else ''}` on {model}, "
            f"{datetime.date.today()}, {os.cpu_count()} CPUs, kn.get_num_threads() = {kn.get_num_threads()}, "
            f"load average {load:.1f} at the start (a shared, noisy machine: medians and minimums, "
            f"all rows from the same run).\n\n" + "\n\n".join(sections) + "\n\n" + NOTES)
    print(text)
    if args.out:
        write_section(args.out, "bench_eager", text)


if __name__ == "__main__":
    main()
