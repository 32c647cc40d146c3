"""The `.kir` archive: one graph, its constants and metadata in a zip file.

    manifest.json       {"format": "kiln.kir", "format_version": 1, "opset_version": 1, ...}
    graph.txt           the text IR, exactly as the printer writes it
    constants/<i>.npy   one array per constant (np.save, allow_pickle=False)

Loading treats every file as hostile: the zip is checked entry by entry against
`ArchiveLimits` (count, sizes as declared *and* as inflated, names), the manifest is
validated field by field, each `.npy` header must agree with the manifest, and the
graph goes through the parser and verifier. Nothing is unpickled, evaluated or
executed; any failure is a one-line `KilnFormatError` naming the file and the
problem. See docs/kir-format.md.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import struct
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from kiln._version import __version__
from kiln.errors import KilnArgumentError, KilnError, KilnFormatError, KilnFormatVersionError
from kiln.ir import dtypes as dt
from kiln.ir.graph import Graph
from kiln.ir.parser import MAX_TEXT, parse_graph
from kiln.ir.printer import print_graph
from kiln.ir.verifier import verify

FORMAT = "kiln.kir"
FORMAT_VERSION = 1
OPSET_VERSION = 1
MANIFEST = "manifest.json"
GRAPH_ENTRY = "graph.txt"

# kiln's own entries are plain relative names; anything else (absolute paths, `..`,
# backslashes, drive letters, control characters) is refused rather than interpreted
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # identical graphs give identical bytes
_CHUNK = 1 << 20
_NPY_HEADER_MAX = 64 * 1024
_DTYPES = {d.name: d for d in dt.ALL_DTYPES}
# ml_dtypes types (bfloat16, float8) have no .npy descriptor: stored as raw bits
_RAW_BITS = {d.name for d in dt.ALL_DTYPES if d.np_dtype.type.__module__.split(".")[0] == "ml_dtypes"}
# what reading a damaged zip or .npy header can raise, besides our own errors
_READ_FAILURES = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, zlib.error,
                  ValueError, TypeError, RuntimeError, struct.error,
                  OverflowError, IndexError, KeyError)


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds a `.kir` must stay within to be loaded (defaults suit large models).

    >>> load_graph("m.kir", limits=ArchiveLimits(max_total_bytes=1 << 30))
    """

    max_file_bytes: int = 8 << 30  # the .kir file itself
    max_entries: int = 100_000
    max_entry_bytes: int = 4 << 30  # one entry, uncompressed
    max_total_bytes: int = 8 << 30  # all entries together, uncompressed
    max_manifest_bytes: int = 16 << 20
    max_graph_bytes: int = MAX_TEXT
    max_rank: int = 64


@dataclass(frozen=True)
class Archive:
    """A loaded `.kir`: the graph, the user's metadata and the versions that wrote it."""

    graph: Graph
    metadata: dict[str, Any]
    format_version: int
    opset_version: int
    kiln_version: str


def storage_dtype(kdt: dt.DType) -> np.dtype:
    """The little-endian numpy dtype a constant of `kdt` is stored as in its `.npy`.

    >>> storage_dtype(dt.bfloat16)   # dtype('uint16'): the raw bits
    """
    if kdt.name in _RAW_BITS:
        return np.dtype(f"<u{kdt.itemsize}")
    return kdt.np_dtype.newbyteorder("<")


# -- saving ------------------------------------------------------------------------


def save_graph(graph: Graph, path_or_file, metadata: dict[str, Any] | None = None) -> None:
    """Write `graph` (verified first) and JSON `metadata` as a `.kir` archive.

    A path is written atomically (a temporary file in the same directory, then
    `os.replace`); a binary file object is written in place.

    >>> save_graph(graph, "mlp.kir", metadata={"producer": "train.py"})
    """
    verify(graph)
    meta = _check_metadata(metadata)
    text = print_graph(graph)
    arrays, constants = [], {}
    for i, name in enumerate(sorted(graph.constants)):
        if not isinstance(name, str):
            raise KilnArgumentError(f"save_graph: constant names must be strings, got {name!r}")
        array = np.asarray(graph.constants[name])
        kdt = dt.from_numpy(array.dtype)
        # reshape: ascontiguousarray turns a 0-d array into a 1-d one
        array = np.ascontiguousarray(array, dtype=kdt.np_dtype).reshape(array.shape)
        stored = array.view(storage_dtype(kdt)) if kdt.name in _RAW_BITS else \
            array.astype(storage_dtype(kdt), copy=False)
        entry = f"constants/{i}.npy"
        constants[name] = {"file": entry, "dtype": kdt.name, "shape": list(array.shape)}
        arrays.append((entry, stored))
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kiln_version": __version__,
        "opset_version": OPSET_VERSION, "graph": GRAPH_ENTRY, "constants": constants,
        "metadata": meta,
    }
    manifest_bytes = json.dumps(manifest, indent=2, allow_nan=False).encode() + b"\n"
    if isinstance(path_or_file, (str, os.PathLike)):
        _save_atomically(os.fspath(path_or_file), manifest_bytes, text, arrays)
    else:
        _write_zip(path_or_file, manifest_bytes, text, arrays)


