"""safetensors: round trips against numpy, files written by the `safetensors` package's
torch API read back, and hostile files refused with K340 naming the rule broken."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnSafetensorsError, KilnStateDictError
from kiln.io.safetensors_io import read_header, read_metadata


def _sd():
    rng = np.random.default_rng(0)
    return {
        "w": kn.tensor(rng.standard_normal((3, 4)).astype(np.float32)),
        "b16": kn.tensor(rng.standard_normal(5).astype(ml_dtypes.bfloat16)),
        "f8": kn.tensor(rng.standard_normal((2, 2)).astype(ml_dtypes.float8_e4m3fn)),
        "f8b": kn.tensor(rng.standard_normal(3).astype(ml_dtypes.float8_e5m2)),
        "half": rng.standard_normal(4).astype(np.float16),
        "i": kn.arange(6).reshape(2, 3),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), np.float32),
        "strided": np.arange(12, dtype=np.int32).reshape(3, 4).T,  # not contiguous
    }


def test_round_trip_every_dtype(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = _sd()
    kn.save_state_dict(sd, path, metadata={"step": "7"})
    back = kn.load_state_dict(path)
    assert set(back) == set(sd)  # the serializer orders tensors by alignment, then name
    for name, value in sd.items():
        want = np.asarray(value)
        got = back[name]
        assert isinstance(got, kn.Tensor)
        assert got.numpy().dtype == want.dtype, name
        assert got.shape == want.shape, name
        # bit for bit: bf16 and fp8 included
        np.testing.assert_array_equal(np.ascontiguousarray(got.numpy()).reshape(-1).view(np.uint8),
                                      np.ascontiguousarray(want).reshape(-1).view(np.uint8))
    assert read_metadata(path) == {"format": "pt", "step": "7"}
    assert back["b16"].dtype == kn.bfloat16 and back["f8"].dtype == kn.float8_e4m3fn


def test_read_by_package_and_by_torch(tmp_path):
    """A kiln-written file read by the package's torch API, bit for bit, and the other way."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    path = tmp_path / "k.safetensors"
    sd = _sd()
    kn.save_state_dict(sd, path)
    t = load_file(str(path))
    assert t["b16"].dtype == torch.bfloat16 and t["f8"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(t["b16"].view(torch.int16).numpy(),
                                  sd["b16"].numpy().view(np.int16))
    np.testing.assert_array_equal(t["strided"].numpy(), sd["strided"])

    g = torch.Generator().manual_seed(1)
    theirs = {"model.embed.weight": torch.randn(10, 4, generator=g).to(torch.bfloat16),
              "model.lm_head.weight": torch.randn(4, 10, generator=g),
              "model.q.weight": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
              "model.q.scale": torch.tensor([0.5]),
              "model.k.weight": torch.randn(3, generator=g).to(torch.float8_e5m2),
              "ids": torch.arange(5, dtype=torch.int64)}
    path2 = tmp_path / "hf.safetensors"
    save_file(theirs, str(path2), metadata={"format": "pt"})
    back = kn.load_state_dict(path2)
    assert set(back) == set(theirs)
    for name, tv in theirs.items():
        want = tv.float().numpy() if tv.dtype != torch.int64 else tv.numpy()
        np.testing.assert_array_equal(back[name].numpy().astype(want.dtype), want, err_msg=name)
    assert back["model.embed.weight"].dtype == kn.bfloat16
    assert back["model.k.weight"].dtype == kn.float8_e5m2


def test_module_state_dict_round_trip(tmp_path):
    model = kn.nn.Sequential(kn.nn.Linear(4, 8), kn.nn.ReLU(), kn.nn.Linear(8, 2))
    path = tmp_path / "mlp.safetensors"
    kn.save_state_dict(model.state_dict(), path)
    other = kn.nn.Sequential(kn.nn.Linear(4, 8), kn.nn.ReLU(), kn.nn.Linear(8, 2))
    other.load_state_dict(kn.load_state_dict(path))
    x = kn.randn(3, 4, seed=2)
    np.testing.assert_array_equal(model(x).numpy(), other(x).numpy())


def test_sharded_checkpoint(tmp_path):
    kn.save_state_dict({"a": np.ones(2, np.float32)}, tmp_path / "model-00001-of-00002.safetensors")
    kn.save_state_dict({"b": np.full(3, 2, np.int32)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}))
    for where in (tmp_path, tmp_path / "model.safetensors.index.json"):
        sd = kn.load_state_dict(where)
        np.testing.assert_array_equal(sd["a"].numpy(), np.ones(2, np.float32))
        np.testing.assert_array_equal(sd["b"].numpy(), np.full(3, 2, np.int32))
    (tmp_path / "evil.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x"}}))
    with pytest.raises(KilnSafetensorsError, match="outside"):
        kn.load_state_dict(tmp_path / "evil.safetensors.index.json")


