"""export -> save -> load -> run equals eager, for the examples and with dynamic shapes."""

import os
import sys

import numpy as np
import pytest

import kiln as kn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from transformer_block import example_inputs, transformer_block  # noqa: E402


def save_and_load(prog, tmp_path, name="prog.kir"):
    path = tmp_path / name
    prog.save(path)
    return kn.load(path)


def test_transformer_block_export_load_run(tmp_path):
    args = example_inputs(batch=2, seq=8, dim=16, hidden=32)
    B = kn.ShapeVar("B", min=1, max=16)
    prog = kn.export(transformer_block, args,
                     dynamic_shapes={"x": kn.TensorSpec([B, kn.STATIC, kn.STATIC])})
    loaded = save_and_load(prog, tmp_path)
    assert str(loaded.graph) == str(prog.graph)
    for batch in (1, 2, 7):
        inputs = (kn.randn(batch, 8, 16, seed=batch),) + args[1:]
        # compiled code rounds differently from numpy (fused, vectorized): tolerance, not equality
        np.testing.assert_allclose(loaded(*inputs).numpy(), transformer_block(*inputs).numpy(),
                                   rtol=1e-5, atol=1e-5)
        reference = kn.load(tmp_path / "prog.kir", backend="reference")
        np.testing.assert_array_equal(reference(*inputs).numpy(), transformer_block(*inputs).numpy())
    with pytest.raises(kn.KilnShapeSpecError, match="B <= 16"):
        loaded(kn.randn(17, 8, 16, seed=0), *args[1:])


@pytest.mark.parametrize("dtype", [kn.float32, kn.float16, kn.bfloat16, kn.float8_e4m3fn,
                                   kn.float8_e5m2, kn.int8, kn.uint8, kn.int64, kn.bool, kn.complex64])
def test_constants_of_every_dtype_roundtrip_bit_exactly(tmp_path, dtype):
    raw = np.array([0.0, -0.0, 1.5, -3.25, 448.0 if dtype != kn.float8_e5m2 else 57344.0,
                    np.nan, np.inf, 1e-3], dtype=np.float64)
    if dtype.is_bool:
        data = raw > 0
    elif dtype.is_integer:
        data = np.nan_to_num(raw, posinf=7).astype(np.int64) % 100
    elif dtype.is_complex:
        data = raw + 1j
    else:
        data = raw
    const = kn.tensor(data).to(dtype) if dtype != kn.float8_e4m3fn else kn.tensor(
        np.nan_to_num(data, posinf=448.0)).to(dtype)
    prog = kn.export(lambda x: (x, const), (kn.ones(1),))
    loaded = save_and_load(prog, tmp_path)
    _, got = loaded(kn.ones(1))
    assert got.dtype == dtype
    assert got.numpy().tobytes() == const.numpy().tobytes()


def test_pytree_structure_survives_the_file(tmp_path):
    def f(params, x):
        return {"out": x @ params["w"], "aux": [x.sum(), params["b"] * 2]}

    params = {"w": kn.randn(3, 2, seed=0), "b": kn.ones(2)}
    loaded = save_and_load(kn.export(f, (params, kn.ones(4, 3))), tmp_path)
    got = loaded(params, kn.ones(4, 3))
    want = f(params, kn.ones(4, 3))
    assert set(got) == {"out", "aux"} and len(got["aux"]) == 2
    np.testing.assert_array_equal(got["out"].numpy(), want["out"].numpy())


def test_static_python_arguments_are_baked_in(tmp_path):
    prog = kn.export(lambda x, n: x * n, (kn.ones(2), 3))
    loaded = save_and_load(prog, tmp_path)
    assert loaded(kn.ones(2), 3).tolist() == [3.0, 3.0]
    with pytest.raises(kn.KilnArgumentError, match="exported with 3"):
        loaded(kn.ones(2), 4)


def test_wrong_inputs_to_a_loaded_program_fail_clearly(tmp_path):
    loaded = save_and_load(kn.export(lambda x: x + 1, (kn.ones(2, 3),)), tmp_path)
    with pytest.raises(kn.KilnShapeError, match=r"dim 1 must be 3, got 4"):
        loaded(kn.ones(2, 4))
    with pytest.raises(kn.KilnDTypeError, match="expected dtype float32, got int64"):
        loaded(kn.arange(6).reshape(2, 3))
