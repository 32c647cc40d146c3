"""The CPU's native convolution (kiln/codegen/cpu/conv_native.py): im2col blocks and one
BLAS GEMM per block over kiln's threads, checked against torch's convolutions (the
oracle) over dtypes, strides, padding, dilation, groups, 1-d and 2-d, the direct 1 x 1
form, the transposed and merged forms a kernel gradient takes, on one and two threads,
compiled and differentiated; what it does not take runs the op's reference."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import conv_native
from kiln.ir.ops.linalg import conv_attrs, conv_reference
from tests.codegen.cpu_helpers import skip_if_no_blas

torch = pytest.importorskip("torch")
pytestmark = skip_if_no_blas

F = torch.nn.functional


def _torch_conv(x, w, strides, padding, dilation, groups):
    d = x.ndim - 2
    pads = [p for lo_hi in reversed(padding) for p in lo_hi]  # torch pads the last dim first
    tx = F.pad(torch.from_numpy(x), pads)
    conv = F.conv1d if d == 1 else F.conv2d
    return conv(tx, torch.from_numpy(w), stride=strides, dilation=dilation, groups=groups).numpy()


def _rand(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# (x shape, w shape, strides, padding (lo, hi) per dim, dilation, groups): the form each takes
CASES = {
    "3x3 padded": ((2, 3, 9, 8), (4, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    "strided, dilated, uneven pad, groups": ((2, 4, 11, 9), (6, 2, 3, 2), (2, 1), ((0, 2), (1, 0)), (1, 2), 2),
    "1x1 direct": ((3, 8, 6, 5), (5, 8, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
    "depthwise": ((2, 6, 7, 7), (6, 1, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 6),
    "stride beyond the kernel": ((2, 3, 13, 11), (5, 3, 2, 2), (3, 4), ((0, 0), (0, 0)), (1, 1), 1),
    "rows wholly in padding": ((2, 3, 4, 4), (5, 3, 3, 3), (1, 1), ((3, 3), (3, 2)), (1, 1), 1),
    "1-d": ((3, 4, 20), (6, 4, 5), (2,), ((2, 1),), (1,), 1),
    "transposed (kernel wider than output)": ((3, 4, 12, 12), (5, 4, 11, 10), (1, 1), ((1, 0), (0, 1)), (1, 1), 1),
    "transposed, strided, groups": ((2, 6, 15, 15), (6, 3, 7, 7), (2, 2), ((1, 2), (0, 1)), (2, 2), 2),
    # stride 2 along rows of 21-40 outputs (the literal-stride copy's vector loop), its
    # first and last taps in padding on the left and on the right
    "downsampling, stride 2": ((2, 3, 20, 81), (4, 3, 3, 3), (2, 2), ((1, 1), (1, 2)), (1, 1), 1),
    "stride 2, dilated": ((1, 2, 9, 47), (3, 2, 2, 3), (1, 2), ((0, 0), (2, 0)), (1, 3), 1),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_on_one_and_two_threads(split_always, case, dtype):
    xs, ws, strides, padding, dilation, groups = CASES[case]
    x, w = _rand(xs, dtype, 1), _rand(ws, dtype, 2)
    want = _torch_conv(x, w, strides, padding, dilation, groups)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for threads in (1, 2):
        got = conv_native.conv2d(x, w, strides, padding, dilation, groups, threads=threads)
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_allclose(got, conv_reference(x, w, strides, padding, dilation, groups),
                               rtol=tol, atol=tol * np.abs(want).max())


def test_the_forms_are_chosen_as_documented(monkeypatch):
    """1 x 1 at stride 1 reads x in place (no scratch); a kernel wider than its output is
    built transposed, and its items merged into one GEMM where they have few outputs."""
    monkeypatch.setattr(conv_native, "_PREPARED", {})

    def form(case, threads=1):
        xs, ws, strides, padding, dilation, groups = CASES[case]
        call = conv_native._prepare(xs, np.float32, ws, np.float32, strides, padding, dilation, groups,
                                    threads, conv_native.blas.default_name())
        flags = dict(zip(conv_native.SIZE_NAMES, call.sizes))
        return flags["DIRECT"], flags["TRANS"], flags["MERGE"], call.scratch

    assert form("1x1 direct") == (1, 0, 0, 0)
    assert form("3x3 padded")[:3] == (0, 0, 0)
    assert form("transposed (kernel wider than output)")[:3] == (0, 1, 1)
    assert form("transposed, strided, groups")[:3] == (0, 1, 0)  # groups: W differs per item


@pytest.mark.parametrize("xs,ws,strides,pad,dilation,groups", [
    ((2, 3, 9, 8), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 4, 11, 9), (6, 2, 3, 2), (2, 1), (1, 0), (1, 2), 2),
    ((3, 4, 20), (6, 4, 5), (2,), (2,), (1,), 1)])
def test_compiled_convolutions_and_their_gradients_match_torch(xs, ws, strides, pad, dilation, groups):
    x, w = _rand(xs, np.float32, 3), _rand(ws, np.float32, 4)
    conv_k = kn.nn.functional.conv1d if x.ndim == 3 else kn.nn.functional.conv2d
    conv_t = F.conv1d if x.ndim == 3 else F.conv2d

    def loss_k(x, w):
        return (conv_k(x, w, stride=strides, padding=pad, dilation=dilation, groups=groups) ** 2).sum()

    tx, tw = (torch.from_numpy(a).requires_grad_() for a in (x, w))
    ty = conv_t(tx, tw, stride=strides, padding=pad, dilation=dilation, groups=groups)
    (ty ** 2).sum().backward()
    f = kn.compile(lambda x, w: conv_k(x, w, stride=strides, padding=pad, dilation=dilation, groups=groups))
    for _ in range(3):  # the general path, then the prepared call
        np.testing.assert_allclose(f(x, w).numpy(), ty.detach().numpy(), rtol=2e-5, atol=2e-5)
    gx, gw = kn.compile(kn.grad(loss_k, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4 * np.abs(tx.grad.numpy()).max())
    np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-4 * np.abs(tw.grad.numpy()).max())


def test_the_extern_runs_the_native_form_and_reads_each_calls_operands(monkeypatch):
    monkeypatch.setattr(conv_native, "_PREPARED", {})
    attrs = {"window_strides": (1, 1), "padding": ((1, 1), (1, 1)), "rhs_dilation": (1, 1),
             "feature_group_count": 1}
    for seed in range(3):
        x, w = _rand((2, 3, 8, 8), np.float32, seed), _rand((4, 3, 3, 3), np.float32, seed + 9)
        (y,) = conv_native.run_convolution([x, w], attrs)
        np.testing.assert_allclose(y, _torch_conv(x, w, (1, 1), ((1, 1), (1, 1)), (1, 1), 1), rtol=2e-5, atol=2e-5)
    assert len(conv_native._PREPARED) == 1 and all(conv_native._PREPARED.values())


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_what_it_does_not_take_runs_the_reference(dtype):
    x = (np.arange(2 * 3 * 6 * 6) % 7 - 3).astype(dtype).reshape(2, 3, 6, 6)
    w = (np.arange(4 * 3 * 3 * 3) % 5 - 2).astype(dtype).reshape(4, 3, 3, 3)
    attrs = conv_attrs("convolution", 2, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert conv_native.conv2d(x, w, *attrs) is None
    (y,) = conv_native.run_convolution([x, w], {"window_strides": (1, 1), "padding": ((1, 1), (1, 1)),
                                                "rhs_dilation": (1, 1), "feature_group_count": 1})
    np.testing.assert_array_equal(y, conv_reference(x, w, *attrs))
    assert conv_native.conv2d(_rand((1, 1, 5, 5, 5), np.float32, 0), _rand((1, 1, 2, 2, 2), np.float32, 1),
                              (1, 1, 1), ((0, 0),) * 3, (1, 1, 1), 1) is None  # 3-d: the reference
