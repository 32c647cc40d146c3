"""kiln's GEMM micro-kernel: how B reaches the register tile, against numpy (float64).

A batch's B^T (unit k stride: attention's q @ k^T) is packed by W x W blocks transposed
in registers, a single product's B^T (x @ w.T) and other strides by masked gathers, a
partial panel of a row-major B by masked vector loads, a low-precision B element by
element; a last panel of at most W columns is covered by one vector per row. Each at the
host's width and, by forcing the tile, at the AVX2 (256-bit) and SSE (128-bit) ones:
edges of k and n around W and NR, k = 1 and 0, batches, float32/float64, epilogues."""

import numpy as np
import pytest

from kiln.codegen.cpu import CpuBackend, CpuOptions, microkernel
from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, GemmKernel
from kiln.ir import dtypes as dt

from tests.codegen.test_cpu_gemm import gemm

BACKEND = CpuBackend(CpuOptions(threads=1))
BITS = (512, 256, 128)


@pytest.fixture(params=BITS, ids=lambda b: f"{b}bit")
def width(request, monkeypatch):
    """Emit the micro-kernel as for a host with this vector width (LLVM runs the wider
    host's code; what changes is the tile: MR, NR = 2W, W and the transposes' size)."""
    monkeypatch.setattr(microkernel, "vector_bits", lambda: request.param)
    return request.param


def compiled(g):
    return BACKEND._compile_plans([BACKEND._plan(g, set(), "micro")])[0]


def llvm_text(g) -> str:
    return BACKEND._module_text([BACKEND._plan(g, set(), "micro")])


def product(a, b, ta, tb):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a.transpose(0, 2, 1) if ta else a) @ (b.transpose(0, 2, 1) if tb else b)


def check(g, ta=False, tb=False, seed=0, tol=1e-5):
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(-1, 1, tuple(int(d) for d in b.shape)).astype(b.dtype.np_dtype) for b in g.buffers]
    arrays[-1][...] = np.nan
    compiled(g)(arrays, {})
    np.testing.assert_allclose(arrays[-1].astype(np.float64), product(arrays[0], arrays[1], ta, tb),
                               rtol=tol, atol=tol)


def edges(bits: int, esize: int):
    """(n, k) around the tile: W = lanes, NR = 2W."""
    w = bits // (8 * esize)
    nr = 2 * w
    return [(1, 1), (w - 1, w + 1), (w, 2 * w), (w + 1, 3), (nr, w - 1), (nr + 1, 2 * w + 3), (3 * nr - 1, 1),
            (2 * nr + w, 0)]


@pytest.mark.parametrize("d", [dt.float32, dt.float64])
def test_b_transposed_edges(width, d):
    esize = 8 if d == dt.float64 else 4
    tol = 1e-12 if d == dt.float64 else 1e-5
    for n, k in edges(width, esize):
        check(gemm(3, 11, n, k, d=d, tb=True), tb=True, tol=tol)  # a batch: transposes
        check(gemm(1, 11, n, k, d=d, tb=True), tb=True, tol=tol)  # one product: gathers


@pytest.mark.parametrize("d", [dt.float32, dt.float64])
def test_row_major_partial_and_narrow_panels(width, d):
    esize = 8 if d == dt.float64 else 4
    tol = 1e-12 if d == dt.float64 else 1e-5
    for n, k in edges(width, esize):
        check(gemm(2, 13, n, k, d=d), tol=tol)
        check(gemm(2, 5, n, k + 2, d=d, ta=True), ta=True, tol=tol)


def test_both_transposed_and_batched_epilogue(width):
    check(gemm(4, 9, 37, 21, ta=True, tb=True), ta=True, tb=True)
    w = width // 32
    g = gemm(3, 10, 2 * w + 1, 19, tb=True, epilogue="bias_relu")
    rng = np.random.default_rng(1)
    a, b = rng.uniform(-1, 1, (3, 10, 19)).astype(np.float32), rng.uniform(-1, 1, (3, 2 * w + 1, 19)).astype(np.float32)
    bias = rng.uniform(-1, 1, 2 * w + 1).astype(np.float32)
    out = np.full((3, 10, 2 * w + 1), np.nan, np.float32)
    compiled(g)([a, b, bias, out], {})
    np.testing.assert_allclose(out, np.maximum(product(a, b, False, True) + bias, 0), rtol=1e-5, atol=1e-5)


def strided_b(batch, m, n, k, step):
    """B stored (batch, k, step * n) and read with column stride `step`: neither unit k
    nor unit column stride (the gather packer)."""
    f32 = dt.float32
    return GemmKernel("g", (BufferParam("a", f32, (batch, m, k), IN),
                            BufferParam("b", f32, (batch, k, step * n), IN),
                            BufferParam("o", f32, (batch, m, n), OUT)), (), "a", "b", "o", batch, m, n, k,
                      (m * k, k, 1), (k * step * n, step * n, step), Acc(f32))


