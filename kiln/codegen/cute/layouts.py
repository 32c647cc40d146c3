"""What a GemmKernel's operands look like to a TMA-based CuTeDSL GEMM, and whether they can.

TMA moves boxes of a tensor whose every stride but the unit one is a multiple of 16
bytes, from a base address aligned to 16 bytes (kiln's buffers are). So the CuTeDSL
GEMM takes A, B and C when each is a compact matrix per batch (row- or column-major,
batches back to back) and its leading dimension holds a multiple of 16 bytes. A size
that is a symbol can satisfy that only by a promise nobody made ahead of time, so a
symbolic leading dimension is refused too (rows, columns and batches that are not the
leading dimension may be symbolic: they become `sym_int32` extents).

    plan = gemm_layouts(kernel)        # LayoutPlan, or raises LayoutRefused(reason)
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from kiln.codegen.kernel_ir import GemmKernel


class LayoutRefused(ValueError):
    """The kernel's operands cannot go through TMA; the message is the reason."""


@dataclass(frozen=True)
class LayoutPlan:
    """Shapes and CuTe stride orders: A (M, K, L), B (N, K, L), C (M, N, L)."""

    a_shape: tuple
    a_order: tuple
    a_k_major: bool
    b_shape: tuple
    b_order: tuple
    b_k_major: bool
    c_shape: tuple


def _eq(x, y) -> bool:
    return sympy.simplify(sympy.sympify(x) - sympy.sympify(y)) == 0


def _aligned(extent, itemsize: int, what: str) -> None:
    e = sympy.sympify(extent)
    if not e.is_Integer:
        raise LayoutRefused(f"{what} is the symbolic size {e}; TMA needs its row pitch to be a multiple of "
                            "16 bytes, which is not known ahead of time")
    if int(e) * itemsize % 16:
        raise LayoutRefused(f"{what} = {int(e)} elements of {itemsize} bytes is not a multiple of 16 bytes "
                            "(TMA's row-pitch alignment)")


def _matrix(strides, rows, cols, batch, name: str) -> bool:
    """True when (rows x cols) is row-major (cols contiguous), False for column-major."""
    sb, sr, sc = strides
    one_batch = _eq(batch, 1)
    if _eq(sc, 1) and _eq(sr, cols) and (one_batch or _eq(sb, rows * cols)):
        return True
    if _eq(sr, 1) and _eq(sc, rows) and (one_batch or _eq(sb, rows * cols)):
        return False
    raise LayoutRefused(f"operand {name} (strides {tuple(strides)}) is not a compact row- or column-major "
                        "matrix per batch")


def gemm_layouts(k: GemmKernel) -> LayoutPlan:
    """The plan for `k`, or LayoutRefused with the reason TMA cannot take it."""
    dtypes = {b.name: b.dtype for b in k.buffers}
    a_rows = _matrix(k.a_strides, k.m, k.k, k.batch, "a")  # A is (M, K): row-major = K-major
    b_rows = _matrix(k.b_strides, k.k, k.n, k.batch, "b")  # B is (K, N): row-major = N-major
    _aligned(k.k if a_rows else k.m, dtypes[k.a].itemsize, "the leading dimension of a (" + ("K" if a_rows else "M") + ")")
    _aligned(k.n if b_rows else k.k, dtypes[k.b].itemsize, "the leading dimension of b (" + ("N" if b_rows else "K") + ")")
    _aligned(k.n, dtypes[k.out].itemsize, "the output's row length N")
    if dtypes[k.a].itemsize == 1 and not (a_rows and not b_rows):
        raise LayoutRefused("8-bit operands must both be K-major for the tensor cores (a row-major, b column-major)")
    return LayoutPlan(a_shape=(k.m, k.k, k.batch), a_order=(1, 0, 2) if a_rows else (0, 1, 2), a_k_major=a_rows,
                      b_shape=(k.n, k.k, k.batch), b_order=(0, 1, 2) if b_rows else (1, 0, 2), b_k_major=not b_rows,
                      c_shape=(k.m, k.n, k.batch))


def numel(buffer):
    """The element count of a buffer (an int or a sympy expression)."""
    n = sympy.Integer(1)
    for d in buffer.shape:
        n = n * sympy.sympify(d)
    return n


class FakeDims:
    """Static extents stay ints; each distinct symbolic extent becomes one `sym_int32`."""

    def __init__(self):
        self._syms: dict = {}

    def dim(self, extent):
        import cutlass.cute as cute

        e = sympy.sympify(extent)
        if e.is_Integer:
            return int(e)
        if e not in self._syms:
            self._syms[e] = cute.sym_int32()
        return self._syms[e]

    def shape(self, extents) -> tuple:
        return tuple(self.dim(e) for e in extents)


def blocked_scales(scales):
    """Row-major block scale factors [R, C] (R rows of A, or of B as [N, K]; C = K / block)
    in the tensor cores' blocked layout: 128-row x 4-column atoms of 512 bytes, atoms
    row-major over (R / 128, C / 4), inside an atom row r and column c at
    (r % 32) * 16 + (r // 32) * 4 + c (NVIDIA's 32x4x4 scale-factor layout, CuTe's
    `BlockScaledBasicChunk`). Padding rows and columns are zero. Returns a flat array.

    >>> blocked_scales(np.zeros((128, 4), np.uint8)).shape
    (512,)
    """
    import numpy as np

    s = np.asarray(scales)
    rows, cols = s.shape
    r_atoms, c_atoms = -(-rows // 128), -(-cols // 4)
    padded = np.zeros((r_atoms * 128, c_atoms * 4), dtype=s.dtype)
    padded[:rows, :cols] = s
    atoms = padded.reshape(r_atoms, 4, 32, c_atoms, 4)     # (atom row, r // 32, r % 32, atom col, c)
    return atoms.transpose(0, 3, 2, 1, 4).reshape(-1)     # atom, then r % 32, r // 32, c
