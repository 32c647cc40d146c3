"""Compile time of the small GPT training step (bench_train.py's GPT row), cold and warm.

Each run is a fresh process: `cold` starts from an empty KILN_CACHE_DIR, `warm` reuses the
cache the cold run of the same round wrote (issue 22: cold <= 1 s, warm <= 0.1 s). Per
stage, wall clock: trace, graph passes, lowering, LLVM, whole-program cache load, the
first step itself; `compile` is the first call minus that step. Variants, in the same
rounds so their ratios compare like with like:

- `kiln`: as shipped (whole-program cache, LLVM modules built on kiln's threads);
- `serial LLVM`: kn.set_num_threads(1) before compiling (one LLVM module, one thread);
- `no program cache`: KILN_PROGRAM_CACHE=0 (warm = per-kernel-set object cache only);
- `baseline` (with `--baseline DIR`): the `kiln` variant run on another kiln tree (e.g.
  `git archive REV kiln | tar -x -C DIR`), for a same-run before/after.

`--kiln DIR` runs every variant on a snapshot of kiln instead of the working tree: the
whole-program cache key hashes kiln's compiler source, so edits made by others between a
cold and a warm run would turn the warm run into a miss. `--warm N` makes N warm runs
after each cold one (their median per round). `--bytecode` first compiles each tree's
kiln/ to bytecode (`compileall`, as `pip install` does): without it, where
PYTHONDONTWRITEBYTECODE=1 is set and a snapshot has no __pycache__, every module kiln
imports during the first call is compiled from source in every run (~25 ms of the GPT
step's warm first call, which a user's installed kiln does not pay).

    .venv/bin/python benchmarks/bench_compile.py --rounds 3 --out benchmarks/results/cpu.md
    .venv/bin/python benchmarks/bench_compile.py --profile cold   # cProfile of one first call
    .venv/bin/python benchmarks/bench_compile.py --breakdown 5    # CPU per piece of a warm call
    .venv/bin/python benchmarks/bench_compile.py --breakdown 5 --kiln NEW --baseline OLD  # alternating
    .venv/bin/python benchmarks/bench_compile.py --breakdown 5 --serial --bytecode --kiln NEW --baseline OLD
    .venv/bin/python benchmarks/bench_compile.py --rounds 3 --warm 3 --bytecode --kiln NEW --baseline OLD
    .venv/bin/python benchmarks/bench_compile.py --optimizer-trace 9   # optimizers' traced updates
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "cpu.md")
BEGIN, END = "<!-- bench_compile: begin -->", "<!-- bench_compile: end -->"

WORKER = r"""
import functools, json, os, sys, time
t0 = time.perf_counter()
import kiln as kn
imported = time.perf_counter() - t0
sys.path.insert(0, {here!r})
import bench_train as bt
import kiln.frontend.compile as C
from kiln.frontend import program_cache
from kiln.codegen import build_program as BP
from kiln.codegen.cpu import jit
from kiln.passes import manager as PM
from kiln.runtime import executor as EX
T = {{}}
B = {{}}  # --breakdown: thread CPU seconds per piece of the first call
def timed(owner, name, label, clock=time.perf_counter, into=T):
    fn = getattr(owner, name)
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            into[label] = into.get(label, 0.0) + clock() - t
    setattr(owner, name, wrapper)
