"""kiln's glue modules (kiln/codegen/cpu/glue_cache.py): their O1 object code is stored
in the artifact cache and a second process loads it and computes correctly; a planted,
swapped or damaged entry is refused (never run) and rebuilt; without a usable cache the
glue is built in memory as before.

Victims run in subprocesses (tests/codegen/glue_worker.py), so a crash in LLVM's loader
shows as an exit status."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

from kiln.codegen import artifact_cache, cache_elf, cache_trust
from kiln.codegen.cpu import glue_cache, jit, launch_list, native_pool
from kiln.errors import KilnCacheWarning

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "security"))
from cache_worker import inject_creat  # noqa: E402  (the planted-object helper of the cache tests)

WORKER = pathlib.Path(__file__).with_name("glue_worker.py")
needs_gomp = pytest.mark.skipif(native_pool.parallel_for() is None,
                                reason="needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")

# a glue-sized module with a loop and a call: computes sum_{i<n} (x + i)
SUM_IR = """
define i64 @glue_sum(i64 %x, i64 %n) {
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%i1, %body]
  %acc = phi i64 [0, %entry], [%acc1, %body]
  %go = icmp slt i64 %i, %n
  br i1 %go, label %body, label %done
body:
  %v = add i64 %x, %i
  %acc1 = add i64 %acc, %v
  %i1 = add i64 %i, 1
  br label %head
done:
  ret i64 %acc
}
"""
SUM_FN = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)


def glue_sum(jitted, x: int, n: int) -> int:
    return SUM_FN(jitted.address("glue_sum"))(x, n)


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ["KILN_CACHE_DIR"])


def entry_path(text: str) -> pathlib.Path:
    key = glue_cache.entry_key(text)
    return cache_root() / glue_cache.KIND / key[:2] / f"{key}.bin"


def victim() -> dict:
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, KILN_CACHE_DIR=str(cache_root())))
    assert proc.returncode == 0, f"exit status {proc.returncode} (negative: killed by that signal)\n" \
                                 f"{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["worst"] < 1e-6  # float32 exp against float64 numpy
    assert result["native"] == 2 and result["split_prepared"] == [True]
    return result


def stats() -> dict:
    return dict(glue_cache.STATS)


def test_glue_in_process_hit_computes(monkeypatch):
    before = stats()
    first = glue_cache.glue_module(SUM_IR)
    assert glue_sum(first, 5, 10) == sum(5 + i for i in range(10))
    assert entry_path(SUM_IR).is_file()
    second = glue_cache.glue_module(SUM_IR)
    assert glue_sum(second, -3, 1000) == sum(-3 + i for i in range(1000))
    assert glue_sum(first, 7, 3) == 24  # both engines stay valid
    after = stats()
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] == 1
    # another O-level is another entry
    third = glue_cache.glue_module(SUM_IR, 2)
    assert glue_sum(third, 1, 4) == 10 and stats()["misses"] - before["misses"] == 2


def test_text_with_this_process_addresses_is_not_cached():
    address = ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p).value
    text = f"""
define i32 @call_it() {{
entry:
  %f = inttoptr i64 {address} to ptr
  %r = call i32 %f()
  ret i32 %r
}}
"""
    assert not glue_cache.cacheable(text) and glue_cache.cacheable(SUM_IR)
    assert glue_cache.cacheable(launch_list._LAUNCHES_IR) and glue_cache.cacheable(native_pool._IR)
    before = stats()["in_memory"]
    jitted = glue_cache.glue_module(text)
    assert ctypes.CFUNCTYPE(ctypes.c_int32)(jitted.address("call_it"))() == 1
    assert stats()["in_memory"] == before + 1
    assert not (cache_root() / glue_cache.KIND).exists()


def test_unsafe_cache_dir_builds_in_memory(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could plant code in here
    monkeypatch.setenv("KILN_CACHE_DIR", str(shared))
    jitted = glue_cache.glue_module(SUM_IR)
    assert glue_sum(jitted, 2, 5) == 20
    assert list(shared.iterdir()) == []


def test_disabled_cache_builds_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.delenv("KILN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the default root cannot be created
    before = stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnCacheWarning)
        jitted = glue_cache.glue_module(SUM_IR)
    assert glue_sum(jitted, 1, 3) == 6
    assert stats()["stores"] == before["stores"] and stats()["hits"] == before["hits"]


@needs_gomp
@pytest.mark.timeout(300)
def test_second_process_loads_the_glue_and_computes():
    first = victim()
    assert first["glue"]["misses"] == 2 and first["glue"]["stores"] == 2
    for text in (native_pool._IR, launch_list._LAUNCHES_IR):
        assert entry_path(text).is_file()
    second = victim()
    assert second["glue"] == {"hits": 2, "misses": 0, "stores": 0, "refused": 0, "in_memory": 0}


def hostile_object(text: str, marker: pathlib.Path) -> bytes:
    """`text`'s object code with every function first creating `marker`."""
    mod = jit.parse(inject_creat(text, str(marker)))
    jit.optimize(mod, 1)
    return jit.object_code(mod, 1)