def test_save_refuses_bad_state_dicts(tmp_path):
    with pytest.raises(KilnStateDictError, match=r"\[K341\].*not a kn.Tensor"):
        kn.save_state_dict({"a": [1, 2]}, tmp_path / "x.safetensors")
    with pytest.raises(KilnStateDictError, match="usable tensor name"):
        kn.save_state_dict({3: np.ones(2)}, tmp_path / "x.safetensors")
    with pytest.raises(KilnStateDictError, match="cannot store"):
        kn.save_state_dict({"a": np.ones(2, np.complex128)}, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())  # nothing half-written


# -- hostile files ----------------------------------------------------------------------------


def _file(tmp_path, header, data=b"", length=None, name="h.safetensors"):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _refused(path, *fragments):
    with pytest.raises(KilnSafetensorsError) as info:
        kn.load_state_dict(path)
    message = str(info.value)
    assert message.startswith("[K340]") and str(path) in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_hostile_headers(tmp_path):
    ok = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    _refused(tmp_path / "missing.safetensors", "cannot read")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    _refused(tmp_path / "tiny.safetensors", "shorter than the 8-byte header length")
    _refused(_file(tmp_path, ok, b"\0" * 8, length=1 << 62), "over the", "limit")
    _refused(_file(tmp_path, ok, b"", length=500), "truncated")
    _refused(_file(tmp_path, b"{not json", b""), "not valid UTF-8 JSON")
    _refused(_file(tmp_path, b"\xff\xfe{}", b""), "not valid UTF-8 JSON")
    _refused(_file(tmp_path, [1, 2]), "not an object")
    _refused(_file(tmp_path, b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, '
                             b'"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}',
                   b"\0" * 4), "appears twice")
    _refused(_file(tmp_path, {"__metadata__": {"x": 1}}), "__metadata__")


def test_hostile_entries(tmp_path):
    def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
        return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}

    _refused(_file(tmp_path, {"a": entry(dtype="Q7")}, b"\0" * 8), "'a'", "unknown dtype 'Q7'")
    _refused(_file(tmp_path, {"a": entry(dtype="F8_E8M0", shape=(8,))}, b"\0" * 8),
             "F8_E8M0 has no kiln dtype")
    _refused(_file(tmp_path, {"a": entry(shape=(-2,))}, b"\0" * 8), "non-negative integers")
    _refused(_file(tmp_path, {"a": entry(shape=(2.5,))}, b"\0" * 8), "non-negative integers")
    _refused(_file(tmp_path, {"a": {**entry(), "extra": 1}}, b"\0" * 8), "exactly")
    _refused(_file(tmp_path, {"a": entry(offsets=(8, 0))}, b"\0" * 8), "end before they begin")
    _refused(_file(tmp_path, {"a": entry(offsets=(0, 1 << 40))}, b"\0" * 8),
             "reach past the 8-byte data section")
    _refused(_file(tmp_path, {"a": entry(shape=(3,))}, b"\0" * 8), "needs 12 bytes", "hold 8")
    # a huge shape whose byte count wraps in 64-bit arithmetic is still refused
    _refused(_file(tmp_path, {"a": entry(shape=(1 << 62, 4))}, b"\0" * 8), "needs")


def test_overlaps_gaps_and_trailing_bytes(tmp_path):
    e = lambda b, n: {"dtype": "U8", "shape": [n], "data_offsets": [b, b + n]}  # noqa: E731
    _refused(_file(tmp_path, {"a": e(0, 4), "b": e(2, 4)}, b"\0" * 6), "overlap tensor 'a'")
    _refused(_file(tmp_path, {"a": e(0, 4), "b": e(0, 4)}, b"\0" * 4), "overlap")
    _refused(_file(tmp_path, {"a": e(0, 2), "b": e(4, 2)}, b"\0" * 6), "belong to no tensor")
    _refused(_file(tmp_path, {"a": e(0, 2)}, b"\0" * 5), "cover 2")
    # the same layout without the fault loads, with the right values
    good = _file(tmp_path, {"b": e(2, 2), "a": e(0, 2)}, bytes([1, 2, 3, 4]))
    sd = kn.load_state_dict(good)
    assert sd["a"].numpy().tolist() == [1, 2] and sd["b"].numpy().tolist() == [3, 4]
    assert read_header(good)[2] == 8 + len(json.dumps({"b": e(2, 2), "a": e(0, 2)}).encode())
