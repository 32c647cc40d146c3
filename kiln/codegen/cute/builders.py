"""The tile and pipeline setup that kiln's CuTeDSL GEMM kernels share.

Each kernel file (sm90_gemm.py, sm90_grouped.py, sm100_gemm.py, grouped_gemm.py,
sm100_blockscaled.py) keeps only what is its own: its arguments, its tile schedule and
its epilogue. What they all build the same way lives here, in two mixins:

    Sm90Tiles    Hopper: the tiled wgmma, stage count and shared-memory layouts from the
                 operands; the TMA load atoms; the TMA -> wgmma ring and its stages; the
                 producer's k-loop; the consumers' fragments and their k-loop.
    Sm100Tiles   Blackwell: the tiled tcgen05 MMA and layouts; the TMA atoms; the shared
                 storage (barriers, TMEM address, A/B stages) and its pipelines; the
                 TMEM accumulator; warp 0's TMA + MMA main loop; the epilogue read out of
                 TMEM a column slice at a time and the teardown after it.

The helpers are traced inline into the caller's kernel (CuTeDSL names a kernel by its
module and class, never a helper), so moving code here leaves the PTX byte for byte as it
was: tests/codegen/cute/test_builders.py holds the PTX hashes of every kernel kind.
Plain methods run on the host side of the trace (no control flow of their own); the
`@cute.jit` ones hold loops and branches that run on the device.
"""

# no `from __future__ import annotations`: cute.struct reads its fields' annotations as objects
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, tcgen05


def tma_split(atom, smem, gmem, modes: int):
    """(smem, gmem) partitions of a TMA copy: the first `modes` modes of each are one box."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, modes),
                                 cute.group_modes(gmem, 0, modes))


class Sm90Tiles:
    """Hopper building blocks; the class sets tile_mn, atom_layout, consumer_groups,
    acc_dtype, smem_bytes, producer_regs and consumer_regs."""

    def _configure(self, a, b, c):
        """The tiled wgmma, CTA tile (K: four wgmma k-steps), epilogue tile, stage count and
        shared-memory layouts of A, B and C for these operands."""
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        self.a_major = tensor_utils.LayoutEnum.from_tensor(a)
        self.b_major = tensor_utils.LayoutEnum.from_tensor(b)
        self.c_major = tensor_utils.LayoutEnum.from_tensor(c)
        self.mma = sm90.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, self.a_major.sm90_mma_major_mode(), self.b_major.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout, tiler_mn=(64, self.tile_mn[1]))
        # four wgmma k-steps per pipeline stage (64 elements of 16 bits, 128 of 8)
        k_step = cute.size(self.mma.shape_mnk, mode=[2])
        self.tile = (self.tile_mn[0], self.tile_mn[1], 4 * k_step)
        self.epi_tile = sm90.compute_tile_shape_or_override(
            self.tile, self.c_dtype, is_cooperative=self.consumer_groups == 2)
        self.epi_stages = 4
        ab_bytes = (self.tile[0] * self.tile[2] * self.a_dtype.width
                    + self.tile[1] * self.tile[2] * self.b_dtype.width) // 8
        epi_bytes = self.epi_stages * self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8
        self.ab_stages = (self.smem_bytes - 1024 - epi_bytes) // ab_bytes
        self.sa_layout = sm90.make_smem_layout_a(self.a_major, self.tile, self.a_dtype, self.ab_stages)
        self.sb_layout = sm90.make_smem_layout_b(self.b_major, self.tile, self.b_dtype, self.ab_stages)
        self.sc_layout = sm90.make_smem_layout_epi(self.c_dtype, self.c_major, self.epi_tile, self.epi_stages)

    def tma_loads(self, a, b) -> tuple:
        """(tma_a, a's TMA view, tma_b, b's TMA view): one stage's A and B boxes."""
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, ta = cpasync.make_tiled_tma_atom(
            load, a, cute.slice_(self.sa_layout, (None, None, 0)), (self.tile[0], self.tile[2]))
        tma_b, tb = cpasync.make_tiled_tma_atom(
            load, b, cute.slice_(self.sb_layout, (None, None, 0)), (self.tile[1], self.tile[2]))
        return tma_a, ta, tma_b, tb

    def ring(self, storage, sa_layout, sb_layout) -> tuple:
        """(ring, sa, sb): the TMA -> wgmma pipeline over `self.ab_stages` stages of A and B in
        `storage` (a struct with `barriers`, `sa` and `sb`)."""
        stage_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(sa_layout, (None, None, 0)))
                       + cute.size_in_bytes(self.b_dtype, cute.slice_(sb_layout, (None, None, 0))))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_groups * 4),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sa = storage.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sb = storage.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        return ring, sa, sb

    def consumer_fragments(self, mma, group, sa, sb, acc_shape) -> tuple:
        """(thr, ra, rb, acc) of consumer warp group `group` (1..), which takes its registers
        first: its slice of the tiled MMA, its A/B fragments over the ring and an
        accumulator of shape `acc_shape(thr)`."""
        cute.arch.setmaxregister_increase(self.consumer_regs)
        thr = mma.get_slice(cute.make_layout(self.consumer_groups, stride=128)(group - 1))
        ra = mma.make_fragment_A(thr.partition_A(sa))
        rb = mma.make_fragment_B(thr.partition_B(sb))
        acc = cute.make_rmem_tensor(acc_shape(thr), self.acc_dtype)
        return thr, ra, rb, acc

    def consumer_states(self) -> tuple:
        """(read, release): the consumers' two walks over the ring."""
        return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages))

    @cute.jit
    def consume_tile(self, mma, acc, ra, rb, ring, read, release, k_tiles):
        """One tile's K loop on the consumer warp groups: wgmma over each stage of the ring,
        one wgmma group kept in flight, each stage released once its group has retired. The
        caller sets ACCUMULATE on `mma` (a rebind the tracer must see in the caller's loop)."""
        read.reset_count()
        release.reset_count()
        acc.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kt in range(k_tiles):
            ring.consumer_wait(read)
            for kb in cutlass.range_constexpr(cute.size(ra, mode=[2])):
                cute.gemm(mma, acc, ra[(None, None, kb, read.index)], rb[(None, None, kb, read.index)], acc)
            cute.nvgpu.warpgroup.commit_group()
            # keep one wgmma group in flight; the stage before it is free again
            if kt > 0:
                cute.nvgpu.warpgroup.wait_group(1)
                ring.consumer_release(release)
                release.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        if k_tiles > 0:
            ring.consumer_release(release)
            release.advance()