def test_strided_b_is_gathered(width):
    w = width // 32
    for n, k in [(1, 1), (2 * w + 3, 5), (w, 17)]:
        g = strided_b(2, 7, n, k, 3)
        rng = np.random.default_rng(n)
        a = rng.uniform(-1, 1, (2, 7, k)).astype(np.float32)
        b = rng.uniform(-1, 1, (2, k, 3 * n)).astype(np.float32)
        out = np.full((2, 7, n), np.nan, np.float32)
        compiled(g)([a, b, out], {})
        np.testing.assert_allclose(out, a.astype(np.float64) @ b[:, :, ::3].astype(np.float64), rtol=1e-5, atol=1e-5)
    assert "llvm.masked.gather" in llvm_text(strided_b(2, 7, 5, 4, 3))


@pytest.mark.parametrize("d", [dt.float16, dt.bfloat16])
def test_low_precision_b_transposed(d):
    check(gemm(2, 9, 37, 20, d=d, tb=True), tb=True, tol=2e-2)


def test_each_layout_takes_its_packer():
    """The emitted code: B^T by in-register transposes (shuffles of two sources, masked
    row loads), a row-major partial panel by masked loads and no transposes, a narrow
    last panel by one vector of FMAs per row, a float16 B without vector packing."""
    w = microkernel.tile(4)[2]
    nt = llvm_text(gemm(2, 8, 40, 24, tb=True))
    assert "llvm.masked.load" in nt and "shufflevector" in nt and "masked.gather" not in nt
    single = llvm_text(gemm(1, 8, 40, 24, tb=True))  # B packed once per call: gathers
    assert "llvm.masked.gather" in single and "llvm.masked.load" not in single
    mr = microkernel.rows_per_tile()
    # two full panels in place, one of 1 column (one row block an item: no copying tile)
    nn = llvm_text(gemm(2, mr, 2 * w * 2 + 1, 24))
    assert "llvm.masked.load" in nn and "masked.gather" not in nn
    wide = llvm_text(gemm(2, mr, 2 * w * 2 + w + 1, 24))  # last panel of W + 1 columns: both vectors
    fma = f"call <{w} x float> @llvm.fma.v{w}f32("
    # full panels (2 vectors per row) + the narrow last one (1 vector per row)
    assert nn.count(fma) == mr * 2 + mr and wide.count(fma) == mr * 2  # one tile, in place or packed
    half = llvm_text(gemm(2, 8, 19, 24, d=dt.float16, tb=True))
    assert "llvm.masked" not in half
    # more row blocks an item: a third tile, which also stores B (the misaligned copy);
    # a single product packs a misaligned B instead (no second tile)
    copying = llvm_text(gemm(2, microkernel.COPY_BLOCKS * mr, 2 * w * 2, 24))
    assert copying.count(fma) == mr * 2 * 2 and "ptrtoint" in copying
    repacking = llvm_text(gemm(1, microkernel.REPACK_BLOCKS * mr, 2 * w * 2, 24))
    assert repacking.count(fma) == mr * 2 and "ptrtoint" in repacking


def test_k_not_a_multiple_of_the_transpose_block_keeps_panels_apart():
    """Packed B^T panels hold k rounded up to W rows: with several panels and items and
    k = W + 1 the rows past k must not reach the next panel's rows."""
    w = microkernel.tile(4)[2]
    for k in (1, w - 1, w + 1, 2 * w + 1):
        check(gemm(3, 17, 5 * w + 3, k, tb=True), tb=True)


