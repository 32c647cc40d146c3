"""The .kir archive: exact round trips, version refusal, and hostile files that may
only ever fail with KilnFormatError (a seeded fuzz of ~300 mutated archives)."""

from __future__ import annotations

import io
import json
import os
import random
import struct
import warnings
import zipfile

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.errors import (KilnArgumentError, KilnFormatError, KilnFormatVersionError, KilnParseError,
                         KilnVerifierError)
from kiln.ir import dtypes as dt
from kiln.ir.archive import (FORMAT_VERSION, OPSET_VERSION, ArchiveLimits, load_graph, read_archive,
                             save_graph)
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Region, Value
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.ir.shapes import ShapeVar
from kiln.ir.types import TensorType


def demo_graph() -> Graph:
    """Symbolic shapes, a constant, a cond and a while_loop whose body nests a cond."""
    b = GraphBuilder()
    b.graph.name = "demo"
    B = ShapeVar("B", min=1, max=8192, multiple_of=2)
    b.graph.shape_vars["B"] = B
    x = b.add_input(TensorType(dt.float32, (B.symbol, 4)), "x")
    w = b.add_input(TensorType(dt.float32, (4,)), "w")
    z = b.binary("add", b.binary("mul", x, w), 1.5)
    r = b.call("reshape", z, shape=(B.symbol * 2, 2))
    q = b.binary("add", w, b.constant(np.arange(4, dtype=np.float32)))
    pred = b.call("gt", b.call("reduce_sum", q, axes=(0,)), b.full(0.0, dt.float32))
    (branch,) = b.apply("cond", [pred, q], {}, regions=[_negate_region(b, q.type), _identity(q.type)])
    i32 = TensorType(dt.int32, ())
    loop_cond = Region([Value(i32), Value(q.type)])
    inner = GraphBuilder(b.graph)
    inner.regions.append(loop_cond)
    loop_cond.results = [inner.call("lt", loop_cond.params[0], inner.full(3, dt.int32))]
    body = Region([Value(i32), Value(q.type)])
    inner.regions[-1] = body
    flag = inner.call("gt", body.params[0], inner.full(1, dt.int32))
    (nested,) = inner.apply("cond", [flag, body.params[1]], {},
                            regions=[_negate_region(inner, q.type), _identity(q.type)])
    body.results = [inner.call("add", body.params[0], inner.full(1, dt.int32)),
                    inner.call("add", nested, w)]  # `w` comes from the enclosing graph
    _, looped = b.apply("while_loop", [b.full(0, dt.int32), branch], {}, regions=[loop_cond, body])
    sliced = b.call("slice", r, start=(0, 0), limit=(B.symbol, 2), stride=(2, 1))
    b.graph.body.results = [r, looped, sliced]
    return b.graph


def _negate_region(builder: GraphBuilder, t: TensorType) -> Region:
    region = Region([Value(t)])
    builder.regions.append(region)
    region.results = [builder.call("neg", region.params[0])]
    builder.regions.pop()
    return region


def _identity(t: TensorType) -> Region:
    region = Region([Value(t)])
    region.results = [region.params[0]]
    return region


def special_values(kdt: dt.DType) -> np.ndarray:
    """Every bit pattern of the 8/16-bit floats; NaN payloads, -0.0, subnormals for the rest."""
    if kdt.is_bool:
        return np.array([True, False, True], dtype=np.bool_)
    if kdt.is_integer:
        info = np.iinfo(kdt.np_dtype)
        return np.array([info.min, -1 if info.min else 0, 0, 1, info.max], dtype=kdt.np_dtype)
    if kdt.bits in (8, 16):
        return np.arange(1 << kdt.bits, dtype=f"u{kdt.itemsize}").view(kdt.np_dtype)
    if kdt.is_complex:
        return special_values(dt.float32).view(np.complex64)
    bits = {32: [0x7FC00001, 0xFFBFFFFF, 0x7F800001, 0x80000000, 0x00000001, 0x807FFFFF,
                 0x7F800000, 0xFF800000, 0x3F800000, 0x7F7FFFFF],
            64: [0x7FF8000000000001, 0xFFF0000000000001, 0x8000000000000000, 1,
                 0x800FFFFFFFFFFFFF, 0x7FF0000000000000, 0x3FF0000000000000, 0x7FEFFFFFFFFFFFFF]}
    return np.array(bits[kdt.bits], dtype=f"u{kdt.itemsize}").view(kdt.np_dtype)


