"""kiln's grouped GEMM for mixture-of-experts layers on Hopper (sm_90a): the persistent,
warp-specialized wgmma kernel of sm90_gemm.py walking the MoE work list.

The work list is grouped_gemm.py's: row tiles expert by expert (each expert's first row
anywhere: TMA addresses rows by element), times the column tiles. Its length depends on
group_sizes, which stay on the device, so the persistent CTAs stride over an upper bound
((ceil(T / BM) + E) row tiles) and skip the tiles past the end; producer and consumers
walk the list identically, so the shared-memory ring stays in step. The epilogue is the
grouped one (alpha, bias per expert, activation, router row scale), applied to the
accumulator registers; the store goes straight from registers to global memory, masked
to the expert's rows (a TMA store would clip only at T and overwrite the next expert).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from kiln.codegen.cute.builders import tma_split
from kiln.codegen.cute.grouped_gemm import GroupedParts
from kiln.codegen.cute.sm90_gemm import Sm90Gemm


class Sm90GroupedGemm(GroupedParts, Sm90Gemm):
    """The grouped GEMM for sm_90a; same arguments as Sm100GroupedGemm."""

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, group_sizes: cute.Tensor,
                 bias: cute.Tensor, row_scale: cute.Tensor, max_ctas: cutlass.Constexpr, stream):
        self._configure(x, w, y)
        tma_a, ta, tma_b, tb = self.tma_loads(x, w)
        rows_upper = cute.ceil_div(y.shape[0], self.tile[0]) + cute.size(group_sizes)
        work = rows_upper * cute.ceil_div(y.shape[1], self.tile[1])

        @cute.struct
        class Shared:
            barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.sa_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.sb_layout)], 1024]

        self.shared = Shared
        self.kernel(tma_a, ta, tma_b, tb, y, self.mma, self.sa_layout, self.sb_layout, group_sizes, bias,
                    row_scale, rows_upper, work).launch(
            grid=[cutlass.min(work, max_ctas), 1, 1], block=[self.threads, 1, 1], cluster=(1, 1, 1),
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, ma: cute.Tensor, tma_b: cute.CopyAtom, mb: cute.Tensor,
               mc: cute.Tensor, mma: cute.TiledMma, sa_layout: cute.ComposedLayout,
               sb_layout: cute.ComposedLayout, group_sizes: cute.Tensor, bias: cute.Tensor,
               row_scale: cute.Tensor, rows_upper, work):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared)
        ring, sa, sb = self.ring(storage, sa_layout, sb_layout)
        a_tile, b_tile = (self.tile[0], self.tile[2]), (self.tile[1], self.tile[2])
        c_tile = (self.tile[0], self.tile[1])
        k_tiles = cute.size(cute.local_tile(ma, a_tile, (0, None, 0)), mode=[2])
        group = cute.arch.make_warp_uniform(tidx // 128)
        first, _, _ = cute.arch.block_idx()
        stride, _, _ = cute.arch.grid_dim()
        if group == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                for t in cutlass.range(first, work, stride):
                    expert, row0, _ = self.find_tile(t % rows_upper, group_sizes)
                    if expert >= 0:
                        ga = cute.local_tile(cute.domain_offset((row0, 0, 0), ma), a_tile, (0, None, 0))
                        gb = cute.local_tile(mb, b_tile, (t // rows_upper, None, expert))
                        tsa, tga = tma_split(tma_a, sa, ga, 2)
                        tsb, tgb = tma_split(tma_b, sb, gb, 2)
                        state.reset_count()
                        for _k in range(k_tiles):
                            ring.producer_acquire(state)
                            bar = ring.producer_get_barrier(state)
                            cute.copy(tma_a, tga[(None, state.count)], tsa[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_b, tgb[(None, state.count)], tsb[(None, state.index)], tma_bar_ptr=bar)
                            ring.producer_commit(state)
                            state.advance()
                ring.producer_tail(state)
        else:
            thr, ra, rb, acc = self.consumer_fragments(
                mma, group, sa, sb, lambda thr: thr.partition_C(cute.local_tile(mc, c_tile, (0, 0, 0))).shape)
            read, release = self.consumer_states()
            for t in cutlass.range(first, work, stride):
                expert, row0, row_end = self.find_tile(t % rows_upper, group_sizes)
                if expert >= 0:
                    bn = t // rows_upper
                    mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    self.consume_tile(mma, acc, ra, rb, ring, read, release, k_tiles)
                    # the epilogue, stored from registers under the expert's row mask
                    out = thr.partition_C(cute.local_tile(cute.domain_offset((row0, 0, 0), mc), c_tile, (0, bn, 0)))
                    coords = thr.partition_C(cute.local_tile(
                        cute.domain_offset((row0, 0, 0), cute.make_identity_tensor(mc.shape)), c_tile, (0, bn, 0)))
                    for i in cutlass.range(cute.size(acc), unroll_full=True):
                        row, col, _ = coords[i]
                        if row < row_end:
                            if col < mc.shape[1]:
                                out[i] = self.epilogue_value(acc[i], row, col, expert, bias, row_scale).to(self.c_dtype)
