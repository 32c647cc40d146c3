"""`MultiheadAttention` with torch.nn.MultiheadAttention's parameters (in_proj_weight
[3E, E], in_proj_bias [3E], out_proj Linear(E, E)), its mask conventions and its
initialization, computed through `kn.scaled_dot_product_attention` (one fused kernel
when compiled). Its state_dict loads into torch's module and back.
"""

from __future__ import annotations

import math

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.frontend import functional as KF
from kiln.frontend import shape_ops as S
from kiln.nn import init
from kiln.nn.layers import Linear
from kiln.nn.module import Module


class MultiheadAttention(Module):
    """Multi-head attention: project query, key and value, attend per head, project out.

    `forward(query, key, value, *, attn_mask=None, key_padding_mask=None,
    need_weights=False, average_attn_weights=True, is_causal=False)` returns
    `(output, weights)`, weights None unless `need_weights`. Inputs are [B, L, E]
    (`batch_first=True`, the default here) or [L, B, E], or unbatched [L, E].

    Masks follow torch's module (not its functional sdpa): in a bool `attn_mask` ([L, S]
    or [B * num_heads, L, S]) or `key_padding_mask` ([B, S]) True means *may not
    attend*; float masks are added to the scores. `is_causal=True` masks future keys
    (it also works without an `attn_mask`). `dropout` applies to the attention weights
    in training mode and draws its key like `nn.Dropout`.

    >>> mha = nn.MultiheadAttention(32, 4, seed=0)
    >>> out, _ = mha(x, x, x, is_causal=True)
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = True, dtype=dt.float32, seed: int | None = None) -> None:
        super().__init__()
        if num_heads <= 0 or embed_dim % num_heads:
            raise KilnArgumentError(f"MultiheadAttention: embed_dim {embed_dim} must be divisible "
                                    f"by num_heads {num_heads}")
        if not 0.0 <= dropout < 1.0:
            raise KilnArgumentError(f"MultiheadAttention: dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        k_in, k_out = init.layer_keys(seed, 2)
        self.in_proj_weight = init.xavier_uniform((3 * embed_dim, embed_dim), key=k_in, dtype=dtype)
        from kiln.frontend.factories import zeros

        self.in_proj_bias = zeros(3 * embed_dim, dtype=dtype) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype,
                               seed=None if seed is None else seed + 1)
        if bias:
            self.out_proj.bias = zeros(embed_dim, dtype=dtype)  # torch zeroes both biases

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"batch_first={self.batch_first}")

    def _needs_rng(self) -> bool:
        return self.training and self.dropout > 0.0

    def _project(self, query, key, value):
        E, w, b = self.embed_dim, self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:  # self-attention: one GEMM for q, k and v
            return S.split(KF.linear(query, w, b), E, dim=-1)
        ws = S.split(w, E, dim=0)
        bs = S.split(b, E, dim=0) if b is not None else (None, None, None)
        return tuple(KF.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), ws, bs))

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None,
                need_weights: bool = False, average_attn_weights: bool = True,
                is_causal: bool = False):
        query, key, value = (KF._floating(t) for t in (query, key, value))
        unbatched = query.ndim == 2
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise KilnShapeError(f"MultiheadAttention: query, key and value must all be 3-D "
                                 f"(batched) or 2-D, got {list(query.shape)}, {list(key.shape)}, "
                                 f"{list(value.shape)}")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.shape[-1] != self.embed_dim:
                raise KilnShapeError(f"MultiheadAttention: {name} {t.dtype.short}{list(t.shape)} "
                                     f"must have embed_dim {self.embed_dim} features")
        same = query is key and key is value
        if unbatched:
            query, key, value = (S.unsqueeze(t, 0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = S.unsqueeze(KF._tensor(key_padding_mask), 0)
        elif not self.batch_first:
            query, key, value = (S.transpose(t, 0, 1) for t in (query, key, value))
        if same:
            key = value = query
        B, L, S_len = query.shape[0], query.shape[1], key.shape[1]
        H, D = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        q = S.transpose(S.reshape(q, (B, L, H, D)), 1, 2)
        k = S.transpose(S.reshape(k, (B, S_len, H, D)), 1, 2)
        v = S.transpose(S.reshape(v, (B, S_len, H, D)), 1, 2)
        dropping = self.training and self.dropout > 0.0
        explicit = need_weights or dropping  # the weights themselves are needed
        mask = self._mask(attn_mask, key_padding_mask, is_causal, explicit, B, L, S_len, q.dtype)
        weights = None
        if explicit:
            scores = KF.matmul(q * (1.0 / math.sqrt(D)), S.transpose(k, -2, -1))
            if mask is not None:
                scores = KF.where(mask, scores, float("-inf")) if mask.dtype.is_bool else scores + mask
            weights = KF.softmax(scores, dim=-1)
            if dropping:
                from kiln.nn import functional as F
                from kiln.nn import random

                weights = F.dropout(weights, self.dropout, key=random.next_key())
            out = KF.matmul(weights, v)
        elif mask is None and is_causal:
            out = KF.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = KF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = self.out_proj(S.reshape(S.transpose(out, 1, 2), (B, L, self.embed_dim)))
        if unbatched:
            out = S.squeeze(out, 0)
        elif not self.batch_first:
            out = S.transpose(out, 0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            weights = S.squeeze(weights, 0)
        return out, weights

    def _mask(self, attn_mask, key_padding_mask, is_causal, explicit, B, L, S_len, dtype):
        """One mask broadcastable to the scores [B, H, L, S]: bool (True = attend, sdpa's
        convention) when every given mask is bool, else additive float; None when there
        is nothing to mask, or only causality and sdpa takes it as its is_causal flag."""
        masks = []
        if attn_mask is not None:
            m = KF._tensor(attn_mask)
            if m.ndim == 2:
                if tuple(m.shape) != (L, S_len):
                    raise KilnShapeError(f"MultiheadAttention: a 2-D attn_mask must be [L, S] = "
                                         f"[{L}, {S_len}], got {list(m.shape)}")
                m = S.reshape(m, (1, 1, L, S_len))
            elif m.ndim == 3:
                if tuple(m.shape) != (B * self.num_heads, L, S_len):
                    raise KilnShapeError(f"MultiheadAttention: a 3-D attn_mask must be "
                                         f"[B * num_heads, L, S] = [{B * self.num_heads}, {L}, "
                                         f"{S_len}], got {list(m.shape)}")
                m = S.reshape(m, (B, self.num_heads, L, S_len))
            else:
                raise KilnShapeError(f"MultiheadAttention: attn_mask must be 2-D or 3-D, got "
                                     f"{list(m.shape)}")
            masks.append(m)
        if key_padding_mask is not None:
            m = KF._tensor(key_padding_mask)
            if tuple(m.shape) != (B, S_len):
                raise KilnShapeError(f"MultiheadAttention: key_padding_mask must be [B, S] = "
                                     f"[{B}, {S_len}], got {list(m.shape)}")
            masks.append(S.reshape(m, (B, 1, 1, S_len)))
        if not masks and not (is_causal and explicit):
            return None
        if is_causal:
            from kiln.frontend.factories import arange

            causal = KF.ge(S.reshape(arange(L), (L, 1)), S.reshape(arange(S_len), (1, S_len)))
            masks.append(KF.logical_not(causal))  # in torch's convention: True = masked
        for m in masks:
            if not (m.dtype.is_bool or m.dtype.is_floating):
                raise KilnDTypeError(f"MultiheadAttention: masks must be bool or float, got {m.dtype}")
        if all(m.dtype.is_bool for m in masks):
            blocked = masks[0]
            for m in masks[1:]:
                blocked = KF.logical_or(blocked, m)
            return KF.logical_not(blocked)
        total = None
        for m in masks:
            add = KF.where(m, float("-inf"), 0.0) if m.dtype.is_bool else KF.to(m, dtype)
            total = add if total is None else total + add
        return KF.to(total, dtype)
