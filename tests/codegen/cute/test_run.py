"""The GPU-session path without a GPU: real (CPU) torch tensors bound to the CuTeDSL
kernel's (M, K, L) / (N, K, L) / (M, N, L) views without copies, the kernel compiled for
their layouts (scripts/gpu_check_cute.py's wheel transport: test_gpu_check_cute.py)."""

from __future__ import annotations

import torch

from kiln.codegen.cute.run import GemmLauncher, bind
from tests.codegen.cute.gemms import full_epilogue, gemm

def arrays_for(kernel):
    out = {}
    for b in kernel.buffers:
        out[b.name] = torch.zeros(tuple(int(d) for d in b.shape), dtype=getattr(torch, b.dtype.name))
    return out


def test_bind_views_the_buffers_in_place():
    k = full_epilogue(256, 512, 384)
    t = arrays_for(k)
    a, b, c, operands, sizes = bind(k, t)
    assert (a.shape, a.stride) == ((256, 384, 1), (384, 1, 98304))      # row-major A: K-major
    assert (b.shape, b.stride) == ((512, 384, 1), (1, 512, 196608))     # row-major B [K, N]: N-major
    assert (c.shape, c.stride) == ((256, 512, 1), (512, 1, 131072))
    assert [o.shape for o in operands] == [(512,), (256,), (512,), (256 * 512,)]
    address = lambda x: int(str(x).split("<", 1)[1].split("@", 1)[0], 16)  # noqa: E731  (the data pointer)
    assert address(a) == t["a"].data_ptr() and address(c) == t["y"].data_ptr()
    kt = gemm(128, 64, 256, b_rows=False, batch=2)                      # b stored [N, K]: K-major
    _, b2, _, _, _ = bind(kt, arrays_for(kt))
    assert (b2.shape, b2.stride) == ((64, 256, 2), (256, 1, 64 * 256))


def test_bind_evaluates_symbolic_sizes():
    from kiln.ir.shapes import symbol

    k = gemm(symbol("M"), 512, 384)
    t = {b.name: torch.zeros(tuple(300 if not str(d).isdigit() else int(d) for d in b.shape), dtype=torch.bfloat16)
         for b in k.buffers}
    a, _, c, _, sizes = bind(k, t, {"M": 300})
    assert (a.shape, c.shape) == ((300, 384, 1), (300, 512, 1)) and [int(s) for s in sizes] == [300]


def test_launcher_compiles_for_real_tensor_layouts():
    k = full_epilogue(256, 512, 384)
    launcher = GemmLauncher(k, "sm_100a", (128, 128), arrays_for(k))
    assert launcher.compiled is not None


def test_grouped_launcher_compiles_for_real_tensors():
    from kiln.codegen.cute.run import GroupedLauncher

    t, k, n, e = 1000, 256, 384, 8
    x, y = torch.zeros(t, k, dtype=torch.bfloat16), torch.zeros(t, n, dtype=torch.bfloat16)
    sizes = torch.full((e,), t // e, dtype=torch.int32)
    launch = GroupedLauncher("sm_100a", x, torch.zeros(e, n, k, dtype=torch.bfloat16), y, sizes,
                             row_scale=torch.zeros(t), activation="gelu_tanh", transpose_rhs=True)
    assert launch.compiled is not None
    args = launch._args(x, torch.zeros(e, n, k, dtype=torch.bfloat16), y, sizes, None, torch.zeros(t))
    assert (args[1].shape, args[1].stride) == ((n, k, e), (k, 1, n * k))  # w [E, N, K] viewed as (N, K, E)


def test_blocked_scales_follow_the_32x4x4_layout():
    import numpy as np

    from kiln.codegen.cute.layouts import blocked_scales

    rows, cols = 200, 10  # padded to 256 x 12: 2 x 3 atoms
    s = np.arange(1, rows * cols + 1, dtype=np.int32).reshape(rows, cols)
    flat = blocked_scales(s)
    assert flat.shape == (256 * 12,)
    for r in range(rows):
        for c in range(cols):
            atom = (r // 128) * 3 + c // 4
            assert flat[atom * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] == s[r, c]
    assert np.count_nonzero(flat) == rows * cols  # the padding is zero
