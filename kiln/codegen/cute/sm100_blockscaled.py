"""kiln's block-scaled GEMM for Blackwell (sm_100a): NVFP4 and MXFP8 on the tensor cores.

C = epilogue((A * SFA) @ (B * SFB)) where every 16 (NVFP4: e2m1 values, e4m3 scales) or 32
(MXFP8: e4m3 values, E8M0 scales) consecutive K elements of a row of A or B share one
scale factor. The structure is sm100_gemm.py's (one CTA per output tile, warp 0 runs TMA
and the tensor core, four warps run the epilogue from tensor memory), plus the scale
factors: each pipeline stage also brings the stage's SFA/SFB tiles into shared memory by
TMA, `tcgen05.cp` moves them into tensor memory next to the accumulator, and the
`tcgen05.mma ... block_scale` instruction reads them from there.

The scale-factor tensors are in the tensor cores' blocked layout (CuTe's
`tile_atom_to_shape_SF`: 128-row x 4-block atoms), not kiln's row-major
`quantize_nvfp4` / `quantize_mxfp8` output; a GPU caller reorders them once per weight.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.blockscaled_layout as blockscaled
from cutlass.cute.nvgpu import cpasync, tcgen05

from kiln.codegen.cute.builders import tma_split
from kiln.codegen.cute.sm100_gemm import Sm100Gemm

FORMATS = {"nvfp4": 16, "mxfp8": 32}  # scale-factor vector size


class Sm100BlockScaledGemm(Sm100Gemm):
    """C = epilogue(A_deq @ B_deq); `fmt` "nvfp4" or "mxfp8"; tile (128, 128)."""

    def __init__(self, fmt: str, epilogue: Callable, tile_mn: tuple[int, int] = (128, 128)):
        if fmt not in FORMATS or tuple(tile_mn) != (128, 128):
            raise ValueError(f"block-scaled GEMM: format {fmt!r} (nvfp4, mxfp8), tile {tile_mn} (128x128)")
        super().__init__(tuple(tile_mn), epilogue)
        self.fmt, self.vec = fmt, FORMATS[fmt]

    def _configure_scaled(self, a, b, c, sf_dtype):
        a_mode, b_mode = self._operands(a, b, c)
        self.sf_dtype = sf_dtype
        self.mma = sm100.make_blockscaled_trivial_tiled_mma(self.a_dtype, self.b_dtype, a_mode, b_mode, sf_dtype,
                                                            self.vec, tcgen05.CtaGroup.ONE, self.tile_mn)
        self._tile_from_mma()
        self.epi_tile = (self.tile[0], 32)
        parts = (sm100.make_smem_layout_a(self.mma, self.tile, self.a_dtype, 1),
                 sm100.make_smem_layout_b(self.mma, self.tile, self.b_dtype, 1),
                 blockscaled.make_smem_layout_sfa(self.mma, self.tile, self.vec, 1),
                 blockscaled.make_smem_layout_sfb(self.mma, self.tile, self.vec, 1))
        kinds = (self.a_dtype, self.b_dtype, sf_dtype, sf_dtype)
        self.load_bytes = sum(cute.size_in_bytes(d, p) for d, p in zip(kinds, parts))
        self.stages = (cutlass.memory.get_smem_capacity_in_bytes("sm_100") - 2048) // self.load_bytes
        self.sa_layout = sm100.make_smem_layout_a(self.mma, self.tile, self.a_dtype, self.stages)
        self.sb_layout = sm100.make_smem_layout_b(self.mma, self.tile, self.b_dtype, self.stages)
        self.ssfa_layout = blockscaled.make_smem_layout_sfa(self.mma, self.tile, self.vec, self.stages)
        self.ssfb_layout = blockscaled.make_smem_layout_sfb(self.mma, self.tile, self.vec, self.stages)
        self.acc_cols = self.tile[1]
        self.sfa_cols = (self.tile[0] // 32) * 4
        self.sfb_cols = (self.tile[1] // 32) * 4
        self.tmem_cols = 256  # a power of two holding the accumulator and both scale tiles

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor,
                 operands, sizes, max_ctas: cutlass.Constexpr, stream):
        self._configure_scaled(a, b, c, sfa.element_type)
        sfa_t = cute.make_tensor(sfa.iterator, blockscaled.tile_atom_to_shape_SF(a.shape, self.vec))
        sfb_t = cute.make_tensor(sfb.iterator, blockscaled.tile_atom_to_shape_SF(b.shape, self.vec))
        tma_a, ta = self.tma_a(a, self.sa_layout)
        tma_b, tb = self.tma_b(b, self.sb_layout)
        tma_sfa, tsfa = self.tma_a(sfa_t, self.ssfa_layout, internal_type=cutlass.Int16)
        tma_sfb, tsfb = self.tma_b(sfb_t, self.ssfb_layout, sm100.cluster_shape_to_tma_atom_SFB((1, 1), self.mma.thr_id),
                                   internal_type=cutlass.Int16)
        grid = (cute.ceil_div(c.shape[0], self.tile[0]), cute.ceil_div(c.shape[1], self.tile[1]), c.shape[2])
        self.scaled_kernel(self.mma, tma_a, ta, tma_b, tb, tma_sfa, tsfa, tma_sfb, tsfb, c, self.cluster,
                           self.sa_layout, self.sb_layout, self.ssfa_layout, self.ssfb_layout, operands,
                           sizes).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream)

    @cute.kernel
    def scaled_kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, ma: cute.Tensor, tma_b: cute.CopyAtom,
                      mb: cute.Tensor, tma_sfa: cute.CopyAtom, msfa: cute.Tensor, tma_sfb: cute.CopyAtom,
                      msfb: cute.Tensor, mc: cute.Tensor, cluster: cute.Layout, sa_layout: cute.ComposedLayout,
                      sb_layout: cute.ComposedLayout, ssfa_layout: cute.Layout, ssfb_layout: cute.Layout,
                      operands, sizes):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bm, bn, bl = cute.arch.block_idx()
        if warp == 0:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)
        smem, loads, mmas, acc_ready, tmem, sa, sb = self.shared_stages(cluster, sa_layout, sb_layout)
        ssfa = smem.allocate_tensor(element_type=self.sf_dtype, layout=ssfa_layout, byte_alignment=128)
        ssfb = smem.allocate_tensor(element_type=self.sf_dtype, layout=ssfb_layout, byte_alignment=128)

        thr = mma.get_slice(0)
        tile_a, tile_b = cute.slice_(self.tile, (None, 0, None)), cute.slice_(self.tile, (0, None, None))
        ga = thr.partition_A(cute.local_tile(ma, tile_a, (None, None, None)))
        gb = thr.partition_B(cute.local_tile(mb, tile_b, (None, None, None)))
        gsfa = thr.partition_A(cute.local_tile(msfa, tile_a, (None, None, None)))
        gsfb = thr.partition_B(cute.local_tile(msfb, tile_b, (None, None, None)))
        tiler_mn = cute.slice_(self.tile, (None, None, 0))
        gc = thr.partition_C(cute.local_tile(mc, tiler_mn, (None, None, None)))
        cc = thr.partition_C(cute.local_tile(cute.make_identity_tensor(mc.shape), tiler_mn, (None, None, None)))
        tsa, tga = tma_split(tma_a, sa, ga, 3)
        tsb, tgb = tma_split(tma_b, sb, gb, 3)
        tssfa, tgsfa = tma_split(tma_sfa, ssfa, gsfa, 3)
        tssfb, tgsfb = tma_split(tma_sfb, ssfb, gsfb, 3)
        tssfa, tgsfa = cute.filter_zeros(tssfa), cute.filter_zeros(tgsfa)
        tssfb, tgsfb = cute.filter_zeros(tssfb), cute.filter_zeros(tgsfb)
        tga, tgb = tga[(None, bm, None, bl)], tgb[(None, bn, None, bl)]
        tgsfa, tgsfb = tgsfa[(None, bm, None, bl)], tgsfb[(None, bn, None, bl)]
        ra = mma.make_fragment_A(sa)
        rb = mma.make_fragment_B(sb)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.tile[:2])).layout
        k_tiles = cute.size(ga, mode=[3])
        tmem_ptr, acc = self.tmem_accumulator(tmem, cluster, acc_layout)
        # the scale factors live in tensor memory right after the accumulator's columns
        tsfa_t = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.acc_cols, dtype=self.sf_dtype),
                                  blockscaled.make_tmem_layout_sfa(mma, self.tile, self.vec,
                                                                   cute.slice_(ssfa_layout, (None, None, None, 0))))
        tsfb_t = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.acc_cols + self.sfa_cols, dtype=self.sf_dtype),
                                  blockscaled.make_tmem_layout_sfb(mma, self.tile, self.vec,
                                                                   cute.slice_(ssfb_layout, (None, None, None, 0))))
        s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype)
        s2t_a = tcgen05.make_s2t_copy(s2t_atom, cute.filter_zeros(tsfa_t))
        s2t_b = tcgen05.make_s2t_copy(s2t_atom, cute.filter_zeros(tsfb_t))
        src_sfa = tcgen05.get_s2t_smem_desc_tensor(s2t_a, s2t_a.get_slice(0).partition_S(cute.filter_zeros(ssfa)))
        src_sfb = tcgen05.get_s2t_smem_desc_tensor(s2t_b, s2t_b.get_slice(0).partition_S(cute.filter_zeros(ssfb)))
        dst_sfa = s2t_a.get_slice(0).partition_D(cute.filter_zeros(tsfa_t))
        dst_sfb = s2t_b.get_slice(0).partition_D(cute.filter_zeros(tsfb_t))

        if warp == 0:
            ahead = cutlass.min(self.stages - 1, k_tiles)
            for kt in cutlass.range(ahead, unroll=1):
                slot = loads.acquire_and_advance()
                self.load_stage(slot, kt, tma_a, tga, tsa, tma_b, tgb, tsb, tma_sfa, tgsfa, tssfa, tma_sfb, tgsfb, tssfb)
            for kt in cutlass.range(k_tiles, unroll=1):
                if kt + ahead < k_tiles:
                    slot = loads.acquire_and_advance()
                    self.load_stage(slot, slot.count, tma_a, tga, tsa, tma_b, tgb, tsb, tma_sfa, tgsfa, tssfa,
                                    tma_sfb, tgsfb, tssfb)
                ready = mmas.wait_and_advance()
                cute.copy(s2t_a, src_sfa[(None, None, None, None, ready.index)], dst_sfa)
                cute.copy(s2t_b, src_sfb[(None, None, None, None, ready.index)], dst_sfb)
                mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                stage = (None, None, None, ready.index)
                cute.gemm(mma, acc, [ra[stage], tsfa_t], [rb[stage], tsfb_t], acc)
                ready.release()
            self.acc_ready_commit(acc_ready)
        self.store_and_free(tidx, acc, tmem, tmem_ptr, acc_ready, gc, cc, ((None, None), 0, 0, bm, bn, bl),
                            self.store_element, (operands, sizes, mc.shape))
        if warp == 0:
            loads.tail()

    @cute.jit
    def load_stage(self, slot, k, tma_a, tga, tsa, tma_b, tgb, tsb, tma_sfa, tgsfa, tssfa, tma_sfb, tgsfb, tssfb):
        """One pipeline stage: the A and B k-slices and their scale factors, on one barrier."""
        cute.copy(tma_a, tga[(None, k)], tsa[(None, slot.index)], tma_bar_ptr=slot.barrier)
        cute.copy(tma_b, tgb[(None, k)], tsb[(None, slot.index)], tma_bar_ptr=slot.barrier)
        cute.copy(tma_sfa, tgsfa[(None, k)], tssfa[(None, slot.index)], tma_bar_ptr=slot.barrier)
        cute.copy(tma_sfb, tgsfb[(None, k)], tssfb[(None, slot.index)], tma_bar_ptr=slot.barrier)
