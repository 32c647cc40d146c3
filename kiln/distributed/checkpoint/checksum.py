"""Checksums of checkpoint shards: which algorithm, computing and checking one.

Every block a rank writes gets a checksum in the manifest, under the name of its
algorithm:

    {"file": "shard-...-r0.safetensors", ..., "xxh3_128": "5e1f..."}   # new saves
    {"file": "shard-...-r0.safetensors", ..., "sha256": "9b0c..."}     # without xxhash

New saves use XXH3-128 when the `xxhash` package is installed (`pip install
kiln[checkpoint]`): it hashes at memory speed, about ten times SHA-256 here, so the
checksum no longer competes with the write for the CPU (a corrupt or truncated shard is
what it guards against, not an adversary; the manifest itself is not signed either).
Without the package saves use SHA-256, and checkpoints of either kind load wherever
their algorithm is available.

    >>> algo = default_algorithm()          # "xxh3_128" or "sha256"
    >>> digest(algo, b"abc") == digest(algo, memoryview(b"abc"))
    True
"""

from __future__ import annotations

import hashlib
from typing import Callable

from kiln.distributed.errors import CheckpointError, CheckpointManifestError

ALGORITHMS = ("xxh3_128", "sha256")

try:  # optional: the fast checksum (kiln[checkpoint])
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None


def available(algo: str) -> bool:
    """Whether this process can compute `algo`."""
    return algo == "sha256" or (algo == "xxh3_128" and _xxhash is not None)


def default_algorithm() -> str:
    """The algorithm new saves use: XXH3-128 when xxhash is installed, else SHA-256."""
    return "xxh3_128" if _xxhash is not None else "sha256"


def function(algo: str) -> Callable[[object], str]:
    """A function from a bytes-like object to its hex digest under `algo`."""
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).hexdigest()
    if algo == "xxh3_128":
        if _xxhash is None:
            raise CheckpointError("the checkpoint's shards carry XXH3-128 checksums, but the "
                                  "xxhash package is not installed in this environment",
                                  hint="pip install 'kiln[checkpoint]' (or xxhash)")
        return lambda data: _xxhash.xxh3_128_hexdigest(data)
    raise CheckpointManifestError("manifest: unknown checksum algorithm %r; kiln writes one of "
                                  "%s" % (algo, ", ".join(ALGORITHMS)))


def digest(algo: str, data) -> str:
    """The hex digest of `data` (bytes-like) under `algo`."""
    return function(algo)(data)


def of_shard(shard: dict, what: str) -> tuple[str, str]:
    """(algorithm, hex digest) a manifest's shard entry declares: exactly one of
    ALGORITHMS as a key with a hex string; K247 otherwise (`what` names the shard)."""
    found = [a for a in ALGORITHMS if a in shard]
    if len(found) != 1 or not isinstance(shard[found[0]], str) or not all(
            c in "0123456789abcdef" for c in shard[found[0]]) or not shard[found[0]]:
        raise CheckpointManifestError("manifest: %s must carry one checksum (%s) as a lowercase "
                                      "hex string" % (what, " or ".join(ALGORITHMS)))
    return found[0], shard[found[0]]


__all__ = ["ALGORITHMS", "available", "default_algorithm", "digest", "function", "of_shard"]
