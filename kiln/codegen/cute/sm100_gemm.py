"""kiln's Blackwell (sm_100a) GEMM in CuTeDSL: TMA loads, tcgen05 MMA into tensor memory.

One CTA of four warps computes one output tile. Warp 0 runs the main loop: it keeps
the shared-memory ring of A/B k-slices full with TMA loads (an mbarrier pipeline
between TMA and the tensor core) and issues `tcgen05.mma` on each stage as it lands,
accumulating in tensor memory (TMEM, allocated per CTA). When the last MMA is
committed, all four warps read the accumulator out of TMEM in sub-tiles
(`tcgen05.ld`), apply kiln's epilogue (epilogue.py) to each float32 element with its
(row, col, batch) coordinate, and store the result; rows and columns past M and N are
masked. A is (M, K, L), B (N, K, L), C (M, N, L), as in sm90_gemm.py.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kiln.codegen.cute.builders import Sm100Tiles, tma_split


class Sm100Gemm(Sm100Tiles):
    """C = epilogue(A @ B) on Blackwell; `epilogue(acc, coord, operands, sizes, c_shape)` -> Float32."""

    def __init__(self, tile_mn: tuple[int, int], epilogue: Callable, acc_dtype=cutlass.Float32):
        if tile_mn[0] not in (64, 128) or tile_mn[1] % 32 or not 32 <= tile_mn[1] <= 256:
            raise ValueError(f"sm100 GEMM tile {tile_mn}: M must be 64/128, N a multiple of 32 in 32..256")
        self.tile_mn = tile_mn
        self.epilogue = epilogue
        self.acc_dtype = acc_dtype
        self.threads = 128

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, operands, sizes,
                 max_ctas: cutlass.Constexpr, stream):
        self._configure(a, b, c)
        tma_a, ta = self.tma_a(a, self.sa_layout)
        tma_b, tb = self.tma_b(b, self.sb_layout)
        grid = (cute.ceil_div(c.shape[0], self.tile[0]), cute.ceil_div(c.shape[1], self.tile[1]), c.shape[2])
        self.kernel(self.mma, tma_a, ta, tma_b, tb, c, self.cluster, self.sa_layout, self.sb_layout,
                    operands, sizes).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1),
                                            stream=stream)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, ma: cute.Tensor, tma_b: cute.CopyAtom,
               mb: cute.Tensor, mc: cute.Tensor, cluster: cute.Layout, sa_layout: cute.ComposedLayout,
               sb_layout: cute.ComposedLayout, operands, sizes):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bm, bn, bl = cute.arch.block_idx()
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        _, loads, mmas, acc_ready, tmem, sa, sb = self.shared_stages(cluster, sa_layout, sb_layout)

        thr = mma.get_slice(0)
        ga = thr.partition_A(cute.local_tile(ma, cute.slice_(self.tile, (None, 0, None)), (None, None, None)))
        gb = thr.partition_B(cute.local_tile(mb, cute.slice_(self.tile, (0, None, None)), (None, None, None)))
        tiler_mn = cute.slice_(self.tile, (None, None, 0))
        gc = thr.partition_C(cute.local_tile(mc, tiler_mn, (None, None, None)))
        cc = thr.partition_C(cute.local_tile(cute.make_identity_tensor(mc.shape), tiler_mn, (None, None, None)))
        tsa, tga = tma_split(tma_a, sa, ga, 3)
        tsb, tgb = tma_split(tma_b, sb, gb, 3)
        tga = tga[(None, bm, None, bl)]
        tgb = tgb[(None, bn, None, bl)]
        ra = mma.make_fragment_A(sa)
        rb = mma.make_fragment_B(sb)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.tile[:2])).layout
        k_tiles = cute.size(ga, mode=[3])
        tmem_ptr, acc = self.tmem_accumulator(tmem, cluster, acc_layout)

        if warp == 0:
            self.mainloop(mma, acc, ra, rb, loads, mmas, k_tiles, tma_a, tga, tsa, tma_b, tgb, tsb)
            self.acc_ready_commit(acc_ready)
        # the epilogue: TMEM -> registers (a column slice at a time) -> kiln's epilogue -> global
        self.store_and_free(tidx, acc, tmem, tmem_ptr, acc_ready, gc, cc, ((None, None), 0, 0, bm, bn, bl),
                            self.store_element, (operands, sizes, mc.shape))
        if warp == 0:
            loads.tail()

    @cute.jit
    def store_element(self, value, coord, out, i, extra):
        """kiln's epilogue on one accumulator element, stored where it is inside C."""
        operands, sizes, c_shape = extra
        result = self.epilogue(value, coord, operands, sizes, c_shape)
        if cute.elem_less(coord, c_shape):
            out[i] = result.to(self.c_dtype)
