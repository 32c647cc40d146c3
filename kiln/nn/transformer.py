"""`nn.TransformerEncoderLayer`, `TransformerDecoderLayer` and `TransformerEncoder` /
`TransformerDecoder`: torch's layers (post-norm by default, `norm_first=True` for
pre-norm), built from `nn.MultiheadAttention`, `nn.Linear`, `nn.LayerNorm` and
`nn.Dropout`, with torch's submodule names so state dicts load across.

    >>> layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True)
    >>> y = layer(x, is_causal=True, src_mask=mask)
"""

from __future__ import annotations

import copy

from kiln.errors import KilnArgumentError
from kiln.nn.attention import MultiheadAttention
from kiln.nn.containers import ModuleList
from kiln.nn.layers import Dropout, LayerNorm, Linear
from kiln.nn.module import Module


def _activation(activation):
    from kiln.frontend import functional as KF

    if callable(activation):
        return activation
    if activation == "relu":
        return KF.relu
    if activation == "gelu":
        return KF.gelu
    raise KilnArgumentError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")


class _Layer(Module):
    def _feedforward(self, d_model, dim_feedforward, dropout, activation, bias):
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias)
        self.activation = _activation(activation)

    def _ff_block(self, x, out_dropout):
        return out_dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoderLayer(_Layer):
    """torch.nn.TransformerEncoderLayer (self-attention, then a feed-forward block)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first)
        self._feedforward(d_model, dim_feedforward, dropout, activation, bias)
        self.norm_first = bool(norm_first)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)

    def _sa_block(self, x, mask, key_padding_mask, is_causal):
        out = self.self_attn(x, x, x, attn_mask=mask, key_padding_mask=key_padding_mask,
                             is_causal=is_causal)[0]
        return self.dropout1(out)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x), self.dropout2)
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x, self.dropout2))


class TransformerDecoderLayer(_Layer):
    """torch.nn.TransformerDecoderLayer (self-attention, cross-attention, feed-forward)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                 batch_first=batch_first)
        self._feedforward(d_model, dim_feedforward, dropout, activation, bias)
        self.norm_first = bool(norm_first)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout1, self.dropout2, self.dropout3 = Dropout(dropout), Dropout(dropout), Dropout(dropout)

    def _sa_block(self, x, mask, key_padding_mask, is_causal):
        return self.dropout1(self.self_attn(x, x, x, attn_mask=mask, key_padding_mask=key_padding_mask,
                                            is_causal=is_causal)[0])

    def _mha_block(self, x, mem, mask, key_padding_mask, is_causal):
        return self.dropout2(self.multihead_attn(x, mem, mem, attn_mask=mask,
                                                 key_padding_mask=key_padding_mask,
                                                 is_causal=is_causal)[0])

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False):
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask,
                                    memory_is_causal)
            return x + self._ff_block(self.norm3(x), self.dropout3)
        x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                           memory_is_causal))
        return self.norm3(x + self._ff_block(x, self.dropout3))


class TransformerEncoder(Module):
    """`num_layers` copies of `encoder_layer`, then an optional final norm."""

    def __init__(self, encoder_layer, num_layers: int, norm=None, enable_nested_tensor=True,
                 mask_check=True) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers, self.norm = int(num_layers), norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                      is_causal=is_causal)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(Module):
    """`num_layers` copies of `decoder_layer`, then an optional final norm."""

    def __init__(self, decoder_layer, num_layers: int, norm=None) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers, self.norm = int(num_layers), norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False):
        x = tgt
        for layer in self.layers:
            x = layer(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                      memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        return x if self.norm is None else self.norm(x)
