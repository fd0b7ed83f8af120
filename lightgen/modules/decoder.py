"""A generic encoder-decoder decoder step on a static KV cache.

Adapters describe a family's decoder with ``Seq2SeqDecoderSpec`` (the same Parameter objects the
model holds); ``Seq2SeqDecoder`` then runs one decoding step for any of them: fused embedding
lookup, self-attention writing K/V into the preallocated cache, cross-attention over encoder K/V
computed once per sentence (not per beam), the shared ``run_block`` and the LM head for the last
position only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lightgen import ops
from lightgen.modules.kv_cache import POOL, StaticKVCache
from lightgen.modules.block import BlockSpec, feed_forward, run_block
from lightgen.modules.norm import apply_norm, norm_kind


@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    out: nn.Linear
    heads: int
    scaling: float

    @property
    def head_dim(self) -> int:
        return self.q.out_features // self.heads


@dataclasses.dataclass(frozen=True)
class DecoderLayerWeights:
    module: nn.Module  # owns the FFN modules named in the BlockSpec
    self_attn: AttentionWeights
    self_norm: nn.Module
    cross_attn: AttentionWeights
    cross_norm: nn.Module
    ffn_norm: nn.Module


@dataclasses.dataclass(frozen=True)
class Seq2SeqDecoderSpec:
    block: BlockSpec
    layers: tuple[DecoderLayerWeights, ...]
    token_embedding: torch.Tensor  # [V, E]
    embed_scale: float
    position_table: torch.Tensor  # [P, E]: learned or a fixed sinusoidal table
    position_offset: int  # BART's learned positions start at index 2
    embedding_norm: nn.Module | None
    final_norm: nn.Module | None
    lm_head: torch.Tensor  # [V, E]
    logits_bias: torch.Tensor | None  # [1, V]

    @property
    def max_positions(self) -> int:
        return self.position_table.shape[0] - self.position_offset


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, T, H*D] -> [N, H, T, D] (a view)."""
    rows, length, width = x.shape
    return x.view(rows, length, heads, width // heads).transpose(1, 2)


class DecodeState:
    """Per-request decoder memory: the self-attention cache and the per-sentence cross K/V."""

    def __init__(self, cache: StaticKVCache, cross_keys, cross_values, encoder_keep, expand: int,
                 positions: torch.Tensor) -> None:
        self.cache = cache
        self.cross_keys = cross_keys  # per layer [B, H, S, D]
        self.cross_values = cross_values
        self.encoder_keep = encoder_keep  # [B, S] bool
        self.expand = expand  # rows per sentence (beams or returned sequences)
        self.positions = positions  # [N] int64, reused every step

    def release(self) -> None:
        self.cache.release()


class Seq2SeqDecoder:
    def __init__(self, spec: Seq2SeqDecoderSpec) -> None:
        self.spec = spec
        self.norm_kind = norm_kind(spec.layers[0].self_norm)

    def start(self, encoder_hidden: torch.Tensor, encoder_mask: torch.Tensor | None, expand: int,
              max_len: int) -> DecodeState:
        """Allocate the cache for ``rows = B * expand`` decoder rows; encoder inputs are per row
        ([N, S, E], HF repeats each sentence ``expand`` times) and are de-duplicated here."""
        rows, src_len, _ = encoder_hidden.shape
        if max_len > self.spec.max_positions:
            raise ValueError(f"generation needs {max_len} decoder positions but the model has "
                             f"{self.spec.max_positions} (max_position_embeddings)")
        sentences = encoder_hidden[::expand]
        keep = (torch.ones(sentences.shape[:2], dtype=torch.bool, device=sentences.device) if encoder_mask is None
                else encoder_mask[::expand].bool())
        cross_keys, cross_values = [], []
        for layer in self.spec.layers:
            attn = layer.cross_attn
            cross_keys.append(_split_heads(F.linear(sentences, attn.k.weight, attn.k.bias), attn.heads).contiguous())
            cross_values.append(_split_heads(F.linear(sentences, attn.v.weight, attn.v.bias), attn.heads).contiguous())
        first = self.spec.layers[0].self_attn
        cache = StaticKVCache(len(self.spec.layers), rows, first.heads, max_len, first.head_dim,
                              encoder_hidden.dtype, encoder_hidden.device)
        positions = POOL.take((rows,), torch.int64, encoder_hidden.device)
        return DecodeState(cache, cross_keys, cross_values, keep, expand, positions)

    def step(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [N, T] at the next positions; returns float32 logits of the last one, [N, V]."""
        spec, cache = self.spec, state.cache
        rows, length = tokens.shape
        start = cache.length
        if start + length > cache.max_len:
            raise RuntimeError(f"decoder cache of {cache.max_len} positions is full")
        state.positions.fill_(start)
        position_ids = torch.arange(start + spec.position_offset, start + spec.position_offset + length,
                                    device=tokens.device).expand(rows, length)
        hidden = ops.embedding(tokens, spec.token_embedding, spec.embed_scale, spec.position_table,
                               position_ids.contiguous())
        if spec.embedding_norm is not None:
            hidden = apply_norm(spec.embedding_norm, norm_kind(spec.embedding_norm), hidden)
        for index, layer in enumerate(spec.layers):
            hidden = run_block(spec.block, hidden, [
                (lambda h, i=index, a=layer.self_attn: self._self_attention(state, i, a, h), layer.self_norm),
                (lambda h, i=index, a=layer.cross_attn: self._cross_attention(state, i, a, h), layer.cross_norm),
                (lambda h, m=layer.module: feed_forward(m, spec.block, h), layer.ffn_norm),
            ])
        cache.length = start + length
        last = hidden[:, -1]
        if spec.final_norm is not None:
            last = apply_norm(spec.final_norm, norm_kind(spec.final_norm), last)
        logits = F.linear(last, spec.lm_head)
        if spec.logits_bias is not None:
            logits = logits + spec.logits_bias
        return logits.float()

    def _self_attention(self, state: DecodeState, index: int, attn: AttentionWeights, h: torch.Tensor):
        rows, length, _ = h.shape
        query = _split_heads(F.linear(h, attn.q.weight, attn.q.bias), attn.heads)
        key = _split_heads(F.linear(h, attn.k.weight, attn.k.bias), attn.heads)
        value = _split_heads(F.linear(h, attn.v.weight, attn.v.bias), attn.heads)
        out = ops.attention(query, state.cache.keys[index], state.cache.values[index], key, value,
                            state.positions, None, attn.scaling, True)
        return F.linear(out.view(rows, length, -1), attn.out.weight, attn.out.bias)

    def _cross_attention(self, state: DecodeState, index: int, attn: AttentionWeights, h: torch.Tensor):
        rows, length, width = h.shape
        sentences, expand = rows // state.expand, state.expand
        query = F.linear(h, attn.q.weight, attn.q.bias)
        # Each sentence's rows (beams) become extra queries over that sentence's encoder K/V.
        query = query.view(sentences, expand * length, attn.heads, -1).transpose(1, 2)
        out = ops.attention(query, state.cross_keys[index], state.cross_values[index], None, None, None,
                            state.encoder_keep, attn.scaling, False)
        return F.linear(out.view(rows, length, width), attn.out.weight, attn.out.bias)
