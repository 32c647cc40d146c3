"""The glue modules' object code in kiln's on-disk artifact cache.

`jit.glue_module` builds kiln's small hand-written LLVM modules: the split entries
(native_pool.py: kiln's native team's `kiln_team_for`/claim, or libgomp's
`kiln_parallel_for`/`kiln_parallel_claim`), the prepared call's `kiln_launches`
trampoline, a captured plan's `bind` (launch_list.py), the complex GEMM tiles
(gemm_complex.py) and the Threefry bits (random_native.py). Their text is the same in
every process, yet each process paid parse + optimization + MCJIT for them on first use:
16 ms for the split entries (the first split launch of a process), 10 ms for the trampoline
(a signature's second call), both inside a warm program's first calls. Here the O1
object code of such a text is stored in kiln's artifact cache (kind "glue") and a later
process loads it (~2 ms: read, authenticate, check, link).

Trust is the kernels' (docs/security.md): an entry is read only from the user's own
cache folder, only when its HMAC tag under the cache's secret key verifies for kind
"glue" and this exact key, and its payload passes the same ELF checks as kernel object
code (`artifact_cache.VALIDATORS["objects"]`, relocatable, the host's machine) before
LLVM's loader sees it. A refused entry is removed and the module rebuilt and stored
again; it never runs.

Key: the module text, the O-level, the host CPU (triple, name, features), kiln's and
llvmlite's versions, LLVM's, and a hash of the source of jit.py (the target machine and
pipeline) and of this file. A text that embeds this process's addresses (an integer
constant cast to a pointer: a captured plan's kernel entries) is built in memory as
before: its entry could never be hit by another process. So is every module when the
cache is disabled or `KILN_CACHE_DIR` is unsafe: glue is built during a call, where a
cache problem must not fail the run (compiling the program reports it).

`STATS` counts what this process's glue cache did (tests read it).
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

import llvmlite
import llvmlite.binding as llvm

from kiln.codegen import artifact_cache
from kiln.codegen.cpu import jit
from kiln.errors import KilnCacheError

KIND = "glue"
STATS = {"hits": 0, "misses": 0, "stores": 0, "refused": 0, "in_memory": 0}
# an integer literal cast to a pointer: an address of this process baked into the text
_ADDRESS = re.compile(r"inttoptr\s*\(?\s*i64\s+-?\d")


def glue_module(text: str, opt_level: int = 1) -> jit.Jitted:
    """The module `text` compiled at `opt_level`, its object code loaded from the cache
    when a process before built the same text on this machine, else built and stored."""
    if not cacheable(text):
        STATS["in_memory"] += 1
        return _in_memory(text, opt_level)
    key = entry_key(text, opt_level)
    blob = _load(key)
    if blob is not None:
        try:
            jitted = jit.Jitted(objects=(blob,), opt_level=opt_level)
            STATS["hits"] += 1
            return jitted
        except (RuntimeError, OSError, ValueError):
            STATS["refused"] += 1  # checked, yet not loadable: rebuilt and replaced below
    STATS["misses"] += 1
    # in an LLVM context and target machine of its own, outside llvmlite's process-wide
    # lock (the native team's glue: ~35 ms of LLVM): a cold compile builds it on a thread
    # beside its LLVM build threads, which would otherwise wait for the lock
    blob = jit._compile_alone(text, opt_level)
    try:
        STATS["stores"] += artifact_cache.store(key, blob, KIND)
    except KilnCacheError:
        pass  # an unsafe KILN_CACHE_DIR: compile() reports it; the glue works uncached
    return jit.Jitted(objects=(blob,), opt_level=opt_level)


def cacheable(text: str) -> bool:
    """Whether `text` is the same in every process: no address of this one in it."""
    return _ADDRESS.search(text) is None


def entry_key(text: str, opt_level: int = 1) -> str:
    """The cache key of `text` built at `opt_level` on this host with this toolchain."""
    return artifact_cache.content_key("glue", str(opt_level), _toolchain(), text)


@lru_cache(maxsize=1)
def host_cpu() -> str:
    """The host CPU as LLVM sees it, `triple|name|features`: object code built for one
    host is never loaded on another."""
    name, features = jit.host_cpu()
    return f"{llvm.get_process_triple()}|{name}|{features}"


@lru_cache(maxsize=1)
def _toolchain() -> str:
    """Everything besides the text that decides the object code, as one string."""
    from kiln._version import __version__

    source = hashlib.sha256()
    for path in (jit.__file__, __file__):
        with open(path, "rb") as f:
            source.update(f.read())
    llvm_version = ".".join(map(str, llvm.llvm_version_info))
    return "|".join((__version__, llvmlite.__version__, llvm_version, source.hexdigest()[:16], host_cpu()))


def _load(key: str) -> bytes | None:
    """The authenticated, ELF-checked object code under `key`, or None (absent, refused
    and removed, or no usable cache)."""
    before = artifact_cache.STATS["corrupt"]
    try:
        blob = artifact_cache.load(key, KIND, validate=artifact_cache.VALIDATORS["objects"])
    except KilnCacheError:
        return None
    if artifact_cache.STATS["corrupt"] > before:
        STATS["refused"] += 1
    return blob


def _in_memory(text: str, opt_level: int) -> jit.Jitted:
    """Parse, optimize and JIT `text` in this process only (nothing cached)."""
    mod = jit.parse(text)
    jit.optimize(mod, opt_level)
    return jit.Jitted(mod, opt_level=opt_level)