def all_dtypes_graph() -> Graph:
    b = GraphBuilder()
    b.graph.name = "every_dtype"
    outputs = []
    for kdt in dt.ALL_DTYPES:
        values = special_values(kdt)
        outputs.append(b.constant(values.reshape(-1, values.size // 2) if values.size % 2 == 0
                                  else values))
    b.graph.body.results = outputs
    return b.graph


def saved_bytes(graph: Graph, metadata=None) -> bytes:
    buf = io.BytesIO()
    save_graph(graph, buf, metadata)
    return buf.getvalue()


def entries_of(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


def make_zip(entries, compression=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are what some tests want
        with zipfile.ZipFile(buf, "w", compression=compression) as zf:
            for name, data in entries:
                info = zipfile.ZipInfo(name)
                info.compress_type = compression
                zf.writestr(info, data)
    return buf.getvalue()


def with_manifest(data: bytes, edit) -> bytes:
    out = []
    for name, content in entries_of(data):
        if name == "manifest.json":
            manifest = json.loads(content)
            edit(manifest)
            content = json.dumps(manifest).encode()
        out.append((name, content))
    return make_zip(out)


def load_bytes(data: bytes, **kwargs):
    return load_graph(io.BytesIO(data), **kwargs)


# -- round trips -------------------------------------------------------------------


def test_round_trip_symbolic_shapes_and_regions(tmp_path):
    graph = demo_graph()
    path = tmp_path / "demo.kir"
    save_graph(graph, path, metadata={"producer": "test", "nested": {"k": [1, 2.5, None]},
                                      "unicode": "größe"})
    loaded, metadata = load_graph(path)
    assert str(loaded) == str(graph)
    assert loaded.structurally_equal(graph)
    assert metadata == {"producer": "test", "nested": {"k": [1, 2.5, None]}, "unicode": "größe"}
    assert set(loaded.shape_vars) == {"B"} and loaded.shape_vars["B"].multiple_of == 2
    x, w = np.ones((4, 4), np.float32), np.arange(4, dtype=np.float32)
    for a, b in zip(run_graph(graph, x, w), run_graph(loaded, x, w)):
        np.testing.assert_array_equal(a, b)


def test_every_dtype_is_bit_exact(tmp_path):
    graph = all_dtypes_graph()
    path = tmp_path / "dtypes.kir"
    save_graph(graph, str(path))
    loaded, _ = load_graph(str(path))
    assert loaded.structurally_equal(graph)
    for name, original in graph.constants.items():
        got = loaded.constants[name]
        assert got.dtype == original.dtype and got.shape == original.shape
        assert got.tobytes() == original.tobytes(), name
        assert got.flags.c_contiguous and got.flags.writeable
    stored = dict(entries_of(path.read_bytes()))
    manifest = json.loads(stored["manifest.json"])
    kinds = {spec["dtype"] for spec in manifest["constants"].values()}
    assert kinds == {d.name for d in dt.ALL_DTYPES}
    bf16 = next(s for s in manifest["constants"].values() if s["dtype"] == "bfloat16")
    header = np.lib.format.read_array_header_1_0(
        _npy_stream(stored[bf16["file"]]))  # the raw bits, in a dtype numpy can describe
    assert header[2] == np.dtype("<u2")


def _npy_stream(data: bytes) -> io.BytesIO:
    fp = io.BytesIO(data)
    np.lib.format.read_magic(fp)
    return fp


def test_bfloat16_nan_payloads_survive():
    b = GraphBuilder()
    bits = np.array([0x7FC1, 0xFF81, 0x8000, 0x0001, 0x7F80], dtype=np.uint16)
    b.graph.body.results = [b.constant(bits.view(ml_dtypes.bfloat16))]
    loaded, _ = load_bytes(saved_bytes(b.graph))
    assert loaded.constants["c0"].view(np.uint16).tolist() == bits.tolist()


def test_fortran_order_and_non_contiguous_constants_round_trip():
    b = GraphBuilder()
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    b.graph.constants["f"] = np.asfortranarray(base)
    b.graph.constants["s"] = base[:, ::2]
    loaded, _ = load_bytes(saved_bytes(b.graph))
    np.testing.assert_array_equal(loaded.constants["f"], base)
    np.testing.assert_array_equal(loaded.constants["s"], base[:, ::2])


def test_saving_is_deterministic_and_atomic(tmp_path, monkeypatch):
    graph = demo_graph()
    assert saved_bytes(graph) == saved_bytes(graph)
    path = tmp_path / "m.kir"
    save_graph(graph, path)
    before = path.read_bytes()

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_graph(graph, path)
    assert path.read_bytes() == before  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["m.kir"]  # and no temporary file is left


def test_save_rejects_bad_metadata_and_bad_graphs(tmp_path):
    with pytest.raises(KilnArgumentError, match="metadata"):
        save_graph(demo_graph(), tmp_path / "a.kir", metadata={"x": object()})
    with pytest.raises(KilnArgumentError, match="metadata"):
        save_graph(demo_graph(), tmp_path / "a.kir", metadata={"x": float("nan")})
    graph = demo_graph()
    graph.constants.clear()  # the constant node now has no data
    with pytest.raises(KilnVerifierError):
        save_graph(graph, tmp_path / "a.kir")
    assert not os.listdir(tmp_path)


def test_read_archive_reports_versions():
    archive = read_archive(io.BytesIO(saved_bytes(demo_graph(), {"a": 1})))
    assert (archive.format_version, archive.opset_version) == (FORMAT_VERSION, OPSET_VERSION)
    assert archive.kiln_version == kiln.__version__ and archive.metadata == {"a": 1}


# -- versions ------------------------------------------------------------------------


def test_newer_format_version_is_refused_naming_both_versions():
    data = with_manifest(saved_bytes(demo_graph()), lambda m: m.update(format_version=3,
                                                                       kiln_version="9.0.0"))
    with pytest.raises(KilnFormatVersionError) as info:
        load_bytes(data)
    message = info.value.message
    assert "format version 3" in message and f"up to format version {FORMAT_VERSION}" in message
    assert kiln.__version__ in message and "9.0.0" in message and "upgrade kiln" in message
    assert isinstance(info.value, KilnFormatError)


def test_newer_opset_is_refused():
    data = with_manifest(saved_bytes(demo_graph()), lambda m: m.update(opset_version=7))
    with pytest.raises(KilnFormatVersionError, match=r"opset version 7.*up to opset version 1"):
        load_bytes(data)


# -- specific hostile files ------------------------------------------------------------


def _npy(array, allow_pickle=False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def _replace_entry(data: bytes, target: str, content: bytes) -> bytes:
    return make_zip([(n, content if n == target else c) for n, c in entries_of(data)])


@pytest.mark.parametrize("payload, match", [
    (_npy(np.array([{"evil": 1}, None, 3, 4], dtype=object), allow_pickle=True), "object dtype"),
    (_npy(np.zeros(4, dtype=[("a", "<f4")])), "structured dtype"),
    (_npy(np.zeros(4, dtype=">f4")), "manifest says <f4"),
    (_npy(np.zeros(4, dtype=np.float64)), "manifest says <f4"),
    (_npy(np.zeros(5, dtype=np.float32)), "shape"),
    (_npy(np.zeros(4, dtype=np.float32))[:-3], "bytes of data"),
    (_npy(np.zeros(4, dtype=np.float32)) + b"extra", "bytes of data"),
    (b"\x93NUMPY\x09\x00" + b"x" * 100, ".npy version"),
    (b"not an npy file at all", "not a valid .npy"),
])
def test_hostile_npy_is_refused(payload, match):
    data = _replace_entry(saved_bytes(demo_graph()), "constants/0.npy", payload)
    with pytest.raises(KilnFormatError, match=match):
        load_bytes(data)


def test_bool_constant_with_non_canonical_bytes_is_refused():
    b = GraphBuilder()
    b.graph.body.results = [b.constant(np.array([True, False]))]
    data = _replace_entry(saved_bytes(b.graph), "constants/0.npy",
                          _npy(np.array([1, 7], np.uint8)).replace(b"|u1", b"|b1"))
    with pytest.raises(KilnFormatError, match="bool data"):
        load_bytes(data)


@pytest.mark.parametrize("name", ["../evil", "/etc/passwd", "a/../../b", "C:\\evil", "dir/./x"])
def test_unsafe_entry_names_are_refused(name):
    data = make_zip(entries_of(saved_bytes(demo_graph())) + [(name, b"x")])
    with pytest.raises(KilnFormatError, match="unsafe entry name"):
        load_bytes(data)


def _central_size_patched(data: bytes, entry: str, size: int) -> bytes:
    """Make the central directory lie about `entry`'s uncompressed size."""
    buf = bytearray(data)
    pos = buf.find(b"PK\x01\x02")
    while pos != -1:
        name_len = struct.unpack_from("<H", buf, pos + 28)[0]
        if bytes(buf[pos + 46:pos + 46 + name_len]) == entry.encode():
            struct.pack_into("<I", buf, pos + 24, size)
        pos = buf.find(b"PK\x01\x02", pos + 4)
    return bytes(buf)


def test_zip_bomb_is_refused_whether_its_header_is_honest_or_not():
    graph_text = str(demo_graph()) + "#" * (8 << 20) + "\n"  # 8 MiB that deflates to ~8 KiB
    entries = [(n, graph_text.encode() if n == "graph.txt" else c)
               for n, c in entries_of(saved_bytes(demo_graph()))]
    bomb = make_zip(entries)
    assert len(bomb) < 64 * 1024
    limits = ArchiveLimits(max_graph_bytes=1 << 20)
    with pytest.raises(KilnFormatError, match="graph.txt.*declares"):
        load_bytes(bomb, limits=limits)
    liar = _central_size_patched(bomb, "graph.txt", 1000)
    with pytest.raises(KilnFormatError):
        load_bytes(liar, limits=limits)
    huge = _central_size_patched(bomb, "graph.txt", 0xFFFFFFF0)  # default limits apply
    with pytest.raises(KilnFormatError, match="declares"):
        load_bytes(huge)
    with pytest.raises(KilnFormatError, match="limit"):
        load_bytes(saved_bytes(demo_graph()), limits=ArchiveLimits(max_total_bytes=100))
    with pytest.raises(KilnFormatError, match="entries exceed"):
        load_bytes(saved_bytes(demo_graph()), limits=ArchiveLimits(max_entries=2))


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format="zip"), "not a kiln archive"),
    (lambda m: m.update(format_version="1"), "must be an integer"),
    (lambda m: m.update(format_version=True), "must be an integer"),
    (lambda m: m.update(constants=[]), "'constants' must be an object"),
    (lambda m: m.update(metadata=[1]), "'metadata' must be an object"),
    (lambda m: m.pop("graph"), "missing field 'graph'"),
    (lambda m: m.update(graph="nope.txt"), "missing entry"),
    (lambda m: m["constants"]["c0"].update(shape=[-4]), "non-negative"),
    (lambda m: m["constants"]["c0"].update(shape=[2, 2]), "shape"),
    (lambda m: m["constants"]["c0"].update(dtype="float128"), "unknown dtype"),
    (lambda m: m["constants"]["c0"].update(shape=[10 ** 30]), "bytes"),
    (lambda m: m["constants"].update(c1=dict(m["constants"]["c0"])), "used by two constants"),
    (lambda m: m["constants"].update(c0=["constants/0.npy"]), "expected a JSON object"),
])
def test_bad_manifest_fields_are_refused(edit, match):
    with pytest.raises(KilnFormatError, match=match):
        load_bytes(with_manifest(saved_bytes(demo_graph()), edit))