def _check_metadata(metadata) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise KilnArgumentError(f"save_graph: metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise KilnArgumentError(f"save_graph: metadata must be JSON (str keys, no NaN): {exc}",
                                hint="convert arrays and objects to lists, numbers and strings") from None


def _entry(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def _write_zip(fileobj: BinaryIO, manifest: bytes, text: str, arrays) -> None:
    with zipfile.ZipFile(fileobj, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(_entry(MANIFEST), manifest)
        zf.writestr(_entry(GRAPH_ENTRY), text.encode("utf-8"))
        for name, array in arrays:
            # np.save streams into the entry: no second copy of a large constant
            with zf.open(_entry(name), "w", force_zip64=array.nbytes > (1 << 30)) as f:
                np.save(f, array, allow_pickle=False)


def _save_atomically(path: str, manifest: bytes, text: str, arrays) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o644
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_zip(f, manifest, text, arrays)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- loading -----------------------------------------------------------------------


def load_graph(path_or_file, *, limits: ArchiveLimits | None = None) -> tuple[Graph, dict[str, Any]]:
    """Read a `.kir` archive: `(graph, metadata)`. A bad file raises `KilnFormatError`.

    >>> graph, meta = load_graph("mlp.kir")
    """
    archive = read_archive(path_or_file, limits=limits)
    return archive.graph, archive.metadata


def read_archive(path_or_file, *, limits: ArchiveLimits | None = None) -> Archive:
    """Read a `.kir` archive with its versions (what `kiln dump` shows).

    >>> read_archive("mlp.kir").format_version   # 1
    """
    return _Reader(_label(path_or_file), limits or ArchiveLimits()).read(path_or_file)


def _label(path_or_file) -> str:
    if isinstance(path_or_file, (str, os.PathLike)):
        return os.fspath(path_or_file)
    name = getattr(path_or_file, "name", None)
    return name if isinstance(name, str) else "<stream>"


def _one_line(text: str, limit: int = 400) -> str:
    """Control characters escaped, so a hostile name cannot break or forge a message line."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return text if len(text) <= limit else text[:limit] + "..."


class _Reader:
    def __init__(self, label: str, limits: ArchiveLimits):
        self.label = label
        self.limits = limits
        self.entries: dict[str, zipfile.ZipInfo] = {}
        self.total = 0

    def fail(self, problem: str) -> KilnFormatError:
        return KilnFormatError(f"{_one_line(self.label, 200)}: {_one_line(problem)}")

    def read(self, path_or_file) -> Archive:
        if not isinstance(path_or_file, (str, os.PathLike)):
            if not all(hasattr(path_or_file, a) for a in ("read", "seek", "tell")):
                raise KilnArgumentError("load_graph: expected a path or a seekable binary file, "
                                        f"got {type(path_or_file).__name__}")
            return self._read_zip(path_or_file)
        path = os.fspath(path_or_file)
        if "\0" not in path and os.path.isdir(path):
            raise self.fail("is a directory, not a .kir file")
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise self.fail("no such file") from None
        except OSError as exc:
            raise self.fail(f"cannot read the file: {exc.strerror or exc}") from None
        except ValueError:  # a path with a NUL byte
            raise self.fail("not a valid file name") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > self.limits.max_file_bytes:
                raise self.fail(f"file of {size} bytes exceeds the {self.limits.max_file_bytes}"
                                "-byte limit")
            return self._read_zip(f)

    def _read_zip(self, f: BinaryIO) -> Archive:
        try:
            with zipfile.ZipFile(f) as zf:
                self._check_entries(zf)
                return self._read_contents(zf)
        except KilnError:
            raise
        except RecursionError:
            raise self.fail("structure nested too deeply") from None
        except _READ_FAILURES as exc:
            raise self.fail(_describe(exc)) from None

    def _check_entries(self, zf: zipfile.ZipFile) -> None:
        infos = zf.infolist()
        if len(infos) > self.limits.max_entries:
            raise self.fail(f"{len(infos)} entries exceed the limit of {self.limits.max_entries}")
        declared = 0
        for info in infos:
            name = info.filename
            if not _SAFE_NAME.fullmatch(name) or any(p in (".", "..") for p in name.split("/")):
                raise self.fail(f"unsafe entry name {name!r} (absolute, '..' or odd characters)")
            if name in self.entries:
                raise self.fail(f"entry {name!r} appears twice")
            if info.flag_bits & 0x1:
                raise self.fail(f"entry {name!r} is encrypted")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise self.fail(f"entry {name!r} uses compression method {info.compress_type}; "
                                ".kir files use deflate")
            if info.file_size > self.limits.max_entry_bytes:
                raise self.fail(f"entry {name!r} declares {info.file_size} bytes, over the "
                                f"{self.limits.max_entry_bytes}-byte limit")
            declared += info.file_size
            self.entries[name] = info
        if declared > self.limits.max_total_bytes:
            raise self.fail(f"entries declare {declared} bytes in all, over the "
                            f"{self.limits.max_total_bytes}-byte limit")

    def _read_entry(self, zf: zipfile.ZipFile, name: str, limit: int) -> bytearray:
        """The entry's bytes, read in bounded chunks: its header may lie about its size."""
        info = self.entries.get(name)
        if info is None:
            raise self.fail(f"missing entry {name!r}")
        limit = min(limit, self.limits.max_entry_bytes)
        if info.file_size > limit:
            raise self.fail(f"entry {name!r} declares {info.file_size} bytes, over its "
                            f"{limit}-byte limit")
        out = bytearray()
        with zf.open(info) as f:
            while True:
                chunk = f.read(min(_CHUNK, limit + 1 - len(out)))
                if not chunk:
                    break
                out += chunk
                if len(out) > limit:
                    raise self.fail(f"entry {name!r} inflates past its {limit}-byte limit")
        self.total += len(out)
        if self.total > self.limits.max_total_bytes:
            raise self.fail(f"entries inflate past the {self.limits.max_total_bytes}-byte total limit")
        return out

    def _read_contents(self, zf: zipfile.ZipFile) -> Archive:
        manifest = self._manifest(zf)
        format_version, opset_version, kiln_version = self._versions(manifest)
        graph_entry = _field(self, manifest, "graph", str)
        constants_spec = _field(self, manifest, "constants", dict)
        metadata = _field(self, manifest, "metadata", dict)
        constants = {}
        files = set()
        for name, spec in constants_spec.items():
            constants[name] = self._constant(zf, name, spec, files)
        raw = self._read_entry(zf, graph_entry, self.limits.max_graph_bytes)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{graph_entry} is not UTF-8 text") from None
        try:
            graph = parse_graph(text, constants=constants)
        except KilnError as exc:  # KilnParseError or KilnVerifierError: keep their message
            raise self.fail(f"{graph_entry}: {exc.message}") from None
        return Archive(graph, metadata, format_version, opset_version, kiln_version)

    def _manifest(self, zf: zipfile.ZipFile) -> dict:
        raw = self._read_entry(zf, MANIFEST, self.limits.max_manifest_bytes)
        try:
            manifest = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                                  parse_constant=_no_nan)
        except RecursionError:
            raise self.fail(f"{MANIFEST} is nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, our hooks
            raise self.fail(f"{MANIFEST} is not valid JSON: {exc}") from None
        if not isinstance(manifest, dict):
            raise self.fail(f"{MANIFEST} must hold a JSON object, not {_json_kind(manifest)}")
        if manifest.get("format") != FORMAT:
            raise self.fail(f"not a kiln archive: {MANIFEST} names format "
                            f"{_short(manifest.get('format'))}, expected {FORMAT!r}")
        return manifest

    def _versions(self, manifest: dict) -> tuple[int, int, str]:
        format_version = _field(self, manifest, "format_version", int)
        kiln_version = manifest.get("kiln_version")
        by = f" (kiln {_short(kiln_version, quote=False)})" if isinstance(kiln_version, str) else ""
        if format_version > FORMAT_VERSION:
            raise KilnFormatVersionError(
                f"{_one_line(self.label, 200)}: written by format version {_short(format_version)}"
                f"{_one_line(by)}; this kiln ({__version__}) reads up to format version "
                f"{FORMAT_VERSION}: upgrade kiln")
        opset_version = _field(self, manifest, "opset_version", int)
        if opset_version > OPSET_VERSION:
            raise KilnFormatVersionError(
                f"{_one_line(self.label, 200)}: uses opset version {_short(opset_version)}"
                f"{_one_line(by)}; this kiln ({__version__}) knows up to opset version "
                f"{OPSET_VERSION}: upgrade kiln")
        if format_version < 1 or opset_version < 1:
            raise self.fail("format_version and opset_version must be at least 1")
        return format_version, opset_version, _field(self, manifest, "kiln_version", str)

    def _constant(self, zf: zipfile.ZipFile, name: str, spec, files: set[str]) -> np.ndarray:
        where = f"constant {_short(name)}"
        if not isinstance(spec, dict):
            raise self.fail(f"{where}: expected a JSON object, got {_json_kind(spec)}")
        entry = _field(self, spec, "file", str, where)
        dtype_name = _field(self, spec, "dtype", str, where)
        shape = _field(self, spec, "shape", list, where)
        if entry in files:
            raise self.fail(f"{where}: file {_short(entry)} is used by two constants")
        files.add(entry)
        kdt = _DTYPES.get(dtype_name)
        if kdt is None:
            raise self.fail(f"{where}: unknown dtype {_short(dtype_name)}")
        if len(shape) > self.limits.max_rank or \
                not all(type(d) is int and d >= 0 for d in shape):
            raise self.fail(f"{where}: shape must be a list of at most {self.limits.max_rank} "
                            "non-negative integers")
        storage = storage_dtype(kdt)
        numel = math.prod(shape)
        nbytes = numel * storage.itemsize
        if nbytes > self.limits.max_entry_bytes:
            raise self.fail(f"{where}: {dtype_name}{shape} needs {nbytes} bytes, over the "
                            f"{self.limits.max_entry_bytes}-byte limit")
        data = self._read_entry(zf, entry, nbytes + _NPY_HEADER_MAX)
        array = self._npy(data, f"{where} ({entry})", storage, tuple(shape), nbytes)
        if kdt.name in _RAW_BITS:
            return array.view(kdt.np_dtype)
        if kdt.is_bool and numel and array.view(np.uint8).max() > 1:
            raise self.fail(f"{where}: bool data holds bytes other than 0 and 1")
        return array

    def _npy(self, data: bytearray, where: str, storage: np.dtype, shape: tuple, nbytes: int):
        """Parse a .npy header with numpy's own reader (literal_eval, never pickle)."""
        fmt = np.lib.format
        fp = io.BytesIO(bytes(data[:_NPY_HEADER_MAX]))
        try:
            version = fmt.read_magic(fp)
            if version == (1, 0):
                header = fmt.read_array_header_1_0(fp, max_header_size=_NPY_HEADER_MAX)
            elif version == (2, 0):
                header = fmt.read_array_header_2_0(fp, max_header_size=_NPY_HEADER_MAX)
            else:
                raise self.fail(f"{where}: unsupported .npy version {version}")
        except KilnError:
            raise
        except Exception as exc:  # noqa: BLE001  numpy's header reader (literal_eval, tokenize)
            # fails in many ways on hostile bytes; whatever it raises, the header is bad
            raise self.fail(f"{where}: not a valid .npy file ({_describe(exc)})") from None
        header_shape, fortran, header_dtype = header
        if header_dtype.hasobject:
            raise self.fail(f"{where}: object dtype refused (kiln never unpickles)")
        if header_dtype.fields is not None or header_dtype.subdtype is not None:
            raise self.fail(f"{where}: structured dtype {header_dtype} refused")
        if header_dtype != storage:
            raise self.fail(f"{where}: .npy holds {header_dtype.str}, the manifest says "
                            f"{storage.str}")
        if tuple(header_shape) != shape:
            raise self.fail(f"{where}: .npy shape {tuple(header_shape)} differs from the "
                            f"manifest's {list(shape)}")
        offset = fp.tell()
        if len(data) - offset != nbytes:
            raise self.fail(f"{where}: holds {len(data) - offset} bytes of data, expected {nbytes}")
        array = np.frombuffer(data, dtype=storage, count=nbytes // max(storage.itemsize, 1),
                              offset=offset)
        array = array.reshape(shape, order="F" if fortran else "C")
        # native byte order and C layout: what in-memory graphs hold
        return np.ascontiguousarray(array, dtype=storage.newbyteorder("=")).reshape(array.shape)


def _field(reader: _Reader, obj: dict, key: str, kind: type, where: str = MANIFEST):
    if key not in obj:
        raise reader.fail(f"{where}: missing field {key!r}")
    value = obj[key]
    if kind is int:
        ok = type(value) is int
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise reader.fail(f"{where}: field {key!r} must be {_json_name(kind)}, "
                          f"not {_json_kind(value)}")
    return value


def _json_name(kind: type) -> str:
    return {int: "an integer", str: "a string", dict: "an object", list: "a list"}[kind]


def _json_kind(value) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


def _short(value, quote: bool = True) -> str:
    text = repr(value) if quote or not isinstance(value, str) else value
    if isinstance(value, int) and abs(value).bit_length() > 64:
        return "a number too large to show"
    return text if len(text) <= 60 else text[:60] + "..."


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, zipfile.BadZipFile):
        return f"not a valid zip archive ({text})"
    if isinstance(exc, (EOFError, zlib.error)):
        return f"truncated or corrupt data ({text})"
    return f"corrupt archive ({type(exc).__name__}: {text})"


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_nan(token: str):
    raise ValueError(f"{token} is not JSON")
