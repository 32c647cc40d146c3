"""State dicts as safetensors files: `kn.save_state_dict(sd, path)`, `kn.load_state_dict(path)`.

safetensors (Hugging Face's format) is an 8-byte little-endian header length, a JSON
header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`
and one flat byte buffer. It holds only data, so loading executes nothing.

Writing goes through the `safetensors` package (its serializer, the one its numpy API
calls, which also takes bf16 and fp8 by name). Reading checks the whole header here
first, strictly — a file from the internet is untrusted — and every violation is a
`KilnSafetensorsError` (K340) naming the file, the tensor and the rule; only then are
tensors read, through the package's numpy API (`safe_open(framework="np")`) for the
dtypes numpy has, and from the checked byte ranges for bf16 and the fp8 formats (the
package's numpy API has no ml_dtypes types). A Hugging Face sharded checkpoint
(`model.safetensors.index.json`, or its folder) loads as one state dict.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections import OrderedDict
from typing import Mapping

import ml_dtypes
import numpy as np

from kiln.errors import KilnSafetensorsError, KilnStateDictError

# the header limit Hugging Face's own reader enforces: a larger length is hostile
MAX_HEADER_BYTES = 100 * 1024 * 1024

# header dtype code -> numpy dtype (bf16 and fp8 through ml_dtypes)
FILE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
# numpy's own dtypes: read through safetensors.numpy; the rest from the checked ranges
_NUMPY_NATIVE = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "F32",
                 "F64", "C64"}
# codes the format defines that kiln has no dtype for
_KNOWN_ELSEWHERE = {"F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C32"}
# the name the package's serializer takes for each numpy dtype kiln stores
_SAVE_NAMES = {np.dtype(t): name for name, t in [
    ("bool", np.bool_), ("uint8", np.uint8), ("int8", np.int8), ("int16", np.int16),
    ("uint16", np.uint16), ("int32", np.int32), ("uint32", np.uint32), ("int64", np.int64),
    ("uint64", np.uint64), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
    ("float32", np.float32), ("float64", np.float64), ("complex64", np.complex64),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn), ("float8_e5m2", ml_dtypes.float8_e5m2)]}


def save_state_dict(state_dict: Mapping, path: str | os.PathLike,
                    metadata: Mapping[str, str] | None = None) -> None:
    """Write `{name: tensor}` to a safetensors file (atomically: a crash leaves the old file).

    >>> kn.save_state_dict(model.state_dict(), "model.safetensors")
    >>> sd = kn.load_state_dict("model.safetensors")
    """
    from safetensors import TensorSpec, serialize_file

    from kiln.progress import write_with_progress

    arrays = _arrays_to_save(state_dict)
    meta = {"format": "pt"}  # what transformers checks: names and layout as torch's
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise KilnStateDictError(f"save_state_dict: metadata must map str to str, got "
                                     f"{key!r}: {type(value).__name__}")
        meta[key] = value
    specs = {name: TensorSpec(dtype=_SAVE_NAMES[a.dtype], shape=list(a.shape),
                              data_ptr=a.ctypes.data, data_len=a.nbytes)
             for name, a in arrays.items()}
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kiln-", suffix=".safetensors.tmp", dir=folder)
    os.close(fd)
    try:
        # `arrays` keeps every data_ptr alive; a bar follows the file on a terminal
        write_with_progress(lambda target: serialize_file(specs, target, metadata=meta), tmp,
                            sum(a.nbytes for a in arrays.values()),
                            f"saving {os.path.basename(path)}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _arrays_to_save(state_dict: Mapping) -> "OrderedDict[str, np.ndarray]":
    from kiln.frontend.tensor import Tensor

    if not isinstance(state_dict, Mapping):
        raise KilnStateDictError(f"save_state_dict: expected a mapping of names to tensors, got "
                                 f"{type(state_dict).__name__}")
    arrays: "OrderedDict[str, np.ndarray]" = OrderedDict()
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise KilnStateDictError(f"save_state_dict: key {name!r} is not a usable tensor name "
                                     "(a non-empty string other than '__metadata__')")
        if isinstance(value, Tensor):
            array = value.numpy()
        elif isinstance(value, np.ndarray):
            array = value
        else:
            raise KilnStateDictError(f"save_state_dict: {name!r} is a {type(value).__name__}, "
                                     "not a kn.Tensor or numpy array")
        if array.dtype not in _SAVE_NAMES:
            raise KilnStateDictError(f"save_state_dict: {name!r} has dtype {array.dtype}, which "
                                     f"safetensors cannot store; use one of "
                                     f"{', '.join(sorted(_SAVE_NAMES.values()))}")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        arrays[name] = array if array.flags.c_contiguous else array.copy(order="C")  # keeps 0-d
    return arrays


# -- reading -------------------------------------------------------------------------------


def read_header(path: str | os.PathLike) -> tuple[dict, dict, int]:
    """Check a safetensors file's header; return (tensors, metadata, data start).

    `tensors` maps each name to (dtype code, shape, begin, end) with offsets relative to
    the data section. Every rule of the format is enforced; a violation raises K340."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                _bad(path, f"the file is {size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                _bad(path, f"the header length is {n} bytes, over the {MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                _bad(path, f"the header length says {n} bytes but only {size - 8} follow: "
                           "the file is truncated")
            raw = f.read(n)
    except OSError as e:
        raise KilnSafetensorsError(f"load_state_dict: cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        _bad(path, f"the header is not valid UTF-8 JSON ({e})")
    if not isinstance(header, dict):
        _bad(path, f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        _bad(path, "__metadata__ must be an object of strings")
    data_size = size - 8 - n
    tensors = {name: _check_entry(path, name, entry, data_size) for name, entry in header.items()}
    _check_ranges(path, tensors, data_size)
    return tensors, metadata, 8 + n


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the key {dup!r} appears twice")
    return dict(pairs)


def _check_entry(path: str, name: str, entry, data_size: int) -> tuple:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        _bad(path, "each entry must be exactly {dtype, shape, data_offsets}", name)
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in FILE_DTYPES:
        if code in _KNOWN_ELSEWHERE:
            _bad(path, f"dtype {code} has no kiln dtype; kiln reads "
                       f"{', '.join(FILE_DTYPES)}", name)
        _bad(path, f"unknown dtype {code!r}; the format's dtypes kiln reads are "
                   f"{', '.join(FILE_DTYPES)}", name)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        _bad(path, f"shape {shape!r} must be a list of non-negative integers", name)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)):
        _bad(path, f"data_offsets {offsets!r} must be two non-negative integers", name)
    begin, end = offsets
    if begin > end:
        _bad(path, f"data_offsets [{begin}, {end}] end before they begin", name)
    if end > data_size:
        _bad(path, f"data_offsets [{begin}, {end}] reach past the {data_size}-byte data section", name)
    count = 1
    for d in shape:
        count *= d
    need = count * FILE_DTYPES[code].itemsize
    if need != end - begin:
        _bad(path, f"shape {shape} of {code} needs {need} bytes but data_offsets [{begin}, {end}] "
                   f"hold {end - begin}", name)
    return code, tuple(shape), begin, end


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_ranges(path: str, tensors: dict, data_size: int) -> None:
    """The byte ranges must tile the data section exactly: no overlap (two tensors aliasing
    the same bytes), no gap (hidden bytes), nothing after the last tensor."""
    at, previous = 0, None
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda kv: kv[1][2:]):
        if begin < at:
            _bad(path, f"bytes [{begin}, {end}) overlap tensor {previous!r}, which ends at {at}", name)
        if begin > at:
            _bad(path, f"bytes [{at}, {begin}) before it belong to no tensor (a hole in the data)", name)
        at, previous = end, name
    if at != data_size:
        _bad(path, f"the data section is {data_size} bytes but the tensors cover {at}")


