"""kiln's grouped GEMM for mixture-of-experts layers in CuTeDSL, for Blackwell (sm_100a).

    y[rows of e] = epilogue(x[rows of e] @ w[e])    for every expert e, in one launch

The `grouped_matmul` op (kiln/ir/ops/moe.py): x [T, K] holds the tokens sorted by expert,
group_sizes [E] how many rows each expert owns, w [E, K, N] (or [E, N, K]). The grid has
one CTA per (row tile, column tile) of the work list, sized for the worst case
(ceil(T / BM) + E row tiles); each CTA walks group_sizes on the device to find its expert
and the first row of its tile (no host sync, no prefix-sum kernel), and CTAs past the
end of the list leave at once. The tile's A rows start at that row: TMA addresses rows
by element, so an expert's first row needs no alignment; rows of the next expert that a
partial tile loads are computed and never stored. B is expert e's matrix (the batch
coordinate of the TMA view of w). The accumulator lives in tensor memory (tcgen05), the
epilogue (the Triton grouped kernel's, in the same order) is applied per element:

    acc * alpha -> + bias[e, col] -> activation -> * row_scale[row] -> cast to y's dtype

and stores are masked to the expert's rows and to N.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kiln.codegen.cute.builders import tma_split
from kiln.codegen.cute.sm100_gemm import Sm100Gemm

ACTIVATIONS = ("none", "relu", "silu", "gelu", "gelu_tanh")


class GroupedParts:
    """What both grouped kernels share: their options, the work-list walk, the epilogue."""

    def __init__(self, tile_mn: tuple[int, int], activation: str = "none", alpha: float = 1.0,
                 has_bias: bool = False, has_row_scale: bool = False):
        super().__init__(tile_mn, None)  # the kernel class after this one in the MRO
        if activation not in ACTIVATIONS:
            raise ValueError(f"grouped GEMM: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation, self.alpha = activation, float(alpha)
        self.has_bias, self.has_row_scale = has_bias, has_row_scale

    @cute.jit
    def find_tile(self, bm, group_sizes):
        """(expert, first row, end row of the expert) of row tile `bm` of the work list; expert
        is -1 past its end. Tiles are numbered expert by expert."""
        expert = cutlass.Int32(-1)
        row0 = cutlass.Int32(0)
        row_end = cutlass.Int32(0)
        tiles_before = cutlass.Int32(0)
        offset = cutlass.Int32(0)
        for e in cutlass.range(cute.size(group_sizes), unroll=1):
            rows = group_sizes[e]
            tiles = (rows + self.tile[0] - 1) // self.tile[0]
            if expert < 0:
                if bm < tiles_before + tiles:
                    expert = e
                    row0 = offset + (bm - tiles_before) * self.tile[0]
                    row_end = offset + rows
            tiles_before = tiles_before + tiles
            offset = offset + rows
        return expert, row0, row_end

    @cute.jit
    def epilogue_value(self, acc, row, col, expert, bias, row_scale):
        v = acc * cutlass.Float32(self.alpha) if self.alpha != 1.0 else acc
        if cutlass.const_expr(self.has_bias):
            v = v + bias[(expert, col)].to(cutlass.Float32)
        if cutlass.const_expr(self.activation == "relu"):
            v = cutlass.max(v, cutlass.Float32(0.0))
        if cutlass.const_expr(self.activation == "silu"):
            v = v / (cutlass.Float32(1.0) + cute.math.exp(-v))
        if cutlass.const_expr(self.activation == "gelu"):
            v = cutlass.Float32(0.5) * v * (cutlass.Float32(1.0) + cute.math.erf(v * cutlass.Float32(1 / math.sqrt(2))))
        if cutlass.const_expr(self.activation == "gelu_tanh"):
            inner = cutlass.Float32(math.sqrt(2 / math.pi)) * (v + cutlass.Float32(0.044715) * v * v * v)
            v = cutlass.Float32(0.5) * v * (cutlass.Float32(1.0) + cute.math.tanh(inner))
        if cutlass.const_expr(self.has_row_scale):
            v = v * row_scale[row].to(cutlass.Float32)
        return v


class Sm100GroupedGemm(GroupedParts, Sm100Gemm):
    """The grouped GEMM for sm_100a; `activation` one of ACTIVATIONS, bias / row_scale optional."""

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, group_sizes: cute.Tensor,
                 bias: cute.Tensor, row_scale: cute.Tensor, stream):
        self._configure(x, w, y)
        tma_a, ta = self.tma_a(x, self.sa_layout)
        tma_b, tb = self.tma_b(w, self.sb_layout)
        experts = cute.size(group_sizes)
        grid = (cute.ceil_div(y.shape[0], self.tile[0]) + experts, cute.ceil_div(y.shape[1], self.tile[1]), 1)
        self.kernel(self.mma, tma_a, ta, tma_b, tb, y, self.cluster, self.sa_layout, self.sb_layout,
                    group_sizes, bias, row_scale).launch(grid=grid, block=[self.threads, 1, 1],
                                                         cluster=(1, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, ma: cute.Tensor, tma_b: cute.CopyAtom,
               mb: cute.Tensor, mc: cute.Tensor, cluster: cute.Layout, sa_layout: cute.ComposedLayout,
               sb_layout: cute.ComposedLayout, group_sizes: cute.Tensor, bias: cute.Tensor,
               row_scale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bm, bn, _ = cute.arch.block_idx()
        # this CTA's expert and first row: walk the work list (tiles of expert 0, then 1, ...)
        expert, row0, row_end = self.find_tile(bm, group_sizes)
        if expert >= 0:
            self.tile_body(mma, tma_a, ma, tma_b, mb, mc, cluster, sa_layout, sb_layout, bias, row_scale,
                           tidx, warp, bn, expert, row0, row_end)

    @cute.jit
    def tile_body(self, mma, tma_a, ma, tma_b, mb, mc, cluster, sa_layout, sb_layout, bias, row_scale,
                  tidx, warp, bn, expert, row0, row_end):
        """One output tile: rows row0.. of expert `expert`, columns of tile `bn`."""
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        _, loads, mmas, acc_ready, tmem, sa, sb = self.shared_stages(cluster, sa_layout, sb_layout)

        thr = mma.get_slice(0)
        # A: the tile's rows start at row0, anywhere (TMA coordinates are elements)
        ga = thr.partition_A(cute.local_tile(cute.domain_offset((row0, 0, 0), ma),
                                             cute.slice_(self.tile, (None, 0, None)), (0, None, 0)))
        gb = thr.partition_B(cute.local_tile(mb, cute.slice_(self.tile, (0, None, None)), (bn, None, expert)))
        tiler_mn = cute.slice_(self.tile, (None, None, 0))
        gc = thr.partition_C(cute.local_tile(cute.domain_offset((row0, 0, 0), mc), tiler_mn, (0, bn, 0)))
        cc = thr.partition_C(cute.local_tile(cute.domain_offset((row0, 0, 0), cute.make_identity_tensor(mc.shape)),
                                             tiler_mn, (0, bn, 0)))
        tsa, tga = tma_split(tma_a, sa, ga, 3)
        tsb, tgb = tma_split(tma_b, sb, gb, 3)
        ra = mma.make_fragment_A(sa)
        rb = mma.make_fragment_B(sb)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.tile[:2])).layout
        k_tiles = cute.size(tga, mode=[1])
        tmem_ptr, acc = self.tmem_accumulator(tmem, cluster, acc_layout)

        if warp == 0:
            self.mainloop(mma, acc, ra, rb, loads, mmas, k_tiles, tma_a, tga, tsa, tma_b, tgb, tsb)
            self.acc_ready_commit(acc_ready)
        self.store_and_free(tidx, acc, tmem, tmem_ptr, acc_ready, gc, cc, ((None, None), 0, 0), self.store_grouped,
                            (row_end, mc.shape[1], expert, bias, row_scale))
        if warp == 0:
            loads.tail()

    @cute.jit
    def store_grouped(self, value, coord, out, i, extra):
        """The grouped epilogue on one element, stored inside the expert's rows and N."""
        row_end, n, expert, bias, row_scale = extra
        row, col, _ = coord
        if row < row_end:
            if col < n:
                out[i] = self.epilogue_value(value, row, col, expert, bias, row_scale).to(self.c_dtype)
