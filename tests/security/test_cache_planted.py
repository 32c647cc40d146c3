"""Hostile compile-cache entries: code kiln did not write is never run.

An attacker who can write files where kiln caches compiled code plants an object file
(that creates a marker file when run) or moves one function's entry under another's
key, or plants Python where the Triton path used to import kernel sources from. Each
victim runs in a subprocess, which must give the right answer, create no marker, and
count the planted entry as refused."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("cache_worker.py")
X = np.arange(8, dtype=np.float32)


def worker(cache: pathlib.Path, *args: str, env: dict | None = None) -> dict:
    """Run a cache_worker role with KILN_CACHE_DIR=cache; a crash (signal) fails here."""
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, KILN_CACHE_DIR=str(cache), **(env or {})))
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(cache: pathlib.Path) -> list[pathlib.Path]:
    return sorted(cache.rglob("*.bin"))


def old_format(payload: bytes) -> bytes:
    """An entry in the checksummed (unauthenticated) layout kiln used to trust."""
    return b"KILNOBJ1" + hashlib.sha256(payload).digest() + payload


@pytest.mark.timeout(300)
def test_planted_object_never_runs(tmp_path):
    attacker, victim, marker = tmp_path / "attacker", tmp_path / "victim", tmp_path / "marker"
    worker(attacker, "plant", "x2", str(marker))
    assert marker.exists(), "the hostile object must work when it is loaded, or this test proves nothing"
    marker.unlink()
    (entry,) = entries(attacker)
    hostile = entry.read_bytes()
    planted = victim / entry.relative_to(attacker)
    # as the attacker's kiln wrote it (tagged with the attacker's key), and checksummed only
    for blob in (hostile, old_format(hostile[40:])):
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(blob)
        result = worker(victim, "run", "x2")
        assert not marker.exists()
        assert result["out"] == (X * 2).tolist()
        assert result["stats"]["corrupt"] == 1 and result["stats"]["writes"] == 1
        assert planted.read_bytes() != blob  # replaced by kiln's own build
    assert worker(victim, "run", "x2")["stats"]["hits"] == 1


@pytest.mark.timeout(300)
def test_swapped_entries_keep_each_function(tmp_path):
    cache = tmp_path / "cache"
    worker(cache, "run", "x2")
    (x2_entry,) = entries(cache)
    worker(cache, "run", "x3")
    (x3_entry,) = [p for p in entries(cache) if p != x2_entry]
    x2_bytes, x3_bytes = x2_entry.read_bytes(), x3_entry.read_bytes()
    x2_entry.write_bytes(x3_bytes)
    x3_entry.write_bytes(x2_bytes)
    for name, factor in (("x2", 2), ("x3", 3)):
        result = worker(cache, "run", name)
        assert result["out"] == (X * factor).tolist()
        assert result["stats"]["corrupt"] == 1 and result["stats"]["hits"] == 0


def plant_sources(folder: pathlib.Path, sources: list[str], marker: pathlib.Path) -> None:
    """Python files where kiln used to import Triton kernel sources from, creating
    `marker` when imported (then defining the real kernel, so nothing else breaks)."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in sources:
        digest = hashlib.sha256(source.encode()).hexdigest()
        (folder / f"k_{digest}.py").write_text(f"open({str(marker)!r}, 'w').close()\n{source}")


@pytest.mark.timeout(300)
def test_planted_triton_source_never_runs(tmp_path):
    """`kiln dump --stage asm --target cuda` (no GPU needed) with planted kernel sources
    in the cache and in a foreign-owned fallback folder under the temp dir."""
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    clean = worker(tmp_path / "clean", "triton")
    assert clean["sources"] and ".entry" in clean["asm"]
    marker = tmp_path / "marker"

    cache = tmp_path / "cache"
    plant_sources(cache / "triton-src", clean["sources"], marker)
    result = worker(cache, "triton")
    assert not marker.exists()
    assert result["asm"] == clean["asm"]

    # the cache unusable (a file in the way): nothing falls back to a shared temp folder
    temp = tmp_path / "tmp"
    fallback = temp / f"kiln-triton-src-{os.getuid()}"
    plant_sources(fallback, clean["sources"], marker)
    os.chown(fallback, 4242, 4242)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    result = worker(blocker, "triton", env={"TMPDIR": str(temp)})
    assert not marker.exists()
    assert result["asm"] == clean["asm"]


def test_load_source_reads_no_file(tmp_path, monkeypatch):
    """load_source executes the text it is given, whatever files exist by its name."""
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    import inspect
    import tempfile

    from kiln.codegen.triton import aot

    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def scale_kernel(x_ptr, n, BLOCK: tl.constexpr):\n    pid = tl.program_id(0)\n"
              f"    # {tmp_path}\n")  # a text no other test loads
    marker = tmp_path / "marker"
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    for folder in (cache / "triton-src", tmp_path / "tmp" / f"kiln-triton-src-{os.getuid()}"):
        plant_sources(folder, [source], marker)
    fn = aot.load_source(source)
    assert not marker.exists()
    assert fn.__name__ == "scale_kernel"
    assert inspect.getsource(fn).startswith("@triton.jit\ndef scale_kernel(")
    assert aot.as_jit_function(fn).arg_names == ["x_ptr", "n", "BLOCK"]
