"""Complex matmul on the CPU: `cblas_cgemm`/`cblas_zgemm` tiles over kiln's threads.

On the CPU a large complex `matmul` stays whole through the `complex` pass
(complex_decompose.decompose_complex_blas) and runs as an extern step; the CPU backend's
`templates()["gemm"]` (this module's `run_matmul`) takes it there: ONE complex BLAS call
per tile of the output on the operands' own memory (4M, the process's BLAS: MKL or
numpy's OpenBLAS, blas.py; no pair block, no real-part copies), the tiles chosen as for a real product
(autotune.panel_tiles_for: one per thread, rows or columns by shape) and claimed by
kiln's OpenMP threads, each a one-thread BLAS call. numpy's matmul makes the same
product one multi-threaded OpenBLAS call, whose threads meet at a barrier per block and
stall when one is descheduled (issue 22); tiles only cut m and n, so the result is
bit-identical to one cgemm call of the same BLAS.

The tile loop is a small hand-written LLVM function (the glue cache keeps its object
code across processes) with the compiled-kernel ABI `fn(bufs, sizes, begin, end)`, so
`native_pool.parallel_claim` runs it like any split GEMM. Operands BLAS cannot take as
they are (not row-major or transposed-contiguous matrices, broadcast batch dims, real
dtypes) run numpy's reference instead.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu import blas
from kiln.codegen.cpu.autotune import SPLIT_MACS, panel_tiles_for
from kiln.codegen.cpu.jit import CBLAS_NO_TRANS, CBLAS_ROW_MAJOR, CBLAS_TRANS
from kiln.codegen.cpu.llvm_emit import array_data_ir

ENTRY = {np.dtype(np.complex64): ("kiln_cgemm_tiles", "c", "float", 8),
         np.dtype(np.complex128): ("kiln_zgemm_tiles", "z", "double", 16)}
# sizes[]: m n k lda ldb trans_a trans_b rows cols col_tiles a_batch b_batch (elements)
SIZE_NAMES = ("m", "n", "k", "lda", "ldb", "ta64", "tb64", "mp", "np", "npc", "sa", "sb")
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def _tile_function(name: str, blas: str, scalar: str, esize: int) -> str:
    """fn(bufs = [a, b, c], sizes, begin, end): tiles [begin, end) of batch x row panels
    x column panels, tile p -> one BLAS call for its block of c (row-major, ldc = n).
    bufs holds the arrays' PyObject addresses (`id`), whose data pointers it reads, as a
    prepared call's launches do (launch_list.py): no ctypes pointer objects per call."""
    loads = "".join(f"  %p{v} = getelementptr i64, ptr %sizes, i64 {i}\n  %{v} = load i64, ptr %p{v}\n"
                    for i, v in enumerate(SIZE_NAMES))
    loads += "  %ta = trunc i64 %ta64 to i32\n  %tb = trunc i64 %tb64 to i32\n"
    return f"""
@{name}.one = private unnamed_addr constant [2 x {scalar}] [{scalar} 1.0, {scalar} 0.0]
@{name}.zero = private unnamed_addr constant [2 x {scalar}] zeroinitializer
declare void @{blas}(i32, i32, i32, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64)

define void @{name}(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) nounwind {{
entry:
{array_data_ir(("pa", "pb", "pc"))}{loads}  %mp1 = add i64 %m, %mp
  %mp2 = sub i64 %mp1, 1
  %npr = sdiv i64 %mp2, %mp
  %per = mul i64 %npr, %npc
  %ata = icmp eq i32 %ta, {CBLAS_TRANS}
  %atb = icmp eq i32 %tb, {CBLAS_TRANS}
  br label %head
head:
  %p = phi i64 [ %begin, %entry ], [ %next, %body ]
  %more = icmp slt i64 %p, %end
  br i1 %more, label %body, label %exit
body:
  %bi = sdiv i64 %p, %per
  %q = srem i64 %p, %per
  %r = sdiv i64 %q, %npc
  %c = srem i64 %q, %npc
  %i0 = mul i64 %r, %mp
  %left = sub i64 %m, %i0
  %rlt = icmp slt i64 %left, %mp
  %rows = select i1 %rlt, i64 %left, i64 %mp
  %j0 = mul i64 %c, %np
  %cleft = sub i64 %n, %j0
  %clt = icmp slt i64 %cleft, %np
  %cols = select i1 %clt, i64 %cleft, i64 %np
  ; A's rows i0.. (stored transposed: its columns), B's columns j0.. (transposed: rows)
  %abase = mul i64 %bi, %sa
  %arow = select i1 %ata, i64 %i0, i64 0
  %arowl = mul i64 %i0, %lda
  %aoff0 = select i1 %ata, i64 %arow, i64 %arowl
  %aoff = add i64 %abase, %aoff0
  %ap = getelementptr [{esize} x i8], ptr %pa, i64 %aoff
  %bbase = mul i64 %bi, %sb
  %bcoll = mul i64 %j0, %ldb
  %boff0 = select i1 %atb, i64 %bcoll, i64 %j0
  %boff = add i64 %bbase, %boff0
  %bp = getelementptr [{esize} x i8], ptr %pb, i64 %boff
  %crow0 = mul i64 %bi, %m
  %crow = add i64 %crow0, %i0
  %coff0 = mul i64 %crow, %n
  %coff = add i64 %coff0, %j0
  %cp = getelementptr [{esize} x i8], ptr %pc, i64 %coff
  call void @{blas}(i32 {CBLAS_ROW_MAJOR}, i32 %ta, i32 %tb, i64 %rows, i64 %cols, i64 %k,
                    ptr @{name}.one, ptr %ap, i64 %lda, ptr %bp, i64 %ldb, ptr @{name}.zero, ptr %cp, i64 %n)
  %next = add i64 %p, 1
  br label %head
exit:
  ret void
}}
"""


