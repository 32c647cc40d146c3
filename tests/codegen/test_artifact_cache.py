"""The on-disk artifact cache: a second process reuses compiled code, a corrupt entry is
detected and rebuilt, and processes compiling the same function at once are safe."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from kiln.codegen import artifact_cache
from kiln.errors import KilnCacheWarning

WORKER = r"""
import json, sys
import numpy as np
import kiln as kn
from kiln.codegen import artifact_cache

f = kn.compile(lambda x, w: kn.gelu(x @ w) + 1)
x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
w = np.ones((4, 5), np.float32)
out = f(x, w).numpy()
want = kn.gelu(kn.asarray(x) @ kn.asarray(w)).numpy() + 1
print(json.dumps({"stats": artifact_cache.STATS, "ok": bool(np.allclose(out, want, atol=1e-5))}))
"""


def run_worker(cache: pathlib.Path, processes: int = 1) -> list[dict]:
    env = dict(os.environ, KILN_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def entries(cache: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in cache.rglob("*.bin"))


def test_store_and_load_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    key = artifact_cache.content_key("a", "b")
    assert artifact_cache.load(key, "blobs") is None
    assert artifact_cache.store(key, b"machine code", "blobs")
    assert artifact_cache.load(key, "blobs") == b"machine code"
    assert key != artifact_cache.content_key("ab", "")  # parts are length-delimited


def test_corrupt_entry_is_detected_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    key = artifact_cache.content_key("x")
    artifact_cache.store(key, b"payload bytes", "blobs")
    (path,) = entries(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert artifact_cache.load(key, "blobs") is None
    assert not path.exists()


def test_unwritable_cache_is_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocker))
    with pytest.warns(KilnCacheWarning, match="is not a directory"):
        assert artifact_cache.store(artifact_cache.content_key("y"), b"z") is False


@pytest.mark.timeout(180)
def test_second_process_loads_instead_of_compiling(tmp_path):
    (first,) = run_worker(tmp_path)
    assert first["ok"] and first["stats"]["writes"] == 1 and first["stats"]["hits"] == 0
    (second,) = run_worker(tmp_path)
    assert second["ok"] and second["stats"]["hits"] == 1 and second["stats"]["writes"] == 0


@pytest.mark.timeout(180)
def test_corrupt_entry_is_rebuilt_by_the_next_compile(tmp_path):
    run_worker(tmp_path)
    (path,) = entries(tmp_path)
    path.write_bytes(path.read_bytes()[:100])  # truncated by a crash or a full disk
    (result,) = run_worker(tmp_path)
    assert result["ok"] and result["stats"]["corrupt"] == 1 and result["stats"]["writes"] == 1
    (result,) = run_worker(tmp_path)
    assert result["stats"]["hits"] == 1


@pytest.mark.timeout(180)
def test_processes_compiling_at_once_are_safe(tmp_path):
    results = run_worker(tmp_path, processes=3)
    assert all(r["ok"] for r in results)
    assert len(entries(tmp_path)) == 1
    assert not list(tmp_path.rglob(".tmp-*"))
    (again,) = run_worker(tmp_path)
    assert again["stats"]["hits"] == 1
