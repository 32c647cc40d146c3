"""Running the batched linear-algebra MSL kernels (linalg.py) on a `metal:N` device.

`kn.linalg.cholesky/qr/eigh/svd` of a tensor on metal:N come here (the routing rule is
kiln/codegen/cpu/linalg_route.py's): the kernel for the operand's static size is
generated, compiled at run time by Metal and launched with one threadgroup per matrix.
The kernels are float32 (Metal has no float64). Off macOS the launch is K410, saying a
Mac is needed; `kiln dump --target metal` and linalg.py's generators work anywhere.
"""

from __future__ import annotations

import numpy as np

from kiln.codegen.metal import linalg
from kiln.codegen.metal.errors import KilnMetalArgumentError


def run(op: str, a: np.ndarray, index: int = 0) -> tuple:
    """The results of `op` on the [..., m, n] float32 batch `a` on metal:`index`."""
    from kiln.codegen.metal.runtime import MetalKernel, metal_device

    if a.dtype != np.float32:
        raise KilnMetalArgumentError(f"metal {op}: operand of dtype {a.dtype} is not supported; the Metal "
                                     "kernels take float32 (Metal has no float64)",
                                     hint="convert with .to(kn.float32), or run it on the cpu device")
    x = np.ascontiguousarray(a).reshape((-1,) + a.shape[-2:])
    b, (m, n) = x.shape[0], x.shape[-2:]
    lead = a.shape[:-2]
    if op == "cholesky":
        kernel, outs = linalg.cholesky(n), [np.empty_like(x), np.empty(b, np.int32)]
    elif op == "qr":
        kernel, outs = linalg.qr(m, n), [np.empty((b, m, n), np.float32), np.empty((b, n, n), np.float32)]
    elif op == "eigh":
        kernel, outs = linalg.eigh(n), [np.empty((b, n), np.float32), np.empty((b, n, n), np.float32)]
    elif op == "svd":
        kernel = linalg.svd(m, n)
        outs = [np.empty((b, m, n), np.float32), np.empty((b, n), np.float32), np.empty((b, n, n), np.float32)]
    else:
        raise KilnMetalArgumentError(f"metal linalg: no kernel for {op!r}; there are cholesky, qr, eigh, svd")
    MetalKernel(kernel, metal_device(index))([x] + outs, {"batch": b})
    if op == "cholesky":
        outs[0][outs[1] > 0] = np.nan
        return (outs[0].reshape(a.shape),)
    if op == "svd":
        u, s, v = outs
        return u.reshape(lead + (m, n)), s.reshape(lead + (n,)), v.transpose(0, 2, 1).reshape(lead + (n, n))
    return tuple(o.reshape(lead + o.shape[1:]) for o in outs)