@pytest.mark.parametrize("manifest, match", [
    (b"[1, 2]", "JSON object"), (b"{", "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
    (b'{"format": NaN}', "not valid JSON"), (b"[" * 100_000, "nested too deeply|not valid JSON"),
    (b'{"format": "kiln.kir", "format": "kiln.kir"}', "twice"),
])
def test_malformed_manifest_json(manifest, match):
    data = _replace_entry(saved_bytes(demo_graph()), "manifest.json", manifest)
    with pytest.raises(KilnFormatError, match=match):
        load_bytes(data)


def test_not_a_zip_missing_and_empty_files(tmp_path):
    for content, match in [(b"", "not a valid zip"), (b"hello", "not a valid zip"),
                           (make_zip([]), "missing entry 'manifest.json'")]:
        path = tmp_path / "f.kir"
        path.write_bytes(content)
        with pytest.raises(KilnFormatError, match=match) as info:
            load_graph(path)
        assert str(path) in info.value.message and "\n" not in info.value.message
    with pytest.raises(KilnFormatError, match="no such file"):
        load_graph(tmp_path / "missing.kir")
    with pytest.raises(KilnFormatError, match="directory"):
        load_graph(tmp_path)


def test_bad_graph_text_keeps_the_parser_message():
    text = str(demo_graph()).replace("reshape(", "reshapez(")
    data = _replace_entry(saved_bytes(demo_graph()), "graph.txt", text.encode())
    with pytest.raises(KilnFormatError, match=r"graph.txt: line \d+: unknown op 'reshapez'"):
        load_bytes(data)


# -- fuzzing ---------------------------------------------------------------------------

_TOKEN_VOCAB = ["%0", "%x", "(", ")", "[", "]", "{", "}", ",", ":", "=", "->", "**", "-", "B",
                "f32", "i64", "bf16", "region(%99: f32[4]):", "yield", "end", "return", "where",
                "cond", "add", "99999999999999999999999999999", "1e308", "-0.0", "nan", "inf",
                "(" * 80, ")" * 80, "((B+1)**64)**64", "2**64**64", "Max(B, B, B, B, B, B, B, B, B)",
                "Mod(B, 0)", "floor(B/0)", "\n", "\n  region():\n", '"\\u0000"', "\x00", "é", "#"]


def mutate_text(text: str, rng: random.Random) -> str:
    """Random token deletions, insertions, swaps and substitutions of IR text."""
    import re

    tokens = re.findall(r'%\w+|@\w+|"[^"\n]*"|\d+\.\d*|\d+|\w+|->|\*\*|\s+|.', text)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(tokens))
        roll = rng.random()
        if roll < 0.3 and len(tokens) > 1:
            del tokens[i]
        elif roll < 0.6:
            tokens.insert(i, rng.choice(_TOKEN_VOCAB))
        elif roll < 0.8:
            j = rng.randrange(len(tokens))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            tokens[i] = rng.choice(_TOKEN_VOCAB)
    return "".join(tokens)


