"""A mixture-of-experts layer in kiln: router -> top-k -> permute -> grouped GEMMs -> combine.

    logits = x @ router                       [T, E]   which experts want each token
    top-k of softmax(logits), renormalized    [T, k]   (Mixtral's routing)
    sort the T*k (token, expert) slots by expert; group_sizes[e] = slots of expert e
    h = silu(grouped_matmul(x[slots], w_up, group_sizes))       [T*k, F]
    y = grouped_matmul(h, w_down, group_sizes) * gate[slots]    [T*k, D]
    out[token] = sum of its k slots                              [T, D]

It runs eagerly and compiled (`kn.compile`, CPU), and both are checked against a plain
per-token, per-expert numpy loop. With --aot it also shows the analytical tile
selector's choice for the up-projection of the layer at production size (default
Mixtral-8x7B's: 4096 tokens, 4096 -> 14336 features, 8 experts, top-2) and compiles it,
SiLU fused into the epilogue, ahead of time for Hopper (sm_90) and MI300 (gfx942),
which needs triton but no GPU.

    python examples/moe_layer.py                 # eager + compiled on the CPU
    python examples/moe_layer.py --aot           # + tile choice and PTX / AMDGCN
    python examples/moe_layer.py --aot --aot-shape 256,7168,2048,256   # DeepSeek-V3-like
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import numpy as np

import kiln as kn


def moe_layer(x, router, w_up, w_down, top_k: int = 2):
    """x [T, D], router [D, E], w_up [E, D, F], w_down [E, F, D] -> [T, D]."""
    tokens, dim = x.shape
    experts = router.shape[1]
    probs = kn.softmax(x @ router, dim=-1)
    ranked, chosen = kn.sort(probs, dim=-1, descending=True)
    gates = ranked[:, :top_k]
    gates = gates / gates.sum(dim=-1, keepdim=True)
    slot_expert = chosen[:, :top_k].reshape(-1)  # slot t * k + j: token t's j-th expert
    order = kn.argsort(slot_expert)  # stable: tokens keep their order within an expert
    token_of = order // top_k
    group_sizes = (slot_expert[:, None] == kn.arange(experts)[None, :]).sum(dim=0)
    h = kn.silu(kn.grouped_matmul(x[token_of], w_up, group_sizes))
    y = kn.grouped_matmul(h, w_down, group_sizes) * gates.reshape(-1)[order][:, None]
    index = kn.expand(token_of[:, None], -1, dim)
    return kn.scatter_add(kn.zeros(tokens, dim, dtype=y.dtype), 0, index, y)


def numpy_loop(x, router, w_up, w_down, top_k: int = 2):
    """The same layer, one token and one expert at a time, in float64."""
    x, router, w_up, w_down = (np.asarray(a, np.float64) for a in (x, router, w_up, w_down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        gates = probs[t, chosen] / probs[t, chosen].sum()
        for e, g in zip(chosen, gates):
            h = x[t] @ w_up[e]
            out[t] += g * ((h / (1 + np.exp(-h))) @ w_down[e])
    return out


def example_inputs(tokens=64, dim=32, hidden=64, experts=8, seed=0):
    return (kn.randn(tokens, dim, seed=seed),
            kn.randn(dim, experts, seed=seed + 1),
            kn.randn(experts, dim, hidden, seed=seed + 2) * dim ** -0.5,
            kn.randn(experts, hidden, dim, seed=seed + 3) * hidden ** -0.5)


def show_aot(tokens: int, dim: int, hidden: int, experts: int, top_k: int) -> None:
    """The tile selector's choice for the up-projection of a layer of this size (tokens
    routed to top_k experts each, balanced), compiled for two GPUs."""
    try:
        from kiln.codegen.triton.grouped_gemm import Epilogue, aot_compile_grouped_gemm
    except ImportError as exc:
        print(f"--aot needs triton ({exc}); skipped")
        return
    from kiln.codegen.triton.tile_selector import explain, select_tiles

    rows = tokens * top_k
    for target in ("sm_90", "gfx942"):
        print(explain("grouped_gemm", rows, hidden, dim, "bfloat16", target, num_experts=experts,
                      top=3))
        config = select_tiles("grouped_gemm", rows, hidden, dim, "bfloat16", target,
                              num_experts=experts)[0]
        start = time.perf_counter()
        art = aot_compile_grouped_gemm(target, "bfloat16", epilogue=Epilogue("silu"), config=config,
                                       m=rows, n=hidden, k=dim, num_experts=experts)
        asm = art.assembly
        mma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+|mma\.sync\.aligned\.\w+"
                                    r"|v_mfma_\w+", asm)))
        kind = "PTX" if target.startswith("sm_") else "AMDGCN"
        print(f"  {target}: {kind} {len(asm):,} chars, binary {len(art.binary):,} bytes, "
              f"{art.shared_memory:,} B shared memory, {time.perf_counter() - start:.1f} s; "
              f"matrix instructions: {', '.join(mma) or 'none'}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--aot", action="store_true",
                        help="also show the tile choice and compile for sm_90 / gfx942")
    parser.add_argument("--aot-shape", default="4096,4096,14336,8", metavar="T,D,F,E",
                        help="tokens, features, hidden features, experts of the --aot layer")
    args = parser.parse_args(argv)
    inputs = example_inputs(args.tokens, args.dim, args.hidden, args.experts)
    expected = numpy_loop(*(a.numpy() for a in inputs), top_k=args.top_k)

    start = time.perf_counter()
    eager = moe_layer(*inputs, top_k=args.top_k).numpy()
    eager_s = time.perf_counter() - start
    compiled_fn = kn.compile(lambda *a: moe_layer(*a, top_k=args.top_k))
    start = time.perf_counter()
    compiled = compiled_fn(*inputs).numpy()
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled_fn(*inputs)
    again_s = time.perf_counter() - start

    chosen = np.argsort(-(inputs[0].numpy() @ inputs[1].numpy()), axis=-1, kind="stable")[:, :args.top_k]
    sizes = np.bincount(chosen.reshape(-1), minlength=args.experts)
    steps = compiled_fn.compiled_graphs()[0].program.steps
    externs = sorted({s.op for s in steps if type(s).__name__ == "Extern"})
    launches = sum(type(s).__name__ == "Launch" for s in steps)
    eager_err = float(np.abs(eager - expected).max())
    compiled_err = float(np.abs(compiled - expected).max())
    print(f"MoE layer: {args.tokens} tokens x {args.dim} features, {args.experts} experts "
          f"(hidden {args.hidden}), top-{args.top_k} routing")
    print(f"  tokens per expert: {sizes.tolist()}")
    print(f"  eager:    max |error| vs the per-expert numpy loop {eager_err:.2e} ({eager_s * 1e3:.1f} ms)")
    print(f"  compiled: max |error| {compiled_err:.2e} (first call {first_s:.2f} s with compilation, "
          f"then {again_s * 1e3:.1f} ms); {launches} fused kernels, library calls: {', '.join(externs)}")
    ok = eager_err < 1e-4 and compiled_err < 1e-4
    if args.aot:
        print()
        tokens, dim, hidden, experts = (int(v) for v in args.aot_shape.split(","))
        show_aot(tokens, dim, hidden, experts, args.top_k)
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