timed(C.CompiledFunction, "_trace", "trace")
timed(PM.Pipeline, "run", "passes")
timed(BP, "build_program", "lower")
timed(jit, "object_codes", "llvm")
timed(jit, "optimize", "llvm")
timed(jit, "object_code", "llvm")
timed(program_cache, "load", "cache load")
timed(EX.Executable, "run", "first step")
if {breakdown!r}:
    import gc
    import kiln.frontend.autodiff as FA
    import kiln.optim.adam as AD
    import kiln.frontend.graph_compile as GC
    import kiln.ir.printer as PR
    import kiln.codegen.program_codec as PC
    try:
        from kiln.frontend import compiler_source as CS
    except ImportError:  # an older tree (--kiln): the source hash was program_cache's
        CS = program_cache
    for owner, name, label in ((C.CompiledFunction, "_compile", "compile path (_compile)"),
                               (C, "trace_function", "  trace (with the vjp and the optimizer)"),
                               (FA._Differentiated, "_trace", "    forward trace (value_and_grad)"),
                               (FA, "vjp_graph", "    vjp_graph"),
                               (FA, "inline", "    forward and backward inlined into the trace"),
                               (AD.Adam, "update", "    optimizer update (AdamW.update)"),
                               (program_cache, "program_key", "  program-cache key"),
                               (PR, "print_graph", "    canonical graph text"),
                               (CS, "compiler_state" if CS is not program_cache else "source_hash",
                                "    compiler source hash"),
                               (program_cache, "load", "  entry load (tag, JSON, decode, ELF check)"),
                               (PC, "decode_program", "    program decode"),
                               (program_cache, "load_kernels", "  kernels load (LLVM objects, wrappers)"),
                               (EX.Executable, "__init__", "  executor build"),
                               (EX.Executable, "run", "first step"),
                               (C.CompiledFunction, "_remember_call", "prepared call (per-call path)")):
        if hasattr(owner, name):
            B[label] = 0.0  # rows in this order
            timed(owner, name, label, time.thread_time, B)
    B["cycle collector"] = 0.0
    def _gc(phase, info, _t=[0.0]):
        if phase == "start":
            _t[0] = time.thread_time()
        else:
            B["cycle collector"] = B.get("cycle collector", 0.0) + time.thread_time() - _t[0]
    gc.callbacks.append(_gc)
if {serial!r}:
    kn.set_num_threads(1)
