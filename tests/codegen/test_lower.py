"""Lowering a fused group to Kernel IR: the kernel text for a few groups (golden, so a
change to codegen shows up as a reviewable diff), then numerics: every group of real
fused graphs run by the Kernel IR evaluator against the group's own graph, at several
values of a symbolic size (0, 1, 7)."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.build_program import region_graph
from kiln.codegen.kernel_eval import run_kernel
from kiln.codegen.kernel_ir import GemmKernel, Kernel, format_kernel
from kiln.codegen.lower import lower_fused
from kiln.ir.interpret import run_graph
from kiln.ir.parser import parse_graph
from kiln.ir.shapes import evaluate
from kiln.passes.fusion import fuse
from kiln.passes.pipeline import optimize


def kernels_of(text):
    fused = fuse(parse_graph(text))
    return [format_kernel(lower_fused(n, f"k{i}"))
            for i, n in enumerate(n for n in fused.body.nodes if n.op == "fused")]


GOLDEN = {
    "broadcast add + exp: a 2-D loop (the broadcast operand is not at the output position)": ("""
graph @g(%x: f32[B, 8], %b: f32[8]) -> f32[B, 8]
  where B in [0, 64]
  %0 = broadcast_in_dim(%b) {broadcast_dimensions=(1,), shape=(B, 8)} : f32[B, 8]
  %1 = add(%x, %0) : f32[B, 8]
  %2 = exp(%1) : f32[B, 8]
  return %2
""", """
kernel k0(in in0: f32[8], in in1: f32[B, 8], out out0: f32[B, 8]) sizes(B)
  parallel i0 in [0, B), i1 in [0, 8)
    store out0[8*i0 + i1] = exp(add(load in1[8*i0 + i1], load in0[i1]))
"""),
    "same-shape pointwise: one flat loop": ("""
graph @g(%x: f32[B, 8], %y: f32[B, 8]) -> f32[B, 8]
  where B in [0, 64]
  %0 = mul(%x, %y) : f32[B, 8]
  %1 = tanh(%0) : f32[B, 8]
  return %1
""", """
kernel k0(in in0: f32[B, 8], in in1: f32[B, 8], out out0: f32[B, 8]) sizes(B)
  parallel i0 in [0, 8*B)
    store out0[i0] = tanh(mul(load in0[i0], load in1[i0]))
"""),
    "softmax: two reductions and the store in one row loop": ("""
graph @g(%x: f32[B, 8]) -> f32[B, 8]
  where B in [0, 64]
  %0 = reduce_max(%x) {axes=(1,)} : f32[B]
  %1 = broadcast_in_dim(%0) {broadcast_dimensions=(0,), shape=(B, 8)} : f32[B, 8]
  %2 = sub(%x, %1) : f32[B, 8]
  %3 = exp(%2) : f32[B, 8]
  %4 = reduce_sum(%3) {axes=(1,)} : f32[B]
  %5 = broadcast_in_dim(%4) {broadcast_dimensions=(0,), shape=(B, 8)} : f32[B, 8]
  %6 = div(%3, %5) : f32[B, 8]
  return %6
""", """
kernel k0(in in0: f32[B, 8], out out0: f32[B, 8]) sizes(B)
  parallel o0 in [0, B)
    acc0 = reduce max:f32 r0 in [0, 8): load in0[8*o0 + r0]
    acc1 = reduce sum:f32 r0 in [0, 8): exp(sub(load in0[8*o0 + r0], acc0))
    loop r0 in [0, 8): store out0[8*o0 + r0] = div(exp(sub(load in0[8*o0 + r0], acc0)), acc1)
"""),
    "keepdim mean: the row is stored at its unit-dim position": ("""
graph @g(%x: f32[B, 5]) -> f32[B, 1]
  where B in [0, 64]
  %0 = reduce_sum(%x) {axes=(1,)} : f32[B]
  %1 = full() {dtype=f32, shape=(B,), value=5.0} : f32[B]
  %2 = div(%0, %1) : f32[B]
  %3 = reshape(%2) {shape=(B, 1)} : f32[B, 1]
  return %3
""", """
kernel k0(in in0: f32[B, 5], out out0: f32[B, 1]) sizes(B)
  parallel o0 in [0, B)
    acc0 = reduce sum:f32 r0 in [0, 5): load in0[5*o0 + r0]
    store out0[o0] = div(acc0, 5.0)
"""),
    "bf16 sum accumulates in f32": ("""
graph @g(%x: bf16[3, 4]) -> bf16[4]
  %0 = reduce_sum(%x) {axes=(0,)} : bf16[4]
  return %0
""", """
kernel k0(in in0: bf16[3, 4], out out0: bf16[4])
  parallel o0 in [0, 4)
    acc0 = reduce sum:f32 r0 in [0, 3): convert:f32(load in0[o0 + 4*r0])
    store out0[o0] = convert:bf16(acc0)
"""),
    "matmul + bias + relu + cast: a gemm template with its epilogue": ("""
