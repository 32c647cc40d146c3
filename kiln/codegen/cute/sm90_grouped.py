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

from kiln.codegen.cute.grouped_gemm import GroupedParts
from kiln.codegen.cute.sm90_gemm import Sm90Gemm


class Sm90GroupedGemm(GroupedParts, Sm90Gemm):
    """The grouped GEMM for sm_90a; same arguments as Sm100GroupedGemm."""

    def __init__(self, tile_mn: tuple[int, int], activation: str = "none", alpha: float = 1.0,
                 has_bias: bool = False, has_row_scale: bool = False):
        super().__init__(tile_mn, None)
        self._options(activation, alpha, has_bias, has_row_scale)

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, group_sizes: cute.Tensor,
                 bias: cute.Tensor, row_scale: cute.Tensor, max_ctas: cutlass.Constexpr, stream):
        self._configure(x, w, y)
        load = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, x, cute.slice_(self.sa_layout, (None, None, 0)), (self.tile[0], self.tile[2]))
        tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, w, cute.slice_(self.sb_layout, (None, None, 0)), (self.tile[1], self.tile[2]))
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
        stage_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(sa_layout, (None, None, 0)))
                       + cute.size_in_bytes(self.b_dtype, cute.slice_(sb_layout, (None, None, 0))))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_groups * 4),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sa = storage.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sb = storage.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        a_tile, b_tile = (self.tile[0], self.tile[2]), (self.tile[1], self.tile[2])
        c_tile = (self.tile[0], self.tile[1])
        k_tiles = cute.size(cute.local_tile(ma, a_tile, (0, None, 0)), mode=[2])
        one = cute.make_layout(1)
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
                        tsa, tga = cute.nvgpu.cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sa, 0, 2),
                                                                    cute.group_modes(ga, 0, 2))
                        tsb, tgb = cute.nvgpu.cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sb, 0, 2),
                                                                    cute.group_modes(gb, 0, 2))
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
            cute.arch.setmaxregister_increase(self.consumer_regs)
            thr = mma.get_slice(cute.make_layout(self.consumer_groups, stride=128)(group - 1))
            ra = mma.make_fragment_A(thr.partition_A(sa))
            rb = mma.make_fragment_B(thr.partition_B(sb))
            acc = cute.make_rmem_tensor(thr.partition_C(cute.local_tile(mc, c_tile, (0, 0, 0))).shape, self.acc_dtype)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
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
