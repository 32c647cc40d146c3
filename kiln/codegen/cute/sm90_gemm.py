"""kiln's Hopper (sm_90a) GEMM in CuTeDSL: persistent, warp-specialized, wgmma + TMA.

One CTA per SM walks the output tiles of every batch (a static persistent schedule).
Warp group 0 is the producer: one warp issues TMA loads of A and B k-slices into a ring
of shared-memory stages, each guarded by an mbarrier pipeline. The other warp groups
are consumers: they wait for a stage, issue `wgmma.mma_async` over it, keep one wgmma
group in flight and release the stage behind it. When a tile's K loop ends, each
consumer thread applies kiln's epilogue (a Python callable made from the Kernel IR
expression, see epilogue.py) to its accumulator registers, element by element with the
element's (row, column, batch) coordinate, then writes the tile through shared memory
and a TMA store in sub-tiles (the TMA store clips rows and columns past M and N).

Layouts: A is (M, K, L), B is (N, K, L), C is (M, N, L); each may be K- or M/N-major
(16-bit types) as its strides say. This file is the kernel only; compile.py builds the
fake tensors and compiles it ahead of time.
"""

from __future__ import annotations

import math
from typing import Callable

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90

from kiln.codegen.cute.builders import Sm90Tiles, tma_split


class Sm90Gemm(Sm90Tiles):
    """C = epilogue(A @ B) on Hopper; `epilogue(acc, coord, operands, sizes)` -> Float32."""

    def __init__(self, tile_mn: tuple[int, int], epilogue: Callable, acc_dtype=cutlass.Float32):
        if tile_mn[0] not in (64, 128) or tile_mn[1] not in (64, 128, 256):
            raise ValueError(f"sm90 GEMM tile {tile_mn}: M must be 64/128, N 64/128/256")
        self.tile_mn = tile_mn
        self.epilogue = epilogue
        self.acc_dtype = acc_dtype
        # two consumer warp groups split a wide 128-row tile; otherwise one does it all
        self.atom_layout = (2, 1, 1) if tile_mn[0] == 128 and tile_mn[1] > 128 else (1, 1, 1)
        self.consumer_groups = math.prod(self.atom_layout)
        self.threads = (1 + self.consumer_groups) * 128
        self.producer_regs, self.consumer_regs = 40, 232
        self.smem_bytes = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.consumer_groups * 128)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, operands, sizes,
                 max_ctas: cutlass.Constexpr, stream):
        self._configure(a, b, c)
        tma_a, ta, tma_b, tb = self.tma_loads(a, b)
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(self.sc_layout, (None, None, 0)),
            self.epi_tile)
        tiles_mnl = cute.zipped_divide(c, tiler=(self.tile[0], self.tile[1]))[(0, (None, None, None))].shape
        # persistent: at most one CTA per SM, each striding over the linear tile index
        grid = [cutlass.min(cute.size(tiles_mnl), max_ctas), 1, 1]

        @cute.struct
        class Shared:
            barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.sa_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.sb_layout)], 1024]
            sc: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.sc_layout)], 1024]

        self.shared = Shared
        self.kernel(tma_a, ta, tma_b, tb, tma_c, tc, self.mma, self.sa_layout, self.sb_layout, self.sc_layout,
                    c.shape, operands, sizes, tiles_mnl).launch(
            grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream)

    @cute.jit
    def tile_coord(self, t, tiles_mnl):
        """(m, n, batch) of linear tile `t`: m fastest, so CTAs running together share B panels."""
        return t % tiles_mnl[0], (t // tiles_mnl[0]) % tiles_mnl[1], t // (tiles_mnl[0] * tiles_mnl[1])

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, ma: cute.Tensor, tma_b: cute.CopyAtom, mb: cute.Tensor,
               tma_c: cute.CopyAtom, mc: cute.Tensor, mma: cute.TiledMma, sa_layout: cute.ComposedLayout,
               sb_layout: cute.ComposedLayout, sc_layout: cute.ComposedLayout, c_shape, operands, sizes,
               tiles_mnl):
        # layouts and the tiled MMA made on the host arrive as arguments (a kernel is its own region)
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared)
        ring, sa, sb = self.ring(storage, sa_layout, sb_layout)
        sc = storage.sc.get_tensor(sc_layout.outer, swizzle=sc_layout.inner)

        # every tile of A (m, k, l), B (n, k, l) and C (m, n, l), and its TMA view
        ga = cute.local_tile(ma, (self.tile[0], self.tile[2]), (None, None, None))
        gb = cute.local_tile(mb, (self.tile[1], self.tile[2]), (None, None, None))
        gc = cute.local_tile(mc, (self.tile[0], self.tile[1]), (None, None, None))
        tsa, tga = tma_split(tma_a, sa, ga, 2)
        tsb, tgb = tma_split(tma_b, sb, gb, 2)
        k_tiles = cute.size(ga, mode=[3])

        group = cute.arch.make_warp_uniform(tidx // 128)
        first_tile, _, _ = cute.arch.block_idx()
        tile_stride, _, _ = cute.arch.grid_dim()
        tile_count = cute.size(tiles_mnl)
        if group == 0:
            # the producer: TMA loads into the ring, one stage per k-slice
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                for t in cutlass.range(first_tile, tile_count, tile_stride):
                    m, n, l = self.tile_coord(t, tiles_mnl)
                    state.reset_count()
                    for _k in range(k_tiles):
                        ring.producer_acquire(state)
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_a, tga[(None, m, state.count, l)], tsa[(None, state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tgb[(None, n, state.count, l)], tsb[(None, state.index)], tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                ring.producer_tail(state)
        else:
            # the consumers: wgmma over the ring, the epilogue, the TMA store
            thr, ra, rb, acc = self.consumer_fragments(mma, group, sa, sb, lambda thr: thr.partition_C(gc).shape[:3])
            # the (row, col, batch) of every accumulator element: an identity tensor tiled like C
            coords = thr.partition_C(cute.local_tile(cute.make_identity_tensor(c_shape),
                                                     (self.tile[0], self.tile[1]), (None, None, None)))
            read, release = self.consumer_states()

            ctid = tidx - 128
            store_atom = sm90.get_smem_store_op(self.c_major, self.c_dtype, self.acc_dtype)
            stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_major.is_m_major_c(), 4),
                                           self.c_dtype)
            r2s = cute.make_tiled_copy_S(store_atom, cute.make_tiled_copy_C_atom(stmatrix, mma))
            thr_r2s = r2s.get_slice(ctid)
            dst = thr_r2s.partition_D(sc)
            src_acc = r2s.retile(acc)
            piece_shape = cute.shape(thr_r2s.partition_S(sc))[:3]
            piece = cute.make_rmem_tensor(piece_shape, self.acc_dtype)
            piece_out = cute.make_rmem_tensor(piece_shape, self.c_dtype)
            piece_len = cute.size(piece)
            stores = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_groups * 128))

            done = cutlass.Int32(0)  # tiles this CTA finished: picks the epilogue buffers
            for t in cutlass.range(first_tile, tile_count, tile_stride):
                m, n, l = self.tile_coord(t, tiles_mnl)
                mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                self.consume_tile(mma, acc, ra, rb, ring, read, release, k_tiles)

                # kiln's epilogue on the accumulators, before anything is stored
                tile_coords = coords[(None, None, None, m, n, l)]
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    acc[i] = self.epilogue(acc[i], tile_coords[i], operands, sizes, c_shape)

                # registers -> shared (epilogue sub-tiles) -> TMA store
                g_tile = cute.zipped_divide(gc[(None, None, m, n, l)], self.epi_tile)
                ssc, gsc = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sc, 0, 2), g_tile)
                pieces = cute.size(g_tile, mode=[1])
                order = cute.make_layout(g_tile.shape[1], stride=(g_tile.shape[1][1], 1))
                done_before = done * pieces
                for p in cutlass.range_constexpr(pieces):
                    for v in cutlass.range_constexpr(piece_len):
                        piece[v] = src_acc[p * piece_len + v]
                    piece_out.store(piece.load().to(self.c_dtype))
                    buf = (done_before + p) % self.epi_stages
                    cute.copy(r2s, piece_out, dst[(None, None, None, buf)])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.epi_barrier.arrive_and_wait()
                    if warp == 4:
                        cute.copy(tma_c, ssc[(None, buf)], gsc[(None, order.get_hier_coord(p))])
                        stores.producer_commit()
                        stores.producer_acquire()
                    self.epi_barrier.arrive_and_wait()
                done += 1
            stores.producer_tail()