def _bad(path: str, rule: str, name: str | None = None):
    where = f" tensor {name!r}:" if name is not None else ""
    raise KilnSafetensorsError(f"load_state_dict: {path}:{where} {rule}",
                               hint="the file is not a valid safetensors file; re-save it")


def load_safetensors(path: str | os.PathLike) -> "OrderedDict[str, np.ndarray]":
    """The arrays of one safetensors file, in header order, after the header checks."""
    from safetensors import safe_open

    path = os.fspath(path)
    tensors, _, start = read_header(path)
    out: "OrderedDict[str, np.ndarray]" = OrderedDict()
    native = [n for n, (code, *_rest) in tensors.items() if code in _NUMPY_NATIVE]
    if native:
        with safe_open(path, framework="np") as f:
            for name in native:
                out[name] = np.array(f.get_tensor(name), copy=True)
    with open(path, "rb") as f:
        for name, (code, shape, begin, end) in tensors.items():
            if code in _NUMPY_NATIVE:
                continue
            f.seek(start + begin)
            raw = f.read(end - begin)
            out[name] = np.frombuffer(raw, dtype=np.uint8).view(FILE_DTYPES[code]).reshape(shape).copy()
    return OrderedDict((name, out[name]) for name in tensors)


def load_state_dict(path: str | os.PathLike) -> "OrderedDict[str, object]":
    """Read a safetensors file (or a Hugging Face sharded checkpoint: its
    `*.safetensors.index.json`, or the folder holding it) into `{name: kn.Tensor}`.

    >>> sd = kn.load_state_dict("model.safetensors"); model.load_state_dict(sd)
    """
    from kiln.frontend.factories import asarray

    path = os.fspath(path)
    files = _shard_files(path)
    result: "OrderedDict[str, object]" = OrderedDict()
    for file in files:
        for name, array in load_safetensors(file).items():
            if name in result:
                raise KilnSafetensorsError(f"load_state_dict: tensor {name!r} is in two shards "
                                           f"(again in {file})")
            result[name] = asarray(array)
    return result


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` strings of a safetensors file (checked like a load)."""
    return read_header(path)[1]


def _shard_files(path: str) -> list[str]:
    index = path
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if found:
            index = os.path.join(path, found[0])
        else:
            single = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(single) != 1:
                raise KilnSafetensorsError(
                    f"load_state_dict: {path} is a folder with {len(single)} .safetensors files "
                    "and no *.safetensors.index.json saying how they fit together")
            return [os.path.join(path, single[0])]
    if not index.endswith(".json"):
        return [path]
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KilnSafetensorsError(f"load_state_dict: {index} is not a safetensors index "
                                   f"(a JSON object with a 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise KilnSafetensorsError(f"load_state_dict: {index}: weight_map must map names to files")
    folder = os.path.dirname(os.path.abspath(index))
    files = []
    for shard in dict.fromkeys(weight_map.values()):
        if os.path.isabs(shard) or os.path.normpath(shard).startswith(".."):
            raise KilnSafetensorsError(f"load_state_dict: {index} names shard {shard!r} outside "
                                       "its own folder")
        files.append(os.path.join(folder, shard))
    return files
