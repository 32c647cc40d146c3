"""Digests of the LLVM IR kiln emits for every bench_cpu.py workload (tinygrad's "process
replay" idea): run it on two trees; equal digests mean a refactor changed no CPU code, so
it cannot have changed CPU speed, whatever a noisy machine's timings say.

    .venv/bin/python benchmarks/cpu_ir_digest.py            # one line per workload
"""

from __future__ import annotations

import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cpu  # noqa: E402

import kiln as kn  # noqa: E402
from kiln.frontend.stages import render_stage  # noqa: E402


def main() -> None:
    for item in bench_cpu.workloads(quick=True):
        key, fn, args = item[0], item[2], item[4]
        text = render_stage(kn.trace(fn, *args), "source", "cpu")
        print(f"{key:12s} {hashlib.sha256(text.encode()).hexdigest()[:16]} {len(text)} chars")


if __name__ == "__main__":
    main()
