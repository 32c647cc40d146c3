"""Shared pieces of kiln's benchmark scripts: timing by medians, and writing one
script's marked section of a results file without touching the others' sections."""

from __future__ import annotations

import os
import platform
import subprocess
import time

import numpy as np


def timings(fn, repeat: int, warmup: int = 1, clock=time.perf_counter) -> tuple[float, float]:
    """(median, minimum) wall time of `fn()` in seconds over `repeat` runs after `warmup`:
    the median is the headline; the minimum is what a shared machine disturbs least.
    `clock=time.process_time` measures CPU time instead."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return float(np.median(times)), float(np.min(times))


def median_s(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds over `repeat` runs after `warmup` runs."""
    return timings(fn, repeat, warmup)[0]


def write_section(path: str, name: str, section: str, title: str = "# CPU benchmark results") -> None:
    """Replace the section between `<!-- name: begin -->` and `<!-- name: end -->` in
    `path`, or add it after the file's title; other sections stay as they are."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{begin}\n{section.strip()}\n{end}"
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif old.startswith("# "):
        first, _, body = old.partition("\n")
        text = f"{first}\n\n{block}\n\n{body.lstrip()}"
    else:
        text = f"{title}\n\n{block}\n\n{old}"
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def cpu_model() -> str:
    """The `lscpu` model name of this machine (results name the machine they ran on)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"