step, params, state, x, y, key = bt.kiln_gpt_step(compiled=False)
c = kn.compile(step)
profile = {profile!r}
if profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t0, cpu0 = time.perf_counter(), time.process_time()
c(params, state, x, y, key)
first, cpu = time.perf_counter() - t0, time.process_time() - cpu0
if profile:
    prof.disable()
    import pstats
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
T.update(first=first, compile=first - T.get("first step", 0.0), imported=imported, cpu=cpu)
print(json.dumps({{"t": T, "stats": program_cache.STATS, "kiln": kn.__file__, "cpu": B}}))
"""

VARIANTS = {"kiln": {}, "serial LLVM": {"serial": True},
            "no program cache": {"env": {"KILN_PROGRAM_CACHE": "0"}}}
STAGES = ("trace", "passes", "lower", "llvm", "cache load", "first step", "compile", "first", "cpu")


def run_once(cache: str, serial: bool = False, env: dict | None = None, profile: bool = False,
             tree: str | None = None, breakdown: bool = False) -> dict:
    """One fresh process's first call; `tree`: a kiln snapshot to import instead."""
    full = dict(os.environ, KILN_CACHE_DIR=cache, **(env or {}))
    if tree:
        full["PYTHONPATH"] = os.path.abspath(tree)
    code = WORKER.format(here=HERE, serial=serial, profile=profile, breakdown=breakdown)
    done = subprocess.run([sys.executable, "-c", code],
                          env=full, capture_output=True, text=True, timeout=900,
                          cwd=os.path.abspath(tree) if tree else None)  # `-c` puts the cwd first
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip()[-2000:])
    if profile:
        print(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if tree and not result["kiln"].startswith(os.path.abspath(tree)):
        raise RuntimeError(f"the run imported {result['kiln']}, not the tree {tree}")
    return result


def measure(rounds: int, warm: int = 1, tree: str | None = None, baseline: str | None = None) -> dict:
    """{variant: {"cold"/"warm": [per-run stage dicts]}}, variants interleaved per round;
    each round's warm entry is the median (per stage) of its `warm` runs."""
    variants = dict(VARIANTS)
    if baseline:
        variants["baseline"] = {"tree": baseline}
    out = {v: {"cold": [], "warm": []} for v in variants}
    for _ in range(rounds):
        for name, v in variants.items():
            where = v.get("tree", tree)
            with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
                for which in ["cold"] + ["warm"] * warm:
                    res = run_once(cache, v.get("serial", False), v.get("env"), tree=where)
                    out[name][which].append(res["t"])
                    print(name, which, {k: round(res["t"].get(k, 0.0), 3) for k in STAGES},
                          res["stats"], file=sys.stderr)
            if warm > 1:  # this round's warm runs -> their median
                runs, out[name]["warm"] = out[name]["warm"][-warm:], out[name]["warm"][:-warm]
                out[name]["warm"].append({k: median(runs, k) for k in STAGES})
    return out


def breakdown(runs: int, tree: str | None, baseline: str | None = None, serial: bool = False) -> str:
    """Thread CPU milliseconds per piece of a warm first call (medians of `runs` fresh
    processes after one cold run), as a markdown table; with `baseline`, that tree's
    warm runs alternate with `tree`'s (a same-run before/after column). `serial`: one
    kiln thread (no split launches: the pieces without OpenMP's spinning on a busy machine)."""
    trees = {"after": tree, "before": baseline} if baseline else {"CPU ms": tree}
    results: dict = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as caches:
        for name, where in trees.items():
            os.mkdir(os.path.join(caches, name))
            run_once(os.path.join(caches, name), serial, tree=where)
        for _ in range(runs):
            for name, where in trees.items():
                results[name].append(run_once(os.path.join(caches, name), serial, tree=where, breakdown=True))
    if not all(r["stats"]["hits"] == 1 for rs in results.values() for r in rs):
        raise RuntimeError("a warm run missed the program cache (was kiln's source edited meanwhile?)")
    names = list(trees)[::-1]  # before, after
    totals = {n: statistics.median(r["t"]["cpu"] for r in results[n]) for n in names}
    head = " | ".join(f"{n} (CPU ms, median of {runs})" for n in names)
    lines = [f"| piece of the warm first call | {head} |", "|---" * (len(names) + 1) + "|"]
    labels = list(results[names[-1]][0]["cpu"])
    labels += [k for k in results[names[0]][0]["cpu"] if k not in labels]
    for label in labels:
        cells = " | ".join(f"{statistics.median(r['cpu'].get(label, 0.0) for r in results[n]) * 1e3:.1f}"
                           for n in names)
        lines.append(f"| {label.replace('  ', '&nbsp;&nbsp;')} | {cells} |")
    lines.append("| first call, whole process | " + " | ".join(f"{totals[n] * 1e3:.1f}" for n in names) + " |")
    cells = []
    for n in names:
        prepared = statistics.median(r["cpu"].get("prepared call (per-call path)", 0.0) for r in results[n])
        cells.append(f"{(totals[n] - prepared) * 1e3:.1f}")
    lines.append("| first call without the prepared call | " + " | ".join(cells) + " |")
    walls = " | ".join(f"{statistics.median(r['t']['first'] for r in results[n]):.3f} s" for n in names)
    lines.append(f"| first call, wall clock | {walls} |")
    return "\n".join(lines)


def optimizer_trace(runs: int) -> str:
    """Thread CPU ms of tracing each optimizer's update over the GPT step's parameters, its
    per-parameter body traced once per (dtype, shape) and replayed (leaf_replay.map_leaves)
    against the plain loop, alternating in this process (medians of `runs`), as a markdown
    table; the two graphs' texts are checked equal."""
    import kiln as kn
    from kiln import optim
    from kiln.optim import adam, sgd

    sys.path.insert(0, HERE)
    import bench_train as bt

    params = bt.kiln_gpt_step(compiled=False)[1]
    grads = {k: kn.tensor(v.numpy() * 0.5) for k, v in params.items()}
    plain = lambda body, columns: [tuple(body(*column)) for column in columns]  # noqa: E731
    cases = [("SGD(momentum=0.9, nesterov, weight_decay)", sgd,
              optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
             ("SGD(lr)", sgd, optim.SGD(lr=0.1)), ("AdamW", adam, optim.AdamW(lr=1e-3))]
    lines = [f"| update traced ({len(params)} parameters) | plain loop (ms) | replayed (ms) | ratio |",
             "|---|---|---|---|"]
    for name, module, opt in cases:
        state, real = opt.init(params), module.map_leaves
        times: dict = {"plain": [], "replay": []}
        texts = {}
        try:
            for _ in range(runs):
                for which, fn in (("plain", plain), ("replay", real)):
                    module.map_leaves = fn
                    t = time.thread_time()
                    texts[which] = str(kn.trace(opt.update, grads, state, params))
                    times[which].append(time.thread_time() - t)
        finally:
            module.map_leaves = real
        if texts["plain"] != texts["replay"]:
            raise RuntimeError(f"{name}: the replayed graph differs from the plain loop's")
        a, b = (statistics.median(times[w]) * 1e3 for w in ("plain", "replay"))
        lines.append(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    return "\n".join(lines)


def compile_bytecode(tree: str | None) -> None:
    """Bytecode for every module of `tree`'s kiln/ (the working tree when None), written
    into its __pycache__ folders as an installed package has it."""
    root = os.path.join(os.path.abspath(tree) if tree else os.path.dirname(HERE), "kiln")
    subprocess.run([sys.executable, "-m", "compileall", "-q", root], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)


def median(runs: list, key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in runs)


def render(results: dict, rounds: int, load0: float, load1: float, command: str = "") -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown")
    lines = [BEGIN, "## Compile time of the small GPT training step (bench_compile.py, issue 22)", "",
             f"- command: `{command or f'.venv/bin/python benchmarks/bench_compile.py --rounds {rounds}'}`",
             f"- machine: {os.cpu_count()} CPUs, {cpu} (`lscpu` model name); load average "
             f"{load0:.1f} at the start, {load1:.1f} at the end",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"{rounds} rounds, each variant a fresh process per run, variants interleaved", "",
             "Seconds, median over the rounds. `compile` = first call - first step (the step "
             "itself runs once inside the first call); `import kiln` is not included; `CPU` = "
             "the process's CPU seconds (all threads) during the first call: the work, which a "
             "loaded machine stretches less than the wall clock.", "",
             "| variant | run | trace | graph passes | lowering | LLVM | program cache load | "
             "first step | compile | first call | CPU |", "|---" * 11 + "|"]
    for name, by in results.items():
        for which in ("cold", "warm"):
            runs = by[which]
            cells = [f"{median(runs, k):.3f}" for k in STAGES]
            lines.append(f"| {name} | {which} | " + " | ".join(cells) + " |")
    k, s, n = results["kiln"], results["serial LLVM"], results["no program cache"]
    lines += ["", f"Same-run ratios (medians): cold compile serial LLVM / kiln "
              f"{median(s['cold'], 'compile') / median(k['cold'], 'compile'):.2f}x; warm compile "
              f"no program cache / kiln {median(n['warm'], 'compile') / median(k['warm'], 'compile'):.2f}x."]
    if "baseline" in results:
        b = results["baseline"]
        lines[-1] += (f" Warm first call, baseline / kiln: {median(b['warm'], 'first') / median(k['warm'], 'first'):.2f}x"
                      f" wall, {median(b['warm'], 'cpu') / median(k['warm'], 'cpu'):.2f}x CPU; cold first call "
                      f"{median(b['cold'], 'first') / median(k['cold'], 'first'):.2f}x wall.")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(path: str, text: str) -> None:
    old = open(path).read() if os.path.exists(path) else ""
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text.rstrip("\n") + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="", help="results file to update (its bench_compile section)")
    parser.add_argument("--profile", choices=("cold", "warm"), help="print a cProfile of one first call")
    parser.add_argument("--warm", type=int, default=1, help="warm runs after each cold run")
    parser.add_argument("--kiln", default="", help="a kiln snapshot (folder holding kiln/) to run")
    parser.add_argument("--baseline", default="", help="another kiln snapshot, run as variant `baseline`")
    parser.add_argument("--breakdown", type=int, default=0,
                        help="print the CPU time of each piece of a warm first call (median of N runs)")
    parser.add_argument("--serial", action="store_true",
                        help="--breakdown with one kiln thread (kn.set_num_threads(1))")
    parser.add_argument("--bytecode", action="store_true",
                        help="compile each tree's kiln/ to bytecode first (as an installed package has it)")
    parser.add_argument("--optimizer-trace", type=int, default=0, metavar="N",
                        help="trace each optimizer's update N times, replayed vs plain loop, alternating")
    args = parser.parse_args()
    if args.optimizer_trace:
        print(optimizer_trace(args.optimizer_trace))
        return 0
    if args.bytecode:
        for tree in [args.kiln or None] + ([args.baseline] if args.baseline else []):
            compile_bytecode(tree)
    if args.breakdown:
        print(breakdown(args.breakdown, args.kiln or None, args.baseline or None, args.serial))
        return 0
    if args.profile:
        with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
            if args.profile == "warm":
                run_once(cache, tree=args.kiln or None)
            run_once(cache, profile=True, tree=args.kiln or None)
        return 0
    load0 = os.getloadavg()[0]
    results = measure(args.rounds, args.warm, args.kiln or None, args.baseline or None)
    command = ".venv/bin/python benchmarks/bench_compile.py " + " ".join(sys.argv[1:])
    text = render(results, args.rounds, load0, os.getloadavg()[0], command)
    print(text)
    if args.out:
        write_section(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