def _wrong_json(rng: random.Random):
    return rng.choice([None, True, 0, -1, 1.5, "x", "", [], {}, [1, 2], {"a": 1}, 10 ** 40,
                       [[[]]], {"file": 1}, "constants/0.npy", "../evil", "9" * 100])


def _mutate_manifest(data: bytes, rng: random.Random) -> bytes:
    def edit(manifest):
        targets = [manifest] + [s for s in manifest["constants"].values() if isinstance(s, dict)]
        target = rng.choice(targets)
        key = rng.choice(sorted(target) + ["extra"])
        if rng.random() < 0.2:
            target.pop(key, None)
        else:
            target[key] = _wrong_json(rng)
    return with_manifest(data, edit)


def _mutate_archive(base: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["flip", "truncate", "garbage", "duplicate", "manifest", "graph",
                       "npy", "rename"])
    data = bytearray(base)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return kind, bytes(data)
    if kind == "truncate":
        return kind, bytes(data[:rng.randrange(len(data))])
    if kind == "garbage":
        at = rng.randrange(len(data))
        return kind, bytes(data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:])
    entries = entries_of(base)
    if kind == "duplicate":
        entries.insert(rng.randrange(len(entries) + 1), rng.choice(entries))
        return kind, make_zip(entries)
    if kind == "manifest":
        return kind, _mutate_manifest(base, rng)
    if kind == "graph":
        return kind, make_zip([(n, mutate_text(c.decode(), rng).encode("utf-8", "replace")
                                if n == "graph.txt" else c) for n, c in entries])
    if kind == "npy":
        index = rng.randrange(len(entries))
        name, content = entries[index]
        blob = bytearray(content)
        for _ in range(rng.randint(1, 4)):  # the header sits in the first 128 bytes
            blob[rng.randrange(min(len(blob), 128))] = rng.randrange(256)
        entries[index] = (name, bytes(blob))
        return kind, make_zip(entries)
    name = rng.choice(["../evil", "/abs", "a\\b", "x/../../y", "ok/../manifest.json", "\x01"])
    entries.append((name, b"payload"))
    return kind, make_zip(entries)


