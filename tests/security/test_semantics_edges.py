"""Hardening, wrong or unclear results (issue 11, findings 11-13): the same answer eager
and compiled at the edges of float->int conversion, a numbered K170 before any absurd
allocation, and the three edge cases that leaked numpy/Python errors."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import kiln as kn
import kiln.nn.functional as F
from kiln.errors import KilnArgumentError, KilnFormatError
from kiln.ir.archive import save_graph
from kiln.memory_limits import KilnMemoryError

EDGES = [float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 3e9, -3e9, 2.0 ** 31,
         -2.0 ** 31, 2.0 ** 63, -2.0 ** 63, 1e10, 300.7, -300.7, 70000.5, -129.9, 255.9, -0.5]
FLOATS = {"float32": (kn.float32, torch.float32), "float64": (kn.float64, torch.float64),
          "float16": (kn.float16, torch.float16), "bfloat16": (kn.bfloat16, torch.bfloat16)}
INTS = {"int8": (kn.int8, torch.int8), "uint8": (kn.uint8, torch.uint8),
        "int16": (kn.int16, torch.int16), "int32": (kn.int32, torch.int32),
        "int64": (kn.int64, torch.int64)}


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", INTS)
def test_float_to_int_matches_torch_eager_and_compiled(src, dst):
    (ks, ts), (kd, td) = FLOATS[src], INTS[dst]
    t = torch.tensor(EDGES, dtype=ts)
    x = kn.tensor(t.float().numpy()).to(ks) if src in ("float16", "bfloat16") else kn.tensor(t.numpy())
    expected = t.to(td).tolist()
    eager = x.to(kd).numpy().tolist()
    compiled = kn.compile(lambda a: a.to(kd))(x).numpy().tolist()
    assert eager == expected
    assert compiled == expected


def test_float_to_int_inside_a_fused_chain():
    x = kn.tensor(np.array(EDGES, np.float32))
    f = kn.compile(lambda a: (a * 2).to(kn.int32) + 1)
    expected = ((torch.tensor(EDGES) * 2).to(torch.int32) + 1).tolist()
    assert f(x).numpy().tolist() == expected


@pytest.mark.parametrize("make", [
    lambda: kn.zeros(2 ** 40),
    lambda: kn.ones(2 ** 20, 2 ** 20),
    lambda: kn.full((2 ** 62, 2 ** 62), 1.0),
    lambda: kn.arange(2 ** 40),
    lambda: kn.randn(2 ** 40, seed=0),
    lambda: kn.zeros(3).expand(2 ** 40, 3),
    lambda: F.pad(kn.zeros(3), (0, 2 ** 40)),
    lambda: kn.compile(lambda x: x.expand(2 ** 40, 3))(kn.zeros(3)),
], ids=["zeros", "ones", "full-overflow", "arange", "randn", "expand", "pad", "compiled-expand"])
def test_absurd_sizes_are_k170_before_allocating(make):
    with pytest.raises(KilnMemoryError) as info:
        make()
    message = str(info.value)
    assert message.startswith("[K170]") and "over the limit of" in message
    assert "TiB" in message or "EiB" in message  # the figures, readable


def test_fraction_limits_eager_results_too():
    kn.runtime.set_memory_fraction(1e-4)
    try:
        limit = kn.runtime.memory_stats()["limit_bytes"]
        n = limit // 4 + 1024
        with pytest.raises(KilnMemoryError, match=str(limit)):
            kn.zeros(n)
        assert kn.zeros(1000).numpy().sum() == 0  # small results still fine
    finally:
        kn.runtime.set_memory_fraction(1.0)


def test_hostile_kir_with_absurd_shape_is_k170_in_kiln_run(tmp_path):
    exported = kn.export(lambda x: x.expand(2 ** 40, 3), kn.zeros(3))
    path = tmp_path / "huge.kir"
    exported.save(path)
    np.save(tmp_path / "x.npy", np.zeros(3, np.float32))
    run = subprocess.run([sys.executable, "-m", "kiln", "run", str(path), str(tmp_path / "x.npy")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "K170" in run.stderr and "Traceback" not in run.stderr


def test_sdpa_with_zero_keys_gives_zeros_eager_and_compiled():
    q, k, v = kn.randn(2, 3, 4, seed=0), kn.zeros(2, 0, 4), kn.zeros(2, 0, 5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        torch.tensor(q.numpy()), torch.zeros(2, 0, 4), torch.zeros(2, 0, 5)).numpy()
    np.testing.assert_array_equal(F.scaled_dot_product_attention(q, k, v).numpy(), expected)
    compiled = kn.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c))(q, k, v)
    np.testing.assert_array_equal(compiled.numpy(), expected)


@pytest.mark.parametrize("chunks", [0, -2, 1.5, True])
def test_chunk_refuses_non_positive_chunks(chunks):
    with pytest.raises(KilnArgumentError, match="chunk: chunks must be a positive int"):
        kn.chunk(kn.zeros(4), chunks)


def test_chunk_still_matches_torch():
    x = np.arange(10, dtype=np.float32)
    for chunks in (1, 3, 4, 10, 12):
        got = [c.numpy() for c in kn.chunk(kn.tensor(x), chunks)]
        want = [c.numpy() for c in torch.chunk(torch.tensor(x), chunks)]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("out_spec", [
    {"dict": [[1, "*"]]},
    {"dict": [[["a"], "*"]]},
    {"dict": [["a", "*", "extra"]]},
    {"tuple": "*"},
    {"dict": "*"},
    {"nope": ["*"]},
], ids=["int-key", "list-key", "triple", "string-items", "string-dict", "unknown-kind"])
def test_kir_out_spec_is_checked_at_load(tmp_path, out_spec):
    exported = kn.export(lambda x: x + 1, kn.zeros(3))
    metadata = exported.metadata()
    metadata["out_spec"] = out_spec
    path = tmp_path / "bad.kir"
    save_graph(exported.graph, path, metadata=metadata)
    with pytest.raises(KilnFormatError, match="bad metadata"):
        kn.load(path)


def test_kir_deeply_nested_spec_is_a_format_error(tmp_path):
    exported = kn.export(lambda x: x + 1, kn.zeros(3))
    spec = "*"
    for _ in range(250):  # deeper than kn.load accepts, shallow enough to write
        spec = {"tuple": [spec]}
    metadata = exported.metadata()
    metadata["out_spec"] = spec
    path = tmp_path / "deep.kir"
    save_graph(exported.graph, path, metadata=metadata)
    with pytest.raises(KilnFormatError, match="nested deeper than 200"):
        kn.load(path)
