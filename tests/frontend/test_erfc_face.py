"""kn.erfc / Tensor.erfc: the op defined once in kiln/ir/ops/elementwise.py, reached from
the public face, against torch.special.erfc eager and compiled over dtypes."""

import numpy as np
import pytest
import torch

import kiln as kn

CASES = {"float32": (kn.float32, torch.float32, 4e-7), "float64": (kn.float64, torch.float64, 1e-13),
         "bfloat16": (kn.bfloat16, torch.bfloat16, 0)}


@pytest.mark.parametrize("dtype", CASES)
def test_erfc_matches_torch(dtype):
    kd, td, rtol = CASES[dtype]
    values = np.concatenate([np.linspace(-4, 9, 101), [0.0, -0.0, np.inf, -np.inf, np.nan]])
    t = torch.tensor(values, dtype=torch.float64).to(td)
    x = kn.tensor(t.double().numpy()).to(kd)
    want = torch.special.erfc(t).double().numpy()
    for got in (kn.erfc(x), x.erfc(), kn.compile(lambda v: kn.erfc(v))(x)):
        np.testing.assert_allclose(got.to(kn.float64).numpy(), want, rtol=rtol or 8e-3, atol=1e-30,
                                   equal_nan=True)
