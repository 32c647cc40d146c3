"""The checkpoint manifest: one JSON file naming every shard of every tensor.

    {"format": "kiln-checkpoint", "version": 1, "save_id": "9f2c...", "world_size": 4,
     "tensors": {"w": {"dtype": "float32", "shape": [8, 6], "placements": ["Shard(0)"],
                       "shards": [{"file": "shard-9f2c-r0.safetensors", "byte_offset": 88,
                                   "offsets": [0, 0], "shape": [2, 6], "nbytes": 48,
                                   "xxh3_128": "..."}, ...]}}}      # or "sha256"

Each rank writes one shard file, a safetensors file (an 8-byte header length, a JSON
header, then the raw little-endian bytes of its C-ordered blocks one after the other);
load reads only the manifest: each block's place in the file, dtype and shape. Nothing is unpickled or evaluated. `validate` refuses a
hostile or broken manifest before any shard is opened: unknown dtypes, shapes that are
not non-negative ints, blocks outside the global shape, blocks that overlap or leave
holes, byte counts that do not match, and file names that are not plain names inside
the checkpoint folder (absolute paths, "..", separators, symlinks leading out).
"""

from __future__ import annotations

import json
import os
import re

from kiln.distributed.checkpoint import checksum
from kiln.distributed.errors import CheckpointError, CheckpointManifestError
from kiln.ir import dtypes as kd

FORMAT, VERSION = "kiln-checkpoint", 1
MANIFEST = "manifest.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_DTYPES = {d.name: d for d in kd.ALL_DTYPES}
_MAX_DIM = 1 << 40


def dtype_of(name) -> kd.DType:
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointManifestError("manifest: unknown dtype %r; kiln writes one of %s"
                                      % (name, ", ".join(sorted(_DTYPES))))
    return _DTYPES[name]


def dtype_name(dtype: kd.DType) -> str:
    return dtype.name


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_DIM for v in value):
        raise CheckpointManifestError("manifest: %s must be a list of non-negative ints, got %r"
                                      % (what, value))
    return tuple(value)


def _volume(shape) -> int:
    size = 1
    for s in shape:
        size *= s
    return size


def shard_path(folder: str, name) -> str:
    """The path of shard file `name` inside `folder`, refused if it could leave it."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise CheckpointManifestError(
            "manifest: shard file %r is not a plain file name inside the checkpoint folder "
            "(absolute paths, separators and '..' are refused)" % (name,))
    path = os.path.join(folder, name)
    real, root = os.path.realpath(path), os.path.realpath(folder)
    if os.path.dirname(real) != root:
        raise CheckpointManifestError("manifest: shard file %r resolves to %s, outside the "
                                      "checkpoint folder %s" % (name, real, root))
    return path


def validate(doc, folder: str) -> dict:
    """The manifest's tensors, checked: {key: (dtype, shape, [shard dicts])}."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointManifestError("manifest in %s is not a kiln checkpoint manifest" % folder)
    if doc.get("version") != VERSION:
        raise CheckpointManifestError("manifest: version %r is not supported (this kiln reads "
                                      "version %d)" % (doc.get("version"), VERSION))
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointManifestError("manifest: 'tensors' must be an object")
    out = {}
    for key, entry in tensors.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            raise CheckpointManifestError("manifest: tensor %r has no shard list" % key)
        dtype = dtype_of(entry.get("dtype"))
        shape = _ints(entry.get("shape"), "the shape of %r" % key)
        shards, total = [], 0
        for s in entry["shards"]:
            if not isinstance(s, dict):
                raise CheckpointManifestError("manifest: a shard of %r is not an object" % key)
            offs = _ints(s.get("offsets"), "offsets of a shard of %r" % key)
            sshape = _ints(s.get("shape"), "the shape of a shard of %r" % key)
            if len(offs) != len(shape) or len(sshape) != len(shape) or any(
                    o + n > g for o, n, g in zip(offs, sshape, shape)):
                raise CheckpointManifestError(
                    "manifest: shard %r of %r (offsets %s, shape %s) lies outside the tensor's "
                    "shape %s" % (s.get("file"), key, list(offs), list(sshape), list(shape)))
            nbytes = _volume(sshape) * max(1, dtype.bits // 8)
            if s.get("nbytes") != nbytes:
                raise CheckpointManifestError(
                    "manifest: shard %r of %r declares %r bytes (its shape and dtype make %d)"
                    % (s.get("file"), key, s.get("nbytes"), nbytes))
            algo, digest = checksum.of_shard(s, "shard %r of %r" % (s.get("file"), key))
            start = s.get("byte_offset")
            if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < 1 << 50:
                raise CheckpointManifestError("manifest: shard %r of %r has byte_offset %r; it "
                                              "must be a non-negative int" % (s.get("file"), key,
                                                                              start))
            shard_path(folder, s.get("file"))
            shards.append({"file": s["file"], "byte_offset": start, "offsets": offs,
                           "shape": sshape, "nbytes": nbytes, algo: digest})
            total += _volume(sshape)
        _check_cover(key, shape, shards, total)
        out[key] = (dtype, shape, shards)
    _check_bytes(out)
    return out


def _check_bytes(tensors: dict) -> None:
    """No two blocks (of any tensors) claim the same bytes of a file."""
    spans = sorted((s["file"], s["byte_offset"], s["byte_offset"] + s["nbytes"], key)
                   for key, (_, _, shards) in tensors.items() for s in shards if s["nbytes"])
    for (f1, _, end, k1), (f2, start, _, k2) in zip(spans, spans[1:]):
        if f1 == f2 and start < end:
            raise CheckpointManifestError("manifest: blocks of %r and %r share bytes of file %s"
                                          % (k1, k2, f1))


def _check_cover(key: str, shape: tuple, shards: list, total: int) -> None:
    """The blocks tile the tensor: no two overlap, and their volumes add up to it."""
    boxes = [(s["offsets"], s["shape"]) for s in shards if _volume(s["shape"])]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (a, an), (b, bn) = boxes[i], boxes[j]
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, an, b, bn)):
                raise CheckpointManifestError("manifest: two shards of %r overlap (offsets %s "
                                              "and %s)" % (key, list(a), list(b)))
    if total != _volume(shape):
        raise CheckpointManifestError("manifest: the shards of %r hold %d of its %d elements"
                                      % (key, total, _volume(shape)))


def read(folder: str) -> dict:
    """The validated tensors of the committed checkpoint in `folder`."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(64 << 20)
    except FileNotFoundError:
        raise CheckpointError("load: %s holds no committed checkpoint (no %s)"
                              % (folder, MANIFEST)) from None
    except OSError as err:
        raise CheckpointError("load: cannot read %s: %s" % (path, err)) from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointManifestError("manifest %s is not valid JSON: %s" % (path, err)) from None
    return validate(doc, folder)
