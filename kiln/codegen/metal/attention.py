"""Fused scaled-dot-product attention as an MSL kernel (flash-attention style).

One threadgroup of 32 lanes (one simdgroup) per (batch x head, query row): the keys are
visited in blocks of 32, lane l scoring key j0 + l (q . k over the head dim, times the
scale); the block's maximum (a shuffle butterfly) and `simd_sum` of the exponentials
update an online softmax (running max m, running sum s), and the 32 weights meet in
threadgroup memory so that each lane accumulates its slice of the head dim of
sum_j p_j v_j. Nothing of size Lq x Lk is ever stored. Masks: `causal` (key j is seen by
query i when j <= i, torch's is_causal) and/or a boolean `mask[Lq, Lk]` (True: attend),
as torch's attn_mask. A row with every key masked gives NaN, as torch's does.
Lq and Lk are run-time sizes; the head dim D is static (D <= 1024).
"""

from __future__ import annotations

import sympy

from kiln.codegen.metal.emit import PRELUDE, EmittedKernel
from kiln.codegen.metal.errors import KilnMetalArgumentError
from kiln.ir.shapes import symbol

LANES = 32


def attention(head_dim: int, causal: bool = False, masked: bool = False, scale: float | None = None) -> EmittedKernel:
    """The kernel for q, k, v of shape [BH, L, D] (float32) -> out [BH, Lq, D]; buffers
    q, k, v, (mask,) out; sizes Lq, Lk; grid BH * Lq threadgroups (sizes 'BH', 'Lq')."""
    d = head_dim
    if not (isinstance(d, int) and 1 <= d <= 1024):
        raise KilnMetalArgumentError(f"metal attention: the head dim must be a static int in [1, 1024], got {d!r}")
    scale = float(scale if scale is not None else 1.0 / d ** 0.5)
    per = -(-d // LANES)
    allowed = ["j < Lk"]
    if causal:
        allowed.append("j <= i")
    if masked:
        allowed.append("mask[i * Lk + j]")
    params = ["device const float* q [[buffer(0)]]", "device const float* k [[buffer(1)]]",
              "device const float* v [[buffer(2)]]"]
    if masked:
        params.append("device const bool* mask [[buffer(3)]]")
    n = len(params)
    params += [f"device float* out [[buffer({n})]]", f"constant long& Lq [[buffer({n + 1})]]",
               f"constant long& Lk [[buffer({n + 2})]]", "uint tg [[threadgroup_position_in_grid]]",
               "uint tid [[thread_index_in_threadgroup]]"]
    body = f"""  threadgroup float p[{LANES}];
  const long bh = long(tg) / Lq, i = long(tg) % Lq;
  device const float* qi = q + (bh * Lq + i) * {d};
  float acc[{per}];
  for (int c = 0; c < {per}; ++c) acc[c] = 0.0f;
  float m = -INFINITY, s = 0.0f;
  for (long j0 = 0; j0 < Lk; j0 += {LANES}) {{
    const long j = j0 + tid;
    float score = -INFINITY;
    if ({" && ".join(allowed)}) {{
      device const float* kj = k + (bh * Lk + j) * {d};
      float dot = 0.0f;
      for (int e = 0; e < {d}; ++e) dot += qi[e] * kj[e];
      score = dot * {scale.hex()}f;
    }}
    float bmax = score;
    for (ushort o = {LANES // 2}; o > 0; o >>= 1) {{
      const float other = simd_shuffle_xor(bmax, o);  // every lane shuffles once
      bmax = max(bmax, other);
    }}
    const float mnew = max(m, bmax);
    const float pj = mnew == -INFINITY ? 0.0f : exp(score - mnew);
    const float rescale = mnew == -INFINITY ? 1.0f : exp(m - mnew);
    s = s * rescale + simd_sum(pj);
    p[tid] = pj;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int c = 0; c < {per}; ++c) {{
      const int e = tid + {LANES} * c;
      if (e >= {d}) break;
      float a = acc[c] * rescale;
      for (int l = 0; l < {LANES} && j0 + l < Lk; ++l) a += p[l] * v[(bh * Lk + j0 + l) * {d} + e];
      acc[c] = a;
    }}
    m = mnew;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // p is reused
  }}
  device float* oi = out + (bh * Lq + i) * {d};
  for (int c = 0; c < {per}; ++c) {{
    const int e = tid + {LANES} * c;
    if (e < {d}) oi[e] = s > 0.0f ? acc[c] / s : NAN;  // every key masked: NaN, as torch
  }}
"""
    name = f"kiln_attention_d{d}{'_causal' if causal else ''}{'_masked' if masked else ''}"
    head = f"kernel void {name}(\n    " + ",\n    ".join(params) + ") {"
    doc = (f"// fused attention, head dim {d}{', causal' if causal else ''}{', boolean mask' if masked else ''}: "
           f"one simdgroup per query row, online softmax over key blocks of {LANES}")
    source = PRELUDE + f"\n{doc}\n{head}\n{body}}}\n"
    buffers = ("q", "k", "v") + (("mask",) if masked else ()) + ("out",)
    return EmittedKernel(name, source, "attention", buffers, ("Lq", "Lk"), LANES,
                         sympy.Mul(symbol("BH"), symbol("Lq")))