def test_fuzzed_archives_only_raise_kiln_format_error():
    rng = random.Random(20240601)
    bases = [saved_bytes(demo_graph(), {"k": "v"}), saved_bytes(all_dtypes_graph())]
    limits = ArchiveLimits(max_entry_bytes=4 << 20, max_total_bytes=16 << 20)
    outcomes = {"refused": 0, "loaded": 0}
    for case in range(300):
        kind, data = _mutate_archive(bases[case % 2], rng)
        try:
            load_bytes(data, limits=limits)
            outcomes["loaded"] += 1
        except KilnFormatError as exc:
            assert "\n" not in exc.message and exc.message.startswith("<stream>: ")
            outcomes["refused"] += 1
        except Exception as exc:  # anything else is a bug in the loader
            raise AssertionError(f"case {case} ({kind}) raised {type(exc).__name__}: {exc}") from exc
    assert outcomes["refused"] > 200


_PARSE_ATTRS = ["0", "-1", "99999999999999999999", "()", "(1,)", "(-1,)", "(0, 0)", '"x"', "f32",
                "none", "true", "nan", "-inf", "1.5", "(B,)", "(B**2, 4)", "((),)", "(f32,)"]
_PARSE_DIMS = ["0", "1", "4", "B", "2*B", "-1", "99999999999999999999", "B**2", "B - 5",
               "floor(B/3)", "Mod(B, 3)", "Max(B, 4)", "0*B", "(B+1)**64"]


