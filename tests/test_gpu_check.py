"""scripts/gpu_check.py cannot run here (no GPU): it imports cleanly, answers --help, and
without a GPU exits with status 2 and says why instead of failing somewhere inside."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_imports_without_side_effects():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions and tables only
    assert module.COPY_CEILING_TBS == 4.3 and module.NUMERIC_CASES and module.SPEED_SHAPES
    assert module.table(["a", "b"], [[1, 2.5]]) == "| a | b |\n|---|---|\n| 1 | 2.5 |"


def test_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    assert "--quick" in proc.stdout and "--out" in proc.stdout and "--skip" in proc.stdout


def test_exits_with_a_clear_message_without_a_gpu():
    torch = pytest.importorskip("torch", reason="the no-GPU path is reached through torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "gpu_check: no GPU: torch.cuda.is_available() is False" in proc.stderr
    assert "run it on a GPU machine" in proc.stderr
    assert "Traceback" not in proc.stderr
