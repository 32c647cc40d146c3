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
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.blackwell_helpers as sm100
from cutlass.cute.nvgpu import cpasync, tcgen05


class Sm100Gemm:
    """C = epilogue(A @ B) on Blackwell; `epilogue(acc, coord, operands, sizes, c_shape)` -> Float32."""

    def __init__(self, tile_mn: tuple[int, int], epilogue: Callable, acc_dtype=cutlass.Float32):
        if tile_mn[0] not in (64, 128) or tile_mn[1] % 32 or not 32 <= tile_mn[1] <= 256:
            raise ValueError(f"sm100 GEMM tile {tile_mn}: M must be 64/128, N a multiple of 32 in 32..256")
        self.tile_mn = tile_mn
        self.epilogue = epilogue
        self.acc_dtype = acc_dtype
        self.threads = 128

    def _configure(self, a, b, c):
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        a_mode = tensor_utils.LayoutEnum.from_tensor(a).mma_major_mode()
        b_mode = tensor_utils.LayoutEnum.from_tensor(b).mma_major_mode()
        self.c_major = tensor_utils.LayoutEnum.from_tensor(c)
        self.mma = sm100.make_trivial_tiled_mma(self.a_dtype, self.b_dtype, a_mode, b_mode, self.acc_dtype,
                                                tcgen05.CtaGroup.ONE, self.tile_mn)
        self.tile = (*self.tile_mn, 4 * cute.size(self.mma.shape_mnk, mode=[2]))
        self.cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (self.mma.thr_id.shape,))
        # the epilogue reads TMEM in column slices, so the registers hold one slice at a time
        self.epi_tile = (self.tile[0], min(32, self.tile[1]))
        one_a = sm100.make_smem_layout_a(self.mma, self.tile, self.a_dtype, 1)
        one_b = sm100.make_smem_layout_b(self.mma, self.tile, self.b_dtype, 1)
        stage_bytes = cute.size_in_bytes(self.a_dtype, one_a) + cute.size_in_bytes(self.b_dtype, one_b)
        self.stages = (cutlass.memory.get_smem_capacity_in_bytes("sm_100") - 1024) // stage_bytes
        self.sa_layout = sm100.make_smem_layout_a(self.mma, self.tile, self.a_dtype, self.stages)
        self.sb_layout = sm100.make_smem_layout_b(self.mma, self.tile, self.b_dtype, self.stages)
        self.load_bytes = stage_bytes
        self.tmem_cols = cutlass.memory.get_num_tmem_alloc_cols(
            self.mma.make_fragment_C(self.mma.partition_shape_C(self.tile[:2])))

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, operands, sizes,
                 max_ctas: cutlass.Constexpr, stream):
        self._configure(a, b, c)
        tma_a, ta = cute.nvgpu.make_tiled_tma_atom_A(
            sm100.cluster_shape_to_tma_atom_A((1, 1), self.mma.thr_id), a,
            cute.slice_(self.sa_layout, (None, None, None, 0)), self.tile, self.mma, self.cluster.shape)
        tma_b, tb = cute.nvgpu.make_tiled_tma_atom_B(
            sm100.cluster_shape_to_tma_atom_B((1, 1), self.mma.thr_id), b,
            cute.slice_(self.sb_layout, (None, None, None, 0)), self.tile, self.mma, self.cluster.shape)
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

        @cute.struct
        class Shared:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_address: cutlass.Int32

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Shared)
        loads, mmas, acc_ready, tmem = self.pipelines(storage, cluster)
        sa = smem.allocate_tensor(element_type=self.a_dtype, layout=sa_layout.outer, byte_alignment=128,
                                  swizzle=sa_layout.inner)
        sb = smem.allocate_tensor(element_type=self.b_dtype, layout=sb_layout.outer, byte_alignment=128,
                                  swizzle=sb_layout.inner)

        thr = mma.get_slice(0)
        ga = thr.partition_A(cute.local_tile(ma, cute.slice_(self.tile, (None, 0, None)), (None, None, None)))
        gb = thr.partition_B(cute.local_tile(mb, cute.slice_(self.tile, (0, None, None)), (None, None, None)))
        tiler_mn = cute.slice_(self.tile, (None, None, 0))
        gc = thr.partition_C(cute.local_tile(mc, tiler_mn, (None, None, None)))
        cc = thr.partition_C(cute.local_tile(cute.make_identity_tensor(mc.shape), tiler_mn, (None, None, None)))
        one = cute.make_layout(1)
        tsa, tga = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sa, 0, 3), cute.group_modes(ga, 0, 3))
        tsb, tgb = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sb, 0, 3), cute.group_modes(gb, 0, 3))
        tga = tga[(None, bm, None, bl)]
        tgb = tgb[(None, bn, None, bl)]
        ra = mma.make_fragment_A(sa)
        rb = mma.make_fragment_B(sb)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.tile[:2])).layout
        k_tiles = cute.size(ga, mode=[3])
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster)

        tmem.allocate(self.tmem_cols)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        acc = cute.make_tensor(tmem_ptr, acc_layout)

        if warp == 0:
            self.mainloop(mma, acc, ra, rb, loads, mmas, k_tiles, tma_a, tga, tsa, tma_b, tgb, tsb)
            acc_ready.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))
        tmem.relinquish_alloc_permit()
        acc_ready.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        # the epilogue: TMEM -> registers (a column slice at a time) -> kiln's epilogue -> global
        self.epilogue_slices(tidx, acc, gc[((None, None), 0, 0, bm, bn, bl)], cc[((None, None), 0, 0, bm, bn, bl)],
                             self.store_element, (operands, sizes, mc.shape))
        pipeline.sync(barrier_id=1)
        tmem.free(tmem_ptr)
        if warp == 0:
            loads.tail()

    @cute.jit
    def mainloop(self, mma, acc, ra, rb, loads, mmas, k_tiles, tma_a, tga, tsa, tma_b, tgb, tsb):
        """Warp 0's loop: TMA runs `ahead` stages in front of the tensor core, which
        accumulates every k-slice into `acc` (tensor memory) and frees its stage."""
        ahead = cutlass.min(self.stages - 1, k_tiles)
        for kt in cutlass.range(ahead, unroll=1):
            slot = loads.acquire_and_advance()
            cute.copy(tma_a, tga[(None, kt)], tsa[(None, slot.index)], tma_bar_ptr=slot.barrier)
            cute.copy(tma_b, tgb[(None, kt)], tsb[(None, slot.index)], tma_bar_ptr=slot.barrier)
        mma.set(tcgen05.Field.ACCUMULATE, False)
        for kt in cutlass.range(k_tiles, unroll=1):
            if kt + ahead < k_tiles:
                slot = loads.acquire_and_advance()
                cute.copy(tma_a, tga[(None, slot.count)], tsa[(None, slot.index)], tma_bar_ptr=slot.barrier)
                cute.copy(tma_b, tgb[(None, slot.count)], tsb[(None, slot.index)], tma_bar_ptr=slot.barrier)
            ready = mmas.wait_and_advance()
            for kb in cutlass.range(cute.size(ra, mode=[2]), unroll_full=True):
                cute.gemm(mma, acc, ra[(None, None, kb, ready.index)], rb[(None, None, kb, ready.index)], acc)
                mma.set(tcgen05.Field.ACCUMULATE, True)
            ready.release()

    def pipelines(self, storage, cluster) -> tuple:
        """(loads, mmas, acc_ready, tmem): the TMA -> tensor-core ring of `self.stages`, the
        accumulator-ready barrier the epilogue waits on, and the TMEM allocator."""
        loads, mmas = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.load_bytes, cta_layout_vmnk=cluster, defer_sync=True).make_participants()
        acc_ready = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads),
            cta_layout_vmnk=cluster, defer_sync=True)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_address.ptr, barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=2, num_threads=self.threads))
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster, is_relaxed=True)
        return loads, mmas, acc_ready, tmem

    @cute.jit
    def epilogue_slices(self, tidx, acc, g_tile, c_tile, store: cutlass.Constexpr, extra):
        """The accumulator out of TMEM a column slice at a time; `store(value, coord, out, i,
        extra)` writes element i of each slice (its epilogue and its mask)."""
        t2r_atom = sm100.get_tmem_load_op(self.tile, self.c_major, self.c_dtype, self.acc_dtype, self.epi_tile, False)
        acc_slices = cute.flat_divide(acc[((None, None), 0, 0)], self.epi_tile)
        t2r = tcgen05.make_tmem_copy(t2r_atom, acc_slices[(None, None, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        t_acc = cute.group_modes(thr_t2r.partition_S(acc_slices), 3, 5)
        t_gc = cute.group_modes(thr_t2r.partition_D(cute.flat_divide(g_tile, self.epi_tile)), 3, 5)
        t_cc = cute.group_modes(thr_t2r.partition_D(cute.flat_divide(c_tile, self.epi_tile)), 3, 5)
        r_acc = cute.make_rmem_tensor(t_gc[(None, None, None, 0)].shape, self.acc_dtype)
        for s in cutlass.range(cute.size(t_acc.shape, mode=[3])):
            cute.copy(t2r, t_acc[(None, None, None, s)], r_acc)
            g_slice = t_gc[(None, None, None, s)]
            c_slice = t_cc[(None, None, None, s)]
            for i in cutlass.range(cute.size(r_acc), unroll_full=True):
                store(r_acc[i], c_slice[i], g_slice, i, extra)

    @cute.jit
    def store_element(self, value, coord, out, i, extra):
        """kiln's epilogue on one accumulator element, stored where it is inside C."""
        operands, sizes, c_shape = extra
        result = self.epilogue(value, coord, operands, sizes, c_shape)
        if cute.elem_less(coord, c_shape):
            out[i] = result.to(self.c_dtype)