@lru_cache(maxsize=None)
def _tiles(dtype: np.dtype, provider: str):
    """(the jitted module, the tile function's address) for a complex dtype, calling BLAS
    `provider` (blas.py)."""
    from kiln.codegen.cpu.glue_cache import glue_module

    name, letter, scalar, esize = ENTRY[dtype]
    jitted = glue_module(_tile_function(name, blas.load(provider).gemm(letter), scalar, esize), 1)
    return jitted, jitted.address(name)


def _matrix_layout(x: np.ndarray):
    """(transposed, leading dim, batch stride) in elements of the last two dims, or None
    when BLAS cannot read them as they are."""
    e = x.itemsize
    if x.ndim < 2 or any(s % e for s in x.strides):
        return None
    rows, cols = x.shape[-2:]
    sr, sc = x.strides[-2] // e, x.strides[-1] // e
    if (sc == 1 or cols == 1) and sr >= max(1, cols):
        lay = (False, max(1, sr if rows > 1 else cols))
    elif (sr == 1 or rows == 1) and sc >= max(1, rows):
        lay = (True, max(1, sc if cols > 1 else rows))
    else:
        return None
    if x.ndim == 2:
        return lay + (0,)
    batch = x.shape[:-2]
    if len(batch) > 1:  # the batch dims must be one evenly strided dim
        s = [x.strides[i] // e for i in range(len(batch))]
        if any(s[i] != s[i + 1] * batch[i + 1] for i in range(len(batch) - 1)):
            return None
    return lay + (x.strides[len(batch) - 1] // e if int(np.prod(batch)) > 1 else 0,)


class _Call:
    """A prepared product for one signature (shapes, strides, dtype, BLAS, threads): the
    tile function's sizes and the split, decided once; a call allocates the output and
    runs the tiles on the operands' memory."""

    __slots__ = ("out_shape", "dtype", "sizes", "total", "address", "fn", "split", "one_blas")

    def __init__(self, out_shape, dtype, sizes, total, address, split, one_blas):
        self.out_shape, self.dtype, self.sizes, self.total = out_shape, dtype, sizes, total
        self.address, self.fn, self.split, self.one_blas = address, _FN(address), split, one_blas

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = np.empty(self.out_shape, self.dtype)
        bufs = _OBJECTS(id(a), id(b), id(out))  # a, b, out live until the call returns
        claim = None
        if self.split > 1:
            from kiln.codegen.cpu.native_pool import parallel_claim

            claim = parallel_claim()
        if self.one_blas:  # numpy's OpenBLAS: one thread inside (MKL runs sequential)
            from kiln.runtime.threads import blas_single_thread

            with blas_single_thread():
                self._run(claim, bufs)
        else:
            self._run(claim, bufs)
        return out

    def _run(self, claim, bufs) -> None:
        if claim is not None:
            claim(self.address, bufs, self.sizes, self.total, 1, self.split)
        else:
            self.fn(bufs, self.sizes, 0, self.total)


_OBJECTS = ctypes.c_void_p * 3
_PREPARED: dict = {}  # signature -> _Call, or False (BLAS cannot take the operands)
MAX_PREPARED = 256  # signatures kept (then the table is emptied)


def blas_matmul(a: np.ndarray, b: np.ndarray, threads: int | None = None,
                provider: str | None = None) -> np.ndarray | None:
    """a @ b by complex BLAS tiles over kiln's threads, or None when the operands are not
    same-dtype complex matrices BLAS can take as they are (the caller runs numpy's).
    `provider`: the BLAS (blas.py), None for the process's. What a signature needs is
    decided on its first call (`_prepare`); later calls cost an allocation and the BLAS
    calls (~1 us of Python: a 16 x 16 x 16 product in ~3 us)."""
    if threads is None:
        from kiln.runtime.threads import parallel_threads

        threads = parallel_threads()
    key = (a.shape, a.strides, a.dtype, b.shape, b.strides, b.dtype, provider, threads)
    call = _PREPARED.get(key)
    if call is None:
        call = _prepare(a, b, threads, provider or blas.default_name())
        if len(_PREPARED) >= MAX_PREPARED:
            _PREPARED.clear()
        _PREPARED[key] = call
    if call is False:
        return None
    if a.size == 0 or b.size == 0:  # nothing to multiply: an empty or all-zero product
        return np.zeros(call, a.dtype)
    return call(a, b)


def _prepare(a: np.ndarray, b: np.ndarray, threads: int, provider: str):
    """The `_Call` for these operands' signature; False where BLAS cannot take them as
    they are (the caller runs numpy's); the output's shape for an empty product."""
    if a.dtype != b.dtype or a.dtype not in ENTRY or a.ndim < 2 or b.ndim < 2 or not blas.available(provider):
        return False
    if b.ndim > 2 and a.shape[:-2] != b.shape[:-2] or b.ndim > a.ndim or a.shape[-1] != b.shape[-2]:
        return False  # broadcast batch dims: numpy's loop
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if a.size == 0 or b.size == 0:
        return a.shape[:-2] + (m, n)
    la, lb = _matrix_layout(a), _matrix_layout(b)
    if la is None or lb is None:
        return False
    batch = int(np.prod(a.shape[:-2]))
    out_shape = a.shape[:-2] + (m, n)
    if b.ndim == 2 and la[0] is False and (a.ndim == 2 or la[2] == m * la[1] and la[1] == k):
        m, batch = m * batch, 1  # contiguous rows of a batch against one matrix: one GEMM
        la = (False, la[1], 0)
    macs = 4 * batch * m * n * k  # real multiply-adds (4M)
    # 4 real multiply-adds per complex one: k scaled, the packing comparison unchanged
    rows, cols = panel_tiles_for(m, n, 4 * k, threads if macs >= SPLIT_MACS else 1, batch)
    if batch > 1:
        rows = m  # whole batch items, claimed one at a time
    cols = cols or n
    npc = -(-n // cols)
    total = batch * -(-m // rows) * npc
    sizes = (ctypes.c_int64 * len(SIZE_NAMES))(m, n, k, la[1], lb[1], CBLAS_TRANS if la[0] else CBLAS_NO_TRANS,
                                       CBLAS_TRANS if lb[0] else CBLAS_NO_TRANS, rows, cols, npc,
                                       la[2], lb[2] if b.ndim > 2 else 0)
    split = min(threads, total) if threads > 1 and total > 1 and macs >= SPLIT_MACS else 1
    return _Call(out_shape, a.dtype, sizes, total, _tiles(a.dtype, provider)[1], split, provider != "mkl")


def run_matmul(arrays, attrs) -> list:
    """The CPU backend's extern `matmul` (templates()["gemm"]): complex operands by
    `blas_matmul`, anything else by the op's numpy reference."""
    a, b = arrays
    out = blas_matmul(a, b) if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) else None
    if out is None:
        from kiln.ir.emitter import EAGER

        return EAGER.apply("matmul", arrays, attrs)
    return [out]