def offset_copy(x: np.ndarray, floats: int) -> np.ndarray:
    """x copied to memory starting `floats` elements past a 64-byte boundary."""
    raw = np.empty(x.size + 32, x.dtype)
    start = (-(raw.ctypes.data % 64) // x.itemsize + floats) % (64 // x.itemsize)
    out = raw[start:start + x.size].reshape(x.shape)
    out[...] = x
    assert out.ctypes.data % 64 == (floats * x.itemsize) % 64
    return out


def run_ranges(ck, arrays, ranges, sizes=()):
    """Call the kernel's entry on each [lo, hi) of `ranges` (as claiming threads do)."""
    import ctypes

    bufs = (ctypes.c_void_p * len(arrays))(*[id(x) if ck._by_object else x.ctypes.data for x in arrays])
    csizes = (ctypes.c_int64 * max(1, len(sizes)))(*sizes)
    for lo, hi in ranges:
        ck._fn(bufs, csizes, lo, hi)


@pytest.mark.parametrize("offset,d", [(0, dt.float32), (1, dt.float32), (4, dt.float32), (1, dt.float64)])
def test_misaligned_b_rows_copied_by_the_first_row_block(width, offset, d):
    """B of contiguous columns is read in place where its rows are 64-byte aligned; where
    they are not, the first row block of a batch item copies it (aligned) as it reads it
    and the item's later blocks read the copy (per item: an item stride of 7 x 33 floats
    alternates the items' alignment), and a single product's B is packed whole first
    where REPACK_BLOCKS row blocks read it; with partial and narrow last panels, one row
    block per item (nothing to copy for), and k = 1."""
    npd = d.np_dtype
    mr, nr, w = microkernel.tile(np.dtype(npd).itemsize)
    rng = np.random.default_rng(offset)
    tol = 1e-12 if d == dt.float64 else 1e-5
    rows = microkernel.REPACK_BLOCKS * mr
    for batch, m, n, k in [(1, 4 * mr, 2 * nr, 9), (1, rows, 2 * nr, 9), (1, rows + 3, nr + 1, 7),
                           (3, 3 * mr + 3, nr + 1, 7), (3, 2 * mr, 33, 7),
                           (2, mr, nr, 5), (2, mr + 1, w + 2 * nr, 16), (2, 2 * mr, nr, 1)]:
        a = rng.uniform(-1, 1, (batch, m, k)).astype(npd)
        b = offset_copy(rng.uniform(-1, 1, (batch, k, n)).astype(npd), offset)
        out = np.full((batch, m, n), np.nan, npd)
        compiled(gemm(batch, m, n, k, d=d))([a, b, out], {})
        np.testing.assert_allclose(out, product(a, b, False, False), rtol=tol, atol=tol)


@pytest.mark.parametrize("ranges", [[(0, 12)], [(0, 1), (1, 12)], [(0, 5), (5, 6), (6, 12)],
                                    [(11, 12), (3, 7), (0, 3), (7, 11)], [(k, k + 1) for k in range(12)]])
@pytest.mark.parametrize("batch", [3, 1])
def test_misaligned_copy_for_any_cut_of_the_row_blocks(ranges, batch):
    """Threads claim ranges of row blocks that start and end inside an item: a range
    copies a batch item's misaligned B only where it runs COPY_BLOCKS or more of its blocks
    (packs a single product's where it runs REPACK_BLOCKS), and a block that starts a
    range mid-item reads B in place (the copy is that call's own); every cut, in any
    order, gives the product of one whole call, bit for bit."""
    mr, nr, _ = microkernel.tile(4)
    # a batch: 4 row blocks an item, 12 in all; a single product: 24 (ranges doubled),
    # some ranges of REPACK_BLOCKS or more, some fewer
    scale = 1 if batch > 1 else 2
    assert 24 > microkernel.REPACK_BLOCKS > 10 and 1 < microkernel.COPY_BLOCKS <= 4
    m, n, k = 12 * scale // batch * mr, 2 * nr + 3, 37
    ck = compiled(gemm(batch, m, n, k))
    ranges = [(lo * scale, hi * scale) for lo, hi in ranges]
    rng = np.random.default_rng(7)
    a = rng.uniform(-1, 1, (batch, m, k)).astype(np.float32)
    b = offset_copy(rng.uniform(-1, 1, (batch, k, n)).astype(np.float32), 4)
    whole = np.full((batch, m, n), np.nan, np.float32)
    run_ranges(ck, [a, b, whole], [(0, 12 * scale)])
    np.testing.assert_allclose(whole, product(a, b, False, False), rtol=1e-5, atol=1e-5)
    out = np.full((batch, m, n), np.nan, np.float32)
    run_ranges(ck, [a, b, out], ranges)
    np.testing.assert_array_equal(out, whole)


def test_symbolic_rows_decide_the_copy_at_run_time():
    from tests.codegen.test_cpu_gemm import M

    mr, nr, _ = microkernel.tile(4)
    g = gemm(2, M, nr + 3, 6, sizes=("M",))
    assert "ptrtoint" in llvm_text(g)  # the alignment test is emitted
    for m in (1, mr, 3 * mr + 5):
        rng = np.random.default_rng(m)
        a = rng.uniform(-1, 1, (2, m, 6)).astype(np.float32)
        b = offset_copy(rng.uniform(-1, 1, (2, 6, nr + 3)).astype(np.float32), 2)
        out = np.full((2, m, nr + 3), np.nan, np.float32)
        compiled(g)([a, b, out], {"M": m})
        np.testing.assert_allclose(out, product(a, b, False, False), rtol=1e-5, atol=1e-5)