graph @g(%x: f32[B, 8], %w: f32[8, 6], %b: f32[6]) -> f16[B, 6]
  where B in [0, 64]
  %0 = matmul(%x, %w) : f32[B, 6]
  %1 = broadcast_in_dim(%b) {broadcast_dimensions=(1,), shape=(B, 6)} : f32[B, 6]
  %2 = add(%0, %1) : f32[B, 6]
  %3 = full() {dtype=f32, shape=(B, 6), value=0} : f32[B, 6]
  %4 = max(%2, %3) : f32[B, 6]
  %5 = convert(%4) {dtype=f16} : f16[B, 6]
  return %5
""", """
kernel k0(in in0: f32[B, 8], in in1: f32[8, 6], in in2: f32[6], out out0: f16[B, 6]) sizes(B)
  gemm [1] x [B, 8] @ [8, 6]: a=in0 strides(0, 8, 1), b=in1 strides(0, 6, 1)
    store out0[gb, gi, gj] = convert:f16(max(add(acc, load in2[gj]), 0))
"""),
    "transpose and iota only remap the index": ("""
graph @g(%x: f32[4, 6]) -> f32[6, 4]
  %0 = transpose(%x) {permutation=(1, 0)} : f32[6, 4]
  %1 = iota() {dimension=0, dtype=f32, shape=(6, 4)} : f32[6, 4]
  %2 = mul(%0, %1) : f32[6, 4]
  return %2
""", """
kernel k0(in in0: f32[4, 6], out out0: f32[6, 4])
  parallel i0 in [0, 6), i1 in [0, 4)
    store out0[4*i0 + i1] = mul(load in0[i0 + 6*i1], convert:f32((i0)))
"""),
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_kernel_text(name):
    graph, expected = GOLDEN[name]
    assert "\n\n".join(kernels_of(graph)) == expected.strip()


# -- numerics: each group's kernel against the group's graph ------------------------------

B = kn.ShapeVar("B", min=0, max=64)


def _graphs():
    dyn = {"x": kn.TensorSpec([B, 6])}

    def mlp(x, w, b, r):
        return (kn.gelu(x @ w + b, approximate="tanh") + r).to(kn.float16)

    def norms(x, w):
        return kn.layer_norm(x, (6,), w, w), kn.rms_norm(x, (6,)), kn.softmax(x, dim=-1), \
            kn.log_softmax(x, dim=1), x.sum(dim=0), x.var(dim=1, keepdim=True), x.max(dim=1)[0]

    def shapes(x, w):
        return x.mT * 2, x[:, ::2] + x[:, 1::2], x.flip(1) - x, kn.pad(x, (1, 0)) * 3, \
            kn.where(x > 0, x, w) * kn.arange(6, dtype=kn.float32)

    def mixed(x, w):
        y = x.to(kn.bfloat16)
        return (y * 2).sum(dim=1), (x.to(kn.int32) * 3) // 2, (x > w).sum(dim=0), x.to(kn.float64).exp()

    args = (kn.randn(5, 6, seed=0), kn.randn(6, seed=1))
    return {
        "mlp": kn.trace(mlp, kn.randn(5, 6, seed=2), kn.randn(6, 6, seed=3), kn.randn(6, seed=4),
                        kn.randn(5, 6, seed=5), dynamic_shapes={"x": kn.TensorSpec([B, 6]),
                                                               "r": kn.TensorSpec([B, 6])}),
        "norms": kn.trace(norms, *args, dynamic_shapes=dyn),
        "shapes": kn.trace(shapes, *args, dynamic_shapes=dyn),
        "mixed": kn.trace(mixed, *args, dynamic_shapes=dyn),
        "batched_gemm": kn.trace(lambda a, b: kn.relu(a @ b.mT) * 0.5, kn.randn(2, 3, 4, seed=6),
                                 kn.randn(2, 5, 4, seed=7)),
    }


GRAPHS = _graphs()


def _random(value_type, sizes, rng):
    shape = tuple(evaluate(d, sizes) for d in value_type.shape)
    dtype = value_type.dtype.np_dtype
    if value_type.dtype.is_inexact:
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(-4, 5, shape).astype(dtype)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_every_group_kernel_matches_its_graph(name):
    graph = GRAPHS[name]
    fused = fuse(optimize(graph))
    groups = [n for n in fused.body.nodes if n.op == "fused"]
    assert groups
    rng = np.random.default_rng(0)
    sizes_list = [{"B": n} for n in (0, 1, 7)] if "B" in graph.shape_vars else [{}]
    for k, node in enumerate(groups):
        kernel = lower_fused(node, f"k{k}")
        assert isinstance(kernel, GemmKernel if node.attrs["kind"] == "gemm" else Kernel)
        sub = region_graph(node.regions[0], f"group{k}", fused)
        for sizes in sizes_list:
            inputs = [_random(p.type, sizes, rng) for p in node.regions[0].params]
            want = run_graph(sub, *inputs)
            outputs = [np.empty(w.shape, w.dtype) for w in want]
            run_kernel(kernel, inputs + outputs, {s: sizes[s] for s in kernel.sizes})
            for w, got in zip(want, outputs):
                if w.dtype.kind in "iub":
                    np.testing.assert_array_equal(got, w)
                else:
                    tol = 1e-5 if w.dtype in (np.float32, np.float64) else 1e-2
                    np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64),
                                               rtol=tol, atol=tol, err_msg=f"{format_kernel(kernel)}\n{sizes}")
