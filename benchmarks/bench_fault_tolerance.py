"""Recovery from `kill -9`: detection, shrink and grow in place against a full restart.

    python benchmarks/bench_fault_tolerance.py [--nproc 4] [--kills 3] [--restarts 3]
        [--backend tcp|mpi] [--out benchmarks/results/fault_tolerance.md]

One job of examples/train_ddp_ft.py (data-parallel MLP, compiled step, fault-tolerant
group) runs under `kiln launch --on-failure replace` with `--kills` SIGKILLs injected at
spaced steps on different ranks. For each kill:

- detection: from the launcher sending SIGKILL to the survivors' PeerFailure;
- shrink: from the survivors starting to reconfigure (in should_commit) to the smaller
  group being connected and in use;
- grow: admitting the replacement (agreeing, connecting; its state follows at rank 0's
  next call).

The baseline is what a job without fault tolerance does after the same kill: stop
everything and start again from a checkpoint. Measured here, `--restarts` times: from
`kiln launch` of the same job (resuming from the first job's final state) to its first
committed step, i.e. process start, imports, rendezvous, checkpoint load and the
compile of the step. The detection time (the same for both) and the steps since the
last checkpoint (none here) are not counted in the baseline, which favors it.

`--backend mpi`: the same job on the mpi backend under `kiln launch --engine mpi`
(mpirun with ULFM); the ranks SIGKILL themselves at the chosen steps (mpirun starts
them: nothing outside can inject), Open MPI reports the deaths, rank 0 spawns the
replacements into the job, and the full restart is a new mpirun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Fault tolerance: recovery from kill -9 (bench_fault_tolerance.py)"
HEADING_MPI = "## Fault tolerance on the mpi backend (ULFM): recovery from kill -9 " \
    "(bench_fault_tolerance.py --backend mpi)"
EXAMPLE = ROOT / "examples" / "train_ddp_ft.py"


def launch(extra: list[str], worker: list[str], timeout: float) -> float:
    cmd = [sys.executable, "-m", "kiln", "launch", *extra, str(EXAMPLE), "--worker", *worker]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode:
        raise SystemExit("job failed (%d):\n%s\n%s" % (proc.returncode, proc.stdout[-3000:],
                                                       proc.stderr[-3000:]))
    return t0


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--steps-per-kill", type=int, default=15)
    ap.add_argument("--backend", choices=("tcp", "mpi"), default="tcp")
    ap.add_argument("--out", default=None,
                    help="markdown file to put the table in (its section is replaced)")
    args = ap.parse_args(argv)
    mpi = args.backend == "mpi"
    engine = ["--engine", "mpi"] if mpi else []
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-ft-"))
    steps = args.steps_per_kill * (args.kills + 1)
    kill_steps = [args.steps_per_kill * (i + 1) for i in range(args.kills)]
    injects = []
    for i, step in enumerate(kill_steps):
        injects += ["--inject", "kill:rank=%d,step=%d" % (1 + i % (args.nproc - 1), step)]
    backend = ["--backend", args.backend]
    if mpi:  # the ranks kill themselves (see the module docstring)
        backend += ["--kill-self", ",".join("%d:%d" % (step, 1 + i % (args.nproc - 1))
                                            for i, step in enumerate(kill_steps))]
        injects = []
    else:
        injects += ["--events-json", str(work / "events.json")]
    ft_dir, ckpt = work / "ft", work / "state.npz"
    ft_dir.mkdir()
    print("fault-tolerant job: %d ranks, %d steps, kills at steps %s" % (args.nproc, steps,
                                                                        kill_steps), flush=True)
    launch(engine + ["--nproc", str(args.nproc), "--on-failure", "replace", "--max-restarts",
                     str(args.kills), *injects],
           ["--steps", str(steps), "--out", str(ft_dir), "--save", str(ckpt)] + backend,
           timeout=600)
    ranks = [json.loads(p.read_text()) for p in ft_dir.glob("rank_uid*.json")]
    if mpi:
        kills = [json.loads((ft_dir / ("killed_%d.json" % s)).read_text())["time"]
                 for s in kill_steps]
    else:
        events = json.loads((work / "events.json").read_text())["events"]
        kills = [e["time"] for e in events if e["kind"] == "injected"]
    rank0 = min((r for r in ranks if not r["joined"]), key=lambda r: r["uid"])
    shrinks = [h for h in rank0["history"] if h["failed_at"]]
    grows = [h for h in rank0["history"] if h["joined"] and not h["failed_at"]]
    detection = [h["failed_at"] - k for h, k in zip(shrinks, kills)]
    assert len({r["digest"] for r in ranks}) == 1, "ranks ended with different parameters"

    restarts = []
    for i in range(args.restarts):
        out = work / ("restart%d" % i)
        out.mkdir()
        t0 = launch(engine + ["--nproc", str(args.nproc)],
                    ["--steps", "1", "--out", str(out), "--resume", str(ckpt),
                     "--backend", args.backend], timeout=300)
        first = min(json.loads(p.read_text())["first_commit_at"] for p in out.glob("*.json"))
        restarts.append(first - t0)
        print("full restart %d: %.3f s" % (i + 1, restarts[-1]), flush=True)

    med = statistics.median
    result = {"detection_s": detection, "shrink_s": [h["total_s"] for h in shrinks],
              "grow_s": [h["total_s"] for h in grows], "restart_s": restarts,
              "steps_lost": rank0["rolled_back"], "kills": len(kills)}
    ratio = med(restarts) / med(result["shrink_s"])
    rows = [("detection (SIGKILL to PeerFailure)", detection),
            ("shrink in place (agree + reconnect)", result["shrink_s"]),
            ("grow in place (admit the replacement)", result["grow_s"]),
            ("full restart (launch, load checkpoint, first step)", restarts)]
    lines = [HEADING_MPI if mpi else HEADING, "",
             "- command: `python benchmarks/bench_fault_tolerance.py --nproc %d --kills %d "
             "--restarts %d%s`" % (args.nproc, args.kills, args.restarts,
                                   " --backend mpi" if mpi else ""),
             "- machine: %d cores, %s, %s, Python %s" % (os.cpu_count(), cpu_model(),
                                                        platform.platform(),
                                                        platform.python_version()),
             "- date: %s" % datetime.date.today().isoformat(),
             "- load average at start of the table: %.2f" % os.getloadavg()[0],
             "- job: examples/train_ddp_ft.py worker (MLP 32-128-128-8, compiled value_and_grad "
             "and AdamW, one all_reduce of gradients per step), %d ranks on this machine; %d "
             "kills at steps %s on ranks %s, each replaced (`--on-failure replace`)%s"
             % (args.nproc, len(kills), kill_steps,
                [1 + i % (args.nproc - 1) for i in range(args.kills)],
                "; `kiln launch --engine mpi`: mpirun --with-ft ulfm, replacements spawned "
                "into the job (MPI_Comm_spawn) and admitted by Accept/Connect + merge"
                if mpi else ""), "",
             "| phase | median | min | max | samples |", "|---|---:|---:|---:|---:|"]
    for name, xs in rows:
        if xs:
            lines.append("| %s | %.3f s | %.3f s | %.3f s | %d |" % (name, med(xs), min(xs),
                                                                   max(xs), len(xs)))
    lines += ["", "shrink-and-continue is %.0fx faster than a full restart (medians); steps "
              "rolled back: %d over %d kills; every rank ended with identical parameters. "
              "Shrink and grow are timed on rank 0 from entering the reconfiguration to "
              "the new group being in use; a replacement that arrived while a failure was "
              "being handled entered with that shrink and has no grow sample of its own."
              % (ratio, result["steps_lost"], len(kills))]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(Path(args.out), text, HEADING_MPI if mpi else HEADING)
    return result


def write_section(path: Path, section: str, heading: str = HEADING) -> None:
    """Replace this benchmark's section of `path` (from its heading to the next `## `
    heading), or append it."""
    old = path.read_text() if path.exists() else ""
    start = old.find(heading)
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + section if old else section)
        return
    end = old.find("\n## ", start + len(heading))
    path.write_text(old[:start] + section + (old[end + 1:] if end >= 0 else ""))


if __name__ == "__main__":
    main()
