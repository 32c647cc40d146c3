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


def test_device_runtime_part_dry_runs_on_the_opencl_device():
    """scripts/gpu_check_device.py's rows run here on opencl:0 (PoCL) and CPU torch, so
    the GPU session does not find a bug in the script itself: every row is numbered, none
    says 'not run' or FAIL, and the device-resident program counts no host copy."""
    from kiln.codegen.opencl.runtime import no_device_reason

    if no_device_reason() is not None:
        pytest.skip(f"needs an OpenCL device: {no_device_reason()}")
    torch = pytest.importorskip("torch")
    import numpy as np

    import kiln as kn

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
        import gpu_check_device as part
    finally:
        sys.path.remove(str(SCRIPT.parent))
    tables = [part.resident(torch, kn, np, gpu_check.table, 2, "opencl:0", "cpu", 256, 128),
              part.replay(torch, kn, np, gpu_check.table, 3, "opencl:0"),
              part.captured_loop(torch, kn, np, gpu_check.table, 1, "opencl:0", "cpu", 4096)]
    for text in tables:
        assert "not run" not in text and "FAIL" not in text, text
    assert "| opencl:0 | 0 / 0 / 0 | ok" in tables[0]
    assert tables[1].count("| ok") == 2 and "no CUDA graphs" in tables[1]