def _mutate_semantics(text: str, rng: random.Random) -> str:
    """Well-tokenized but wrong: attributes, dims and ops replaced by others."""
    import re

    from kiln.ir import registry

    roll = rng.random()
    if roll < 0.4:
        spots = list(re.finditer(r"(\w+)=((?:\([^{}]*?\))|\"[^\"]*\"|[^,}]+)", text))
        m = rng.choice(spots)
        return text[:m.start(2)] + rng.choice(_PARSE_ATTRS) + text[m.end(2):]
    if roll < 0.7:
        m = rng.choice(list(re.finditer(r"\[([^\]]*)\]", text)))
        dims = ", ".join(rng.choice(_PARSE_DIMS) for _ in range(rng.randint(0, 3)))
        return text[:m.start(1)] + dims + text[m.end(1):]
    m = rng.choice(list(re.finditer(r"= (\w+)\(", text)))
    return text[:m.start(1)] + rng.choice(sorted(registry.all_ops())) + text[m.end(1):]


def test_fuzzed_ir_text_only_raises_parse_or_verifier_errors():
    graph = demo_graph()
    text = str(graph)
    rng = random.Random(7)
    for case in range(400):
        mutated = mutate_text(text, rng) if case % 2 else _mutate_semantics(text, rng)
        try:
            parse_graph(mutated, constants=graph.constants)
        except (KilnParseError, KilnVerifierError):
            pass
        except Exception as exc:
            raise AssertionError(f"case {case} raised {type(exc).__name__}: {exc}\n{mutated}") from exc


@pytest.mark.parametrize("dims", ["((B+1)**64)**64", "(((2**64)**64)**64)**64", "B**64**64",
                                  "(B**8)**9", "9" * 200, "-4", "Max(" + ", ".join(["B"] * 20) + ")",
                                  "(" * 200 + "B" + ")" * 200, "- " * 5000 + "B"])
def test_hostile_sizes_are_parse_errors(dims):
    text = f"graph @g(%x: f32[{dims}]) -> f32[{dims}]\n  where B in [1, 8]\n  return %x\n"
    with pytest.raises(KilnParseError):
        parse_graph(text)
