"""Damaged object code in the cache is rebuilt, never loaded into LLVM's loader.

Each damaged entry is loaded by a subprocess, so a segfault or an LLVM abort shows as a
failing exit status instead of killing pytest. The entries carry a valid checksum (the
old layout) or even a valid tag under the cache's own key (kiln's own entry, damaged
afterwards): the object checks in `kiln.codegen.cache_elf` must catch them."""

import hashlib
import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen import cache_elf, cache_trust
from kiln.codegen.cpu import jit

WORKER = pathlib.Path(__file__).with_name("cache_worker.py")
X = np.arange(8, dtype=np.float32)

# a module with data, a call to an external function and a branch: relocations of several kinds
IR = """
@table = internal constant [4 x float] [float 1.0, float 2.0, float 3.0, float 4.0]
declare float @expf(float)
define void @kernel(ptr %out, i64 %i) {
entry:
  %p = getelementptr [4 x float], ptr @table, i64 0, i64 %i
  %v = load float, ptr %p
  %e = call float @expf(float %v)
  store float %e, ptr %out
  ret void
}
"""


def host_object() -> bytes:
    return jit.object_code(jit.parse(IR))


def sections(obj: bytes) -> list[tuple]:
    shoff = struct.unpack_from("<Q", obj, 0x28)[0]
    shnum = struct.unpack_from("<H", obj, 0x3C)[0]
    return [(shoff + 64 * i,) + struct.unpack_from("<IIQQQQIIQQ", obj, shoff + 64 * i) for i in range(shnum)]


def first_rela(obj: bytes) -> tuple:
    return next(s for s in sections(obj) if s[2] == 4)


def damage(obj: bytes, how: str) -> bytes:
    """`obj` with one field broken the way a loader would trip over it."""
    b = bytearray(obj)
    if how == "section table past the end":
        struct.pack_into("<Q", b, 0x28, 0x7FFFFFFF0)
    elif how == "relocation offset outside its section":
        rela = first_rela(obj)
        struct.pack_into("<Q", b, rela[5], 0x7FFFFFF0)
    elif how == "relocation symbol out of range":
        rela = first_rela(obj)
        info = struct.unpack_from("<Q", b, rela[5] + 8)[0]
        struct.pack_into("<Q", b, rela[5] + 8, (0xFFFF << 32) | (info & 0xFFFFFFFF))
    elif how == "unknown relocation type":
        rela = first_rela(obj)
        info = struct.unpack_from("<Q", b, rela[5] + 8)[0]
        struct.pack_into("<Q", b, rela[5] + 8, (info & ~0xFFFFFFFF) | 200)
    elif how == "section data past the end":
        sec = next(s for s in sections(obj) if s[2] == 1)
        struct.pack_into("<Q", b, sec[0] + 32, len(obj) - 4)
    elif how == "huge alignment":
        sec = next(s for s in sections(obj) if s[2] == 1)
        struct.pack_into("<Q", b, sec[0] + 48, 1 << 40)
    elif how == "symbol in a missing section":
        symtab = next(s for s in sections(obj) if s[2] == 2)
        struct.pack_into("<H", b, symtab[5] + 24 + 6, 999)
    elif how == "wrong machine":
        struct.pack_into("<H", b, 18, cache_elf.EM_AARCH64 if b[18] == cache_elf.EM_X86_64 else cache_elf.EM_X86_64)
    elif how == "32-bit class":
        b[4] = 1
    elif how == "truncated":
        del b[len(b) // 2:]
    elif how == "random bytes":
        b[4:] = hashlib.sha256(obj).digest() * (len(obj) // 32)
    return bytes(b)


HOW = ["section table past the end", "relocation offset outside its section", "relocation symbol out of range",
       "unknown relocation type", "section data past the end", "huge alignment", "symbol in a missing section",
       "wrong machine", "32-bit class", "truncated", "random bytes"]


def test_host_object_passes():
    obj = host_object()
    cache_elf.check_object(obj, machine=cache_elf.host_machine(), relocatable=True)
    assert first_rela(obj)  # the checks below break real relocations


@pytest.mark.parametrize("how", HOW)
def test_damaged_object_is_refused(how):
    with pytest.raises(cache_elf.BadObject):
        cache_elf.check_object(damage(host_object(), how), machine=cache_elf.host_machine(), relocatable=True)


def run(cache: pathlib.Path) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), "run", "x2"], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, KILN_CACHE_DIR=str(cache),
                                                # this file damages per-kernel object entries (whole-program
                                                # entries: tests/frontend/test_program_cache.py)
                                                KILN_PROGRAM_CACHE="0"))
    assert proc.returncode == 0, f"exit status {proc.returncode} (negative: killed by that signal)\n" \
                                 f"{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_damaged_entries_are_rebuilt_without_crashing(tmp_path):
    cache = tmp_path / "cache"
    run(cache)
    (entry,) = cache.rglob("*.bin")
    good = entry.read_bytes()
    payload = good[40:]
    secret = (cache / cache_trust.KEY_FILE).read_bytes()
    name = entry.stem
    # each of these segfaulted or aborted the process when loaded
    checksummed = {how: b"KILNOBJ1" + hashlib.sha256(d).digest() + d
                   for how in ("section table past the end", "relocation offset outside its section",
                               "random bytes") for d in [damage(payload, how)]}
    tagged = {how: cache_trust.seal(secret, "objects", name, damage(payload, how))
              for how in ("section table past the end", "relocation offset outside its section")}
    for how, blob in [*checksummed.items(), *tagged.items()]:
        entry.write_bytes(blob)
        result = run(cache)
        assert result["out"] == (X * 2).tolist(), how
        assert result["stats"]["corrupt"] == 1 and result["stats"]["writes"] == 1, how
        assert entry.read_bytes() == cache_trust.seal(secret, "objects", name, payload), how
