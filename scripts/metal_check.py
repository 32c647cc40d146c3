"""Check kiln's Metal backend on a Mac: every kernel kind on the real GPU against numpy.

Run on macOS with `pip install -e '.[metal]'`:

    python scripts/metal_check.py            # prints one line per check, exits 1 on a mismatch

Each check compiles a function with backend="metal" (the MSL is compiled by the Metal
driver at run time), runs it on the GPU and compares with kiln's eager (numpy) result;
the kind of kernel each shape gets is the one the Linux simulator tests assert
(tests/codegen/metal/test_metal_kernels.py). If PyTorch with MPS is installed, the same
functions are timed against torch on "mps" (medians of 20 runs, same process).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import kiln as kn

RNG = np.random.default_rng(0)
CHECKS = {
    "pointwise gelu": (lambda x: kn.gelu(x) * 2, [(513, 257)]),
    "inner softmax (vec4)": (lambda x: kn.softmax(x, -1), [(64, 1024)]),
    "inner sum (tail)": (lambda x: x.sum(dim=-1), [(64, 1001)]),
    "narrow sum": (lambda x: x.sum(dim=-1), [(4096, 7)]),
    "outer sum": (lambda x: x.sum(dim=0), [(4096, 300)]),
    "strided sum": (lambda x: x.permute(2, 0, 1).sum(dim=-1), [(16, 64, 33)]),
    "full max": (lambda x: x.amax(), [(1000, 999)]),
    "gemm + bias + relu": (lambda a, w, b: kn.relu(a @ w + b), [(300, 257), (257, 129), (129,)]),
    "causal attention": (lambda q, k, v: kn.scaled_dot_product_attention(q, k, v, is_causal=True),
                         [(2, 4, 128, 64)] * 3),
}


def _median_ms(fn, *args) -> float:
    times = []
    for _ in range(20):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> int:
    failures = 0
    try:
        import torch
        has_mps = torch.backends.mps.is_available()
    except ImportError:
        torch, has_mps = None, False
    for name, (fn, shapes) in CHECKS.items():
        args = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
        compiled = kn.compile(fn, backend="metal")
        got = compiled(*args).numpy()
        want = fn(*(kn.tensor(a) for a in args)).numpy()
        ok = np.allclose(got, want, rtol=1e-4, atol=1e-4)
        failures += not ok
        line = f"{'ok  ' if ok else 'FAIL'} {name:24s} max |diff| {np.abs(got - want).max():.3g}"
        line += f"  kiln {_median_ms(compiled, *args):.3f} ms"
        if has_mps:
            targs = [torch.from_numpy(a).to("mps") for a in args]
            tfn = {"gemm + bias + relu": lambda a, w, b: torch.relu(a @ w + b)}.get(name)
            if tfn is not None:
                line += f"  torch mps {_median_ms(lambda *x: (tfn(*x), torch.mps.synchronize()), *targs):.3f} ms"
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