class Sm100Tiles:
    """Blackwell building blocks; the class sets tile_mn, acc_dtype and threads."""

    def _operands(self, a, b, c) -> tuple:
        """Record the operands' element types and C's layout; (a, b) MMA major modes."""
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        a_mode = tensor_utils.LayoutEnum.from_tensor(a).mma_major_mode()
        b_mode = tensor_utils.LayoutEnum.from_tensor(b).mma_major_mode()
        self.c_major = tensor_utils.LayoutEnum.from_tensor(c)
        return a_mode, b_mode

    def _tile_from_mma(self) -> None:
        """The CTA tile (K: four MMA k-steps) and the one-CTA cluster of `self.mma`."""
        self.tile = (*self.tile_mn, 4 * cute.size(self.mma.shape_mnk, mode=[2]))
        self.cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (self.mma.thr_id.shape,))

    def _configure(self, a, b, c):
        """The tiled tcgen05 MMA, CTA tile, stage count, A/B shared-memory layouts and TMEM
        columns for these operands."""
        a_mode, b_mode = self._operands(a, b, c)
        self.mma = sm100.make_trivial_tiled_mma(self.a_dtype, self.b_dtype, a_mode, b_mode, self.acc_dtype,
                                                tcgen05.CtaGroup.ONE, self.tile_mn)
        self._tile_from_mma()
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

    def tma_a(self, a, smem_layout, atom=None, **kw) -> tuple:
        """(atom, TMA view) of A-side tensor `a` (A or its scale factors) for one stage."""
        return cute.nvgpu.make_tiled_tma_atom_A(
            atom or sm100.cluster_shape_to_tma_atom_A((1, 1), self.mma.thr_id), a,
            cute.slice_(smem_layout, (None, None, None, 0)), self.tile, self.mma, self.cluster.shape, **kw)

    def tma_b(self, b, smem_layout, atom=None, **kw) -> tuple:
        """(atom, TMA view) of B-side tensor `b` (B or its scale factors) for one stage."""
        return cute.nvgpu.make_tiled_tma_atom_B(
            atom or sm100.cluster_shape_to_tma_atom_B((1, 1), self.mma.thr_id), b,
            cute.slice_(smem_layout, (None, None, None, 0)), self.tile, self.mma, self.cluster.shape, **kw)

    def shared_stages(self, cluster, sa_layout, sb_layout) -> tuple:
        """(smem, loads, mmas, acc_ready, tmem, sa, sb): the CTA's shared storage (barriers,
        TMEM address), its pipelines (see `pipelines`) and the A/B stage buffers; `smem`
        allocates what a kernel needs beyond that."""

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
        return smem, loads, mmas, acc_ready, tmem, sa, sb

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

    def tmem_accumulator(self, tmem, cluster, acc_layout) -> tuple:
        """(tmem_ptr, acc): once the pipelines are initialized, `self.tmem_cols` columns of
        tensor memory allocated and the accumulator laid over them."""
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster)
        tmem.allocate(self.tmem_cols)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        return tmem_ptr, cute.make_tensor(tmem_ptr, acc_layout)

    @staticmethod
    def acc_ready_commit(acc_ready) -> None:
        """Warp 0, after its last MMA: the accumulator is complete."""
        acc_ready.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))

    def store_and_free(self, tidx, acc, tmem, tmem_ptr, acc_ready, g_tiles, c_tiles, at: tuple,
                       store, extra) -> None:
        """Every warp, after the main loop: wait for the accumulator, run the epilogue over the
        tile `at` of `g_tiles` / `c_tiles` (`epilogue_slices`), and free the tensor memory.
        Warp 0 then drains the load pipeline (`loads.tail()`)."""
        tmem.relinquish_alloc_permit()
        acc_ready.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        self.epilogue_slices(tidx, acc, g_tiles[at], c_tiles[at], store, extra)
        pipeline.sync(barrier_id=1)
        tmem.free(tmem_ptr)

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
