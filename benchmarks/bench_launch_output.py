"""What passing the workers' output through `kiln launch` costs a job that prints a lot.

    python benchmarks/bench_launch_output.py [--nproc 4] [--lines 50000] [--repeat 3]
        [--out benchmarks/results/launch-output.md]

Each of --nproc workers prints --lines lines of about 60 bytes with PYTHONUNBUFFERED=1
(so every `print(a, b, c)` is several writes: the case where ranks used to mix inside a
line). Measured as wall time, median of --repeat runs, for:

- direct: the workers started by this script with their stdout on /dev/null (what the
  old launcher did: the workers inherited its stdout; nothing keeps lines whole);
- launch: `kiln launch --nproc N` with its stdout on /dev/null (each line read from the
  worker's pipe and written whole by the launcher);
- launch --prefix --log-dir: also a `[rank N] ` prefix and one log file per rank.

Each mode also runs with 0 lines; the cost of the output is the difference, so the
launcher's own start (store, token, spawning) is not counted against the pipes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import sys
for i in range(int(sys.argv[1])):
    print("rank", 0, "line", i, "payload", "x" * 24)
"""


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in text.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def run(mode: str, nproc: int, lines: int, script: Path, tmp: Path) -> float:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KILN_TOKEN", None)
    start = time.perf_counter()
    if mode == "direct":
        procs = [subprocess.Popen([sys.executable, str(script), str(lines)], env=env,
                                  stdout=subprocess.DEVNULL) for _ in range(nproc)]
        codes = [p.wait(timeout=600) for p in procs]
    else:
        extra = ["--prefix", "--log-dir", str(tmp / ("logs%d" % time.monotonic_ns()))] \
            if mode == "launch --prefix --log-dir" else []
        codes = [subprocess.run([sys.executable, "-m", "kiln.distributed", "launch", "--nproc",
                                 str(nproc), *extra, str(script), str(lines)], env=env,
                                stdout=subprocess.DEVNULL, timeout=600).returncode]
    elapsed = time.perf_counter() - start
    assert codes == [0] * len(codes), (mode, codes)
    return elapsed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--lines", type=int, default=50000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "launch-output.md"))
    args = ap.parse_args(argv)
    modes = ["direct", "launch", "launch --prefix --log-dir"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "printer.py"
        script.write_text(WORKER)
        for mode in modes:
            for lines in (0, args.lines):
                times = [run(mode, args.nproc, lines, script, Path(tmp))
                         for _ in range(args.repeat)]
                results[(mode, lines)] = statistics.median(times)
    cost = {m: results[(m, args.lines)] - results[(m, 0)] for m in modes}
    total = args.nproc * args.lines
    rows = ["| mode | 0 lines (s) | %d lines (s) | output cost (s) | per line (us) | "
            "cost vs direct |" % args.lines, "|---|---|---|---|---|---|"]
    for m in modes:
        rows.append("| %s | %.3f | %.3f | %.3f | %.2f | %.2fx |" % (
            m, results[(m, 0)], results[(m, args.lines)], cost[m], 1e6 * cost[m] / total,
            cost[m] / cost["direct"]))
    section = "\n".join([
        "## Workers' output through `kiln launch` (%s)" % datetime.date.today().isoformat(),
        "",
        "`python benchmarks/bench_launch_output.py --nproc %d --lines %d --repeat %d` on %s "
        "(%d CPUs, shared with other jobs), Python %s. %d workers each print %d lines of "
        "about 60 bytes, unbuffered; medians of %d runs; the output cost is the time with "
        "the lines minus the time with none (same run). The ratios compare within this run."
        % (args.nproc, args.lines, args.repeat, cpu_model(), os.cpu_count() or 0,
           platform.python_version(), args.nproc, args.lines, args.repeat),
        "",
        *rows,
    ])
    write_section(args.out, "launch-output", section, title="# kiln launch output benchmark")
    print(section)
    return {"results": {"%s/%d" % k: v for k, v in results.items()}, "cost": cost}


if __name__ == "__main__":
    main()
