"""Machine code for a program's kernels, from kiln's on-disk artifact cache when it has it.

The key of an entry is the content of everything that decides the code: kiln's version,
a hash of the code generator's own source, the backend's options (`cache_key()`), the
host CPU (triple, name, features) and each kernel's fingerprint. A second process
compiling the same function loads the object code instead of rebuilding it.
"""

from __future__ import annotations

import functools

from kiln.errors import KilnError


def compile_kernels(target, kernels: list, mode: str = "default", objects: list | None = None,
                    stream=None) -> list:
    """Callables for `kernels`, from the on-disk artifact cache when it has them.
    With `objects` (a list), the per-kernel-set cache is skipped: the code is built and
    its object code appended to `objects` (the whole-program cache stores it with the
    program, program_cache.py, so no per-kernel keys are computed); by `stream` when
    the backend's streaming build was fed them (cpu/stream_build.py).

    max-autotune measures GEMM variants on this machine, so its choices are not cached."""
    if mode == "max-autotune":
        from kiln.progress import progress  # a bar on a terminal when tuning takes a while

        return [target.compile(k, measure=True)
                for k in progress(kernels, desc="autotuning", unit="kernel")]
    if not kernels or not target.caches_object_code:
        return target.compile_many(kernels)
    if objects is not None:
        blob = stream.finish([target.legalize(k) for k in kernels]) if stream is not None \
            else target.object_code(kernels)
        objects.append(blob)
        return target.load_object_code(kernels, blob)
    from kiln._version import __version__
    from kiln.codegen import artifact_cache
    from kiln.codegen.kernel_ir import kernel_fingerprint

    key = artifact_cache.content_key(__version__, _codegen_salt(), *target.cache_key(), _host_cpu(),
                                     *[kernel_fingerprint(k) for k in kernels])
    cached = load_cached(target, kernels, key)
    if cached is not None:
        return cached
    blob = target.object_code(kernels)
    artifact_cache.store(key, blob)
    return target.load_object_code(kernels, blob)


def load_cached(target, kernels: list, key: str, blob: bytes | None = None) -> list | None:
    """Callables for `kernels` from the object code cached under `key` (`blob`: that
    code, read already); None when there is none or it does not load (an entry from an
    incompatible build: the caller rebuilds it and stores the new code under the same key)."""
    from kiln.codegen import artifact_cache

    blob = artifact_cache.load(key) if blob is None else blob
    if blob is None:
        return None
    try:
        return target.load_object_code(kernels, blob)
    except (KilnError, OSError, RuntimeError, ValueError):
        return None


def _codegen_salt() -> str:
    """A hash of the code generator's own source: changing how code is generated (not
    only kiln's version) must invalidate cached machine code. Settings are the backend's
    options, in `Backend.cache_key()`."""
    return _codegen_source_hash()


@functools.lru_cache(maxsize=1)
def _codegen_source_hash() -> str:
    import hashlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "codegen"
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _host_cpu() -> str:
    """The host CPU as LLVM sees it (triple, name, features): asked once per process
    (0.5 ms), shared with the glue modules' cache key."""
    from kiln.codegen.cpu.glue_cache import host_cpu

    return host_cpu()