def own_secret() -> bytes:
    return artifact_cache.trusted_root()[1]


def plant(text: str, blob: bytes) -> pathlib.Path:
    path = entry_path(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return path


def assert_rebuilt(text: str) -> None:
    """The entry of `text` is kiln's own again: tagged under its key, a sound object."""
    key = glue_cache.entry_key(text)
    payload = cache_trust.unseal(own_secret(), glue_cache.KIND, key, entry_path(text).read_bytes())
    assert payload is not None
    cache_elf.check_object(payload, machine=cache_elf.host_machine(), relocatable=True)


@needs_gomp
@pytest.mark.timeout(300)
def test_planted_glue_never_runs(tmp_path):
    marker = tmp_path / "marker"
    hostile = hostile_object(native_pool._IR, marker)
    key = glue_cache.entry_key(native_pool._IR)
    # control: the same object tagged with the cache's own key is loaded, and runs
    plant(native_pool._IR, cache_trust.seal(own_secret(), glue_cache.KIND, key, hostile))
    victim()
    assert marker.exists(), "the hostile object must run when it is loaded, or this test proves nothing"
    marker.unlink()
    # planted by someone without the key: tagged with another cache's key
    planted = plant(native_pool._IR, cache_trust.seal(os.urandom(32), glue_cache.KIND, key, hostile))
    result = victim()
    assert not marker.exists()
    assert result["glue"]["refused"] == 1 and result["glue"]["stores"] == 1
    assert planted.read_bytes() != hostile
    assert_rebuilt(native_pool._IR)


@needs_gomp
@pytest.mark.timeout(300)
def test_swapped_and_damaged_glue_is_refused_and_rebuilt():
    texts = (native_pool._IR, launch_list._LAUNCHES_IR)
    for text in texts:
        glue_cache.glue_module(text)  # kiln's own entries, in this test's cache
    a, b = (entry_path(t) for t in texts)
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)  # each entry under the other's key: both tags fail
    b.write_bytes(a_bytes)
    result = victim()
    assert result["glue"]["refused"] == 2 and result["glue"]["hits"] == 0 and result["glue"]["stores"] == 2
    for text in texts:
        assert_rebuilt(text)
    # tagged with the cache's own key under the right name, but the object is damaged:
    # the section table points past the end of the file (LLVM's loader segfaults on it)
    key = glue_cache.entry_key(native_pool._IR)
    payload = bytearray(cache_trust.unseal(own_secret(), glue_cache.KIND, key, a.read_bytes()))
    payload[0x28:0x30] = (0x7FFFFFFF0).to_bytes(8, "little")
    plant(native_pool._IR, cache_trust.seal(own_secret(), glue_cache.KIND, key, bytes(payload)))
    result = victim()
    assert result["glue"]["refused"] == 1 and result["glue"]["hits"] == 1 and result["glue"]["stores"] == 1
    assert_rebuilt(native_pool._IR)
    assert victim()["glue"]["hits"] == 2



def test_a_miss_builds_outside_llvmlites_lock(monkeypatch):
    """A miss compiles the glue in an LLVM context of its own, outside llvmlite's
    process-wide lock (a cold compile builds it beside its LLVM build threads): the
    locked global-context path is not used, the stored object is byte for byte what
    that path makes, and it computes."""
    mod = jit.parse(SUM_IR)
    jit.optimize(mod, 1)
    locked = jit.object_code(mod, 1)
    for name in ("parse", "optimize", "object_code"):
        monkeypatch.setattr(jit, name, lambda *a, _n=name: pytest.fail(f"jit.{_n} holds llvmlite's lock"))
    jitted = glue_cache.glue_module(SUM_IR)
    assert glue_sum(jitted, 3, 4) == 18
    assert glue_cache._load(glue_cache.entry_key(SUM_IR)) == locked
