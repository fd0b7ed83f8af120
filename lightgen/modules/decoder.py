"""A generic decoder step on a static KV cache, for encoder-decoder and decoder-only models.

Adapters describe a family's decoder with ``DecoderSpec`` (the same Parameter objects and modules
the model holds, no copies); ``Decoder`` then runs one decoding step for any of them: fused
embedding lookup, self-attention writing K/V into the preallocated cache, cross-attention over
encoder K/V computed once per sentence (not per beam), the shared ``run_block`` and the LM head
for the last position only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Callable

import torch
from torch import nn

from lightgen import ops
from lightgen._compat import sdpa_packs_gqa
from lightgen.modules import native_step, step_graph
from lightgen.modules.attention import even_spread, with_even_keyless
from lightgen.modules.block import BlockSpec, feed_forward, run_block
from lightgen.modules.kv_cache import POOL, StaticKVCache
from lightgen.modules.linear import apply_linear, current_weights, kernel_weights
from lightgen.modules.norm import apply_norm
from lightgen.modules.position_bias import RelativePositionBias

DECODER_ATTR = "_lightgen_decoder"  # where an adapter attaches a model's Decoder for the generation engine
# Where an adapter attaches the function that accelerates a model (the engine accelerates an assistant with it).
ACCELERATE_ATTR = "_lightgen_accelerate"


class NoEngine(Exception):
    """Raised by an adapter's decoder builder: this model generates with HF's loop, for the reason given."""


@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    q: nn.Module  # nn.Linear, or with k = v = None a fused q|k|v projection (GPT-2's Conv1D, Phi-3's qkv_proj)
    k: nn.Module | None
    v: nn.Module | None
    out: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    # The fused projection holds [q | k | v] per head (GPT-NeoX), not all q, then all k, then all v.
    interleaved_qkv: bool = False
    q_norm: nn.Module | None = None  # per-head norms on q and k before rotary (Qwen3, Gemma 3)
    k_norm: nn.Module | None = None
    scale_queries: bool = False  # q is multiplied by ``scaling`` before the dot products (OPT), not the scores
    window: int = 0  # sliding window (HF's ``sliding_window``: keys seen, the query's own included); 0: none
    softcap: float = 0.0  # tanh soft-capping of the scores (Gemma 2's attn_logit_softcapping); 0: none
    upcast: bool = False  # eager attention keeps the scores in float32 (GPT-2's reorder_and_upcast_attn)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, T, E] -> q [N, H, T, D], k and v [N, Hkv, T, D] (views, unless normed or scaled)."""
        if self.k is None:
            qkv = apply_linear(self.q, h)
            if self.interleaved_qkv:
                rows, length, _ = qkv.shape
                per_head = qkv.view(rows, length, self.heads, 3 * self.head_dim).transpose(1, 2)
                q, k, v = per_head.chunk(3, dim=-1)
            else:
                q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
                q, k, v = (_split_heads(t, heads) for t, heads in zip(
                    qkv.split([q_width, kv_width, kv_width], dim=-1), (self.heads, self.kv_heads, self.kv_heads),
                    strict=True))
        else:
            q = _split_heads(apply_linear(self.q, h), self.heads)
            k, v = (_split_heads(apply_linear(proj, h), self.kv_heads) for proj in (self.k, self.v))
        if self.q_norm is not None:
            q, k = apply_norm(self.q_norm, q), apply_norm(self.k_norm, k)
        if self.scale_queries:
            q = q * self.scaling
        return q, k, v

    @property
    def score_scale(self) -> float:
        return 1.0 if self.scale_queries else self.scaling


@dataclasses.dataclass(frozen=True)
class DecoderLayerWeights:
    self_attn: AttentionWeights
    self_norm: nn.Module
    ffn_owner: nn.Module  # owns the FFN modules named in the BlockSpec
    ffn_norm: nn.Module
    cross_attn: AttentionWeights | None = None
    cross_norm: nn.Module | None = None
    # Norms on a sublayer's output before its residual add (Gemma 2/3's post-attention and post-FFN norms).
    self_out_norm: nn.Module | None = None
    ffn_out_norm: nn.Module | None = None
    rotary: Callable | None = None  # this layer's (x, position_ids) -> (cos, sin), when not the spec's (Gemma 3)

    def step_linears(self, block: BlockSpec) -> tuple:
        """The linears a decoder step runs, in the native step's slot order (None: absent): q, k, v, out (k and v
        None where q is a fused q|k|v), cross-attention q and out (its k and v run once, at ``Decoder.start``), the
        FFN's input (a second one: separate gate and up) and output."""
        attn, cross = self.self_attn, self.cross_attn
        ffn = [getattr(self.ffn_owner, name) for name in block.ffn_in]  # one: a fused gate|up projection
        return (attn.q, attn.k, attn.v, attn.out, getattr(cross, "q", None), getattr(cross, "out", None),
                ffn[0], ffn[1] if len(ffn) == 2 else None, getattr(self.ffn_owner, block.ffn_out))


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    block: BlockSpec
    layers: tuple[DecoderLayerWeights, ...]
    token_embedding: torch.Tensor  # [V, E]
    lm_head: nn.Module  # the model's output projection (patched: it runs the decode matmul)
    embed_scale: float = 1.0
    position_table: torch.Tensor | None = None  # [P, E]: learned, or a fixed sinusoidal table
    position_offset: int = 0  # BART's learned positions start at index 2
    rotary: nn.Module | None = None  # HF rotary embedding module: (x, position_ids) -> (cos, sin)
    apply_rotary: object = None  # HF's apply_rotary_pos_emb for that family
    embedding_norm: nn.Module | None = None
    final_norm: nn.Module | None = None
    logits_bias: torch.Tensor | None = None  # [1, V]
    logits_softcap: float = 0.0  # logits -> tanh(logits / cap) * cap (Gemma 2's final_logit_softcapping); 0: none
    # OPT-350m: the embedding width differs from the model width; projections in (after the lookup, before the
    # positions are added) and out (after the final norm).
    project_in: nn.Module | None = None
    project_out: nn.Module | None = None
    # T5: a relative position bias on the self-attention scores, shared by all layers.
    relative_position_bias: RelativePositionBias | None = None
    lm_head_input_scale: float = 1.0  # T5 with tied embeddings: the LM head reads hidden * d_model**-0.5
    # fairseq's make_positions (M2M100/NLLB): a token equal to this id takes position row ``padding_idx`` (zeros).
    position_padding_idx: int | None = None
    # GPT-2 adds ``wte(token_type_ids)`` to its input; None: the family takes no token types.
    token_type_embedding: torch.Tensor | None = None
    # What HF's forward multiplies a prompt given as embeddings (``inputs_embeds``) by: 1 where the scale lives in
    # the embedding module's lookup (BART, mBART, Gemma), the decoder's ``embed_scale`` where the forward applies
    # it after the lookup (Marian, Pegasus).
    input_embeds_scale: float = 1.0

    @property
    def position_limit(self) -> int:
        """Positions the model can embed: its table's, and no limit for rotary models (HF computes their
        angles for any position, past ``max_position_embeddings`` too)."""
        if self.position_table is not None:
            return self.position_table.shape[0] - self.position_offset
        return 1 << 62


def _with_out_norm(call: Callable, norm: nn.Module | None) -> Callable:
    return call if norm is None else lambda h: apply_norm(norm, call(h))


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, T, H*D] -> [N, H, T, D] (a view)."""
    rows, length, width = x.shape
    return x.view(rows, length, heads, width // heads).transpose(1, 2)


class KeySpan(typing.NamedTuple):
    """The keys HF's cache layer hands attention in a prompt pass: this cache's slots from ``first`` to the pass's
    end, and ``keys`` in all (more where a static layer hands its unwritten slots too, zeros)."""

    first: int
    keys: int


@dataclasses.dataclass
class Observed:
    """What HF's forward returns with ``output_attentions`` / ``output_hidden_states``, collected step by step
    as HF's generate collects them: a tuple per step, of one tensor per layer."""

    attentions: bool
    hidden_states: bool
    # Per layer: HF's cache (a DynamicSlidingWindowLayer) hands attention the last ``window - 1`` cached keys
    # and the new ones, so its weights cover those keys only; 0: every key (a DynamicLayer).
    windows: tuple[int, ...]
    self_attentions: tuple = ()
    cross_attentions: tuple = ()
    hidden: tuple = ()

    def fields(self, encoder_decoder: bool, encoder_outputs=None) -> dict:
        """HF's output fields, in its output classes' order."""
        attentions = self.self_attentions if self.attentions else None
        hidden = self.hidden if self.hidden_states else None
        if not encoder_decoder:
            return dict(attentions=attentions, hidden_states=hidden)
        return dict(encoder_attentions=encoder_outputs.get("attentions") if self.attentions else None,
                    encoder_hidden_states=encoder_outputs.get("hidden_states") if self.hidden_states else None,
                    decoder_attentions=attentions, cross_attentions=self.cross_attentions if self.attentions else None,
                    decoder_hidden_states=hidden)


class DecodeState:
    """Per-request decoder memory: self-attention cache, key mask, positions, cross K/V."""

    def __init__(self, cache: StaticKVCache, key_keep: torch.Tensor | None, next_position: torch.Tensor,
                 cross_keys=(), cross_values=(), encoder_keep=None, expand: int = 1,
                 position_limit: int | None = None) -> None:
        self.cache = cache
        self.key_keep = key_keep  # [N, max_len] bool, only when the prompt is padded or HF's cache static
        self.next_position = next_position  # [N] int64: position id of each row's next token
        # Positions each row has filled in the cache; rows differ only after a rollback.
        self.lengths = POOL.take(next_position.shape, torch.int64, next_position.device).zero_()
        self._pooled = [t for t in (key_keep, next_position, self.lengths) if t is not None]
        self.cross_keys = list(cross_keys)  # per layer [B, H, S, D]
        self.cross_values = list(cross_values)
        self.encoder_keep = encoder_keep  # [B, S] bool
        self.expand = expand  # decoder rows per sentence (beams or returned sequences)
        self._cross_rows: dict[int, tuple[torch.Tensor, ...]] = {}  # fp16 / bf16: per layer, K/V/keep per row
        self.position_limit = position_limit  # set when steps may run past the position table
        self.cached_prompt = 0  # prompt tokens a caller's cache holds: the first step feeds the rest
        self.position_bias_table = None  # [H, 2 * max_len - 1] with a relative position bias
        self.prompt_embeds = None  # [N, L, E]: the prompt given as embeddings (``inputs_embeds``), for ``prefill``
        # [N, L] GPT-2's token_type_ids of the prompt; every later token takes its row's last one (as HF's generate
        # extends them).
        self.token_types = None
        self.observed: Observed | None = None  # set when the caller asked for attentions or hidden states
        # Set for a model whose HF attention is eager: per layer, the keys HF's cache layer hands attention in the
        # prompt pass (``KeySpan``). A prompt position that sees no key then takes eager's even spread over them,
        # weights and output, where the kernels (as sdpa) give zeros: HF returns them in hidden states and
        # attentions, and the layers after carry them into the cache.
        self.eager_spans: tuple[KeySpan, ...] | None = None
        self.eager_softmax_in_dtype = False  # that eager attention's softmax runs in fp16 / bf16, not float32
        # Per layer, the slots of HF's static cache layer (0: dynamic), all of which fp16 / bf16 attention gets.
        self.static_slots: tuple[int, ...] | None = None
        self.in_prompt = False  # during ``prefill``: HF runs it as one pass; every later pass stands for HF's steps
        # HF's forward has no ``logits_to_keep`` (the BART family, M2M100, T5): its prompt pass runs the LM head over
        # every position, and fp16 / bf16 matmuls round a row otherwise at other row counts (``_step``).
        self.prompt_head_everywhere = False
        self.native_plan = None  # the decoder's native_step.Plan for this request, once a step asked for it
        self.step_graph: step_graph.StepGraph | None = None  # on a GPU, once a one-token step ran

    @property
    def eager(self) -> bool:
        """The model runs HF's eager attention: fp16 / bf16 attention rounds as it does (``ops.attention``)."""
        return self.eager_spans is not None

    @property
    def spreading(self) -> bool:
        """The prompt pass of a padded prompt on HF's eager attention: positions that see no key spread."""
        return self.in_prompt and self.eager and self.key_keep is not None

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search picked ``rows``: rows of the same sentence swap caches, masks and positions (in place
        while a step graph reads them, as long as the number of rows stays)."""
        in_place = self.step_graph is not None
        self.cache.select_rows(rows, keep_addresses=in_place)
        if self.key_keep is not None:
            self.key_keep = _select_rows(self.key_keep, rows, in_place)
        self.next_position = _select_rows(self.next_position, rows, in_place)
        self.lengths = _select_rows(self.lengths, rows, in_place)
        if self.token_types is not None:
            self.token_types = self.token_types.index_select(0, rows)

    def addresses(self) -> tuple:
        """Where the tensors a one-token step reads are (a step graph replays with these)."""
        tensors = (*self.cache.keys, *self.cache.values, self.key_keep, self.next_position, self.lengths,
                   *self.cross_keys, *self.cross_values, self.encoder_keep, self.position_bias_table)
        return self.cache.rows, *(t.data_ptr() if t is not None else 0 for t in tensors)

    def roll_back(self, rejected: torch.Tensor) -> None:
        """Forget each row's last ``rejected[row]`` positions (a moved length, nothing copied)."""
        self.lengths -= rejected
        self.next_position -= rejected
        self.cache.length = int(self.lengths.max())

    def cross_attended(self, index: int, dtype: torch.dtype):
        """(keys, values, keep) that layer ``index``'s cross-attention runs on: one sentence's, whose decoder rows
        (beams) attend as extra queries; in fp16 / bf16 each row's, as HF's cache holds them, since torch's sdpa
        and matmuls round a sentence's beams as one block of queries otherwise than each row alone."""
        keys, values, keep = self.cross_keys[index], self.cross_values[index], self.encoder_keep
        if dtype == torch.float32 or self.expand == 1:
            return keys, values, keep
        if index not in self._cross_rows:
            self._cross_rows[index] = tuple(t.repeat_interleave(self.expand, 0) for t in (keys, values, keep))
        return self._cross_rows[index]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows (one row per sentence): the rest keep decoding at smaller shapes."""
        if self.expand != 1:
            raise ValueError("finished rows can only be dropped with one decoder row per sentence")
        self.reorder(rows)
        # Rows' lengths differ after a rollback: the longest may have left.
        self.cache.length = int(self.lengths.max())
        self.cross_keys = [keys.index_select(0, rows) for keys in self.cross_keys]
        self.cross_values = [values.index_select(0, rows) for values in self.cross_values]
        if self.encoder_keep is not None:
            self.encoder_keep = self.encoder_keep.index_select(0, rows)

    def release(self) -> None:
        self.step_graph = None  # its memory pool with it
        self.cache.release()
        POOL.give_back(*self._pooled)


def _spread_keyless(state: DecodeState, span: KeySpan, attn: AttentionWeights, query: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """A prompt pass's ``out`` [N, T, H, D] with eager's result at the positions that see no key (padding before a
    row's first real token, within the window), where each key HF's cache layer hands attention is masked at the
    dtype's lowest. float32's lowest absorbs every score: an even spread, the mean of the values. In fp16 / bf16
    eager's own ops run on those keys, over each such row's queries as HF's matmuls take them: fp16's -65504 does
    not absorb scores of 16 and more, which round it apart (all to -inf: NaN, which HF's row carries on), and GPT-2's
    upcast attention adds it to float32 scores, a softmax over the scores. Their (rows, steps, weights [K, H, keys])
    come back too, else None."""
    past, end = state.cache.length, state.cache.length + out.shape[1]
    seen = torch.nn.functional.pad(state.key_keep[:, :end].cumsum(-1), (1, 0))  # [:, k]: kept keys before slot k
    positions = torch.arange(past, end, device=out.device)
    first = (positions - attn.window + 1).clamp_min(0) if attn.window else torch.zeros_like(positions)
    keyless = seen[:, positions + 1] == seen[:, first]
    if out.dtype == torch.float32 or not bool(keyless.any()):
        return with_even_keyless(out, lambda: even_spread(values[:, :, span.first:end], span.keys), keyless), None
    affected = keyless.any(-1).nonzero().flatten()
    empty = span.keys - (end - span.first)  # a static cache layer's slots past the prompt: zeros in HF's
    handed = [ops.repeat_kv(torch.nn.functional.pad(cache[affected, :, span.first:end], (0, 0, 0, empty)),
                        query.shape[1] // cache.shape[1]) for cache in (keys, values)]
    queries, lowest = query[affected], torch.finfo(out.dtype).min
    if attn.upcast:  # GPT-2's reorder_and_upcast_attn: float32 scores (baddbmm), the dtype's mask added to them
        flat_keys = handed[0].transpose(-1, -2).flatten(0, 1)
        scores = torch.baddbmm(flat_keys.new_empty(flat_keys.shape[0], queries.shape[2], flat_keys.shape[2]).float(),
                               queries.flatten(0, 1).float(), flat_keys.float(), beta=0, alpha=attn.score_scale)
        weights = torch.softmax(scores.view(*queries.shape[:3], -1) + lowest, -1).to(out.dtype)
    else:
        scores = torch.matmul(queries, handed[0].transpose(-1, -2)) * attn.score_scale
        if attn.softcap:
            scores = torch.tanh(scores / attn.softcap) * attn.softcap
        scores = scores + lowest
        weights = (torch.softmax(scores, -1) if state.eager_softmax_in_dtype
                   else torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype))
    rows, steps = keyless.nonzero(as_tuple=True)
    within = torch.searchsorted(affected, rows)  # each keyless position's row among the affected ones
    out[rows, steps] = torch.matmul(weights, handed[1])[within, :, steps]
    return out, (rows, steps, weights[within, :, steps])


def _select_rows(t: torch.Tensor, rows: torch.Tensor, in_place: bool) -> torch.Tensor:
    picked = t.index_select(0, rows)
    if in_place and picked.shape == t.shape:
        return t.copy_(picked)
    return picked


class Decoder:
    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        # Why the layers of a step cannot run as one native call (modules/native_step.py); None: they can.
        self.native_reason = native_step.unsupported(spec)
        self.native_steps = 0  # steps whose layers ran natively

    def kernel_rows(self, state: DecodeState) -> float:
        """The most positions a step of ``state``'s request may feed with every linear on the kernel a one-token step
        runs (inf: no row limit). Past it ATen runs the fp32 ones, whose sums round otherwise: a draft verified there
        could part from greedy's tokens at a near-tie. The layers' limit is the request's native plan's where it has
        one (its walk over the layers' weights is made once a request either way: ~150 us on the demo model)."""
        spec = self.spec
        plan = self._request_plan(state)
        modules = [spec.lm_head, spec.project_in, spec.project_out]
        if not plan:
            modules += [linear for layer in spec.layers for linear in layer.step_linears(spec.block)]
        weights = [current_weights(module) for module in modules if module is not None]
        rows = min((found.max_rows for found in weights if found is not None), default=math.inf)
        return min(rows, plan.max_rows) if plan else rows

    def start(self, rows: int, max_len: int, dtype: torch.dtype, device, *, prompt_mask=None, encoder_hidden=None,
              encoder_mask=None, expand: int = 1, spare_positions: int = 0) -> DecodeState:
        """Allocate memory for ``rows`` decoder rows and ``max_len`` positions.

        ``spare_positions`` extra cache slots take padding that is written and rolled back (drafts).
        ``prompt_mask`` [N, L] marks real prompt tokens of a (left-)padded decoder-only batch.
        Encoder inputs are per row ([N, S, E]: HF repeats each sentence ``expand`` times) and are
        de-duplicated here, so cross-attention K/V exist once per sentence.
        """
        first = self.spec.layers[0].self_attn
        cache = StaticKVCache(len(self.spec.layers), rows, first.kv_heads, max_len + spare_positions, first.head_dim,
                              dtype, device)
        next_position = POOL.take((rows,), torch.int64, device).zero_()
        key_keep = None
        if prompt_mask is not None:
            key_keep = POOL.take((rows, max_len + spare_positions), torch.bool, device).fill_(True)
            key_keep[:, : prompt_mask.shape[1]] = prompt_mask.bool()
        # Past the table HF fails when a step gets there (often it stops at EOS first): steps check then.
        position_limit = self.spec.position_limit if max_len > self.spec.position_limit else None
        if encoder_hidden is None:
            return self._with_bias_table(DecodeState(cache, key_keep, next_position, position_limit=position_limit))
        # Contiguous, as HF's projections see the (repeated) encoder output: a strided view takes another matmul
        # path whose bf16 results differ (27% of a Marian cross-attention's keys, flipping beams).
        sentences = encoder_hidden[::expand].contiguous()
        encoder_keep = (torch.ones(sentences.shape[:2], dtype=torch.bool, device=sentences.device)
                        if encoder_mask is None else encoder_mask[::expand].bool())
        # fp16 / bf16: the projections run over every row's copy, as HF's cache makes them, and each sentence keeps its
        # first: ATen's half matmul rounds a row otherwise at another row count (a bf16 BART's beams over a padded
        # sentence: 6 rows' keys, not 2). fp32's kernels compute a row the same at any count.
        projected, stride = ((encoder_hidden.contiguous(), expand) if encoder_hidden.dtype != torch.float32
                             else (sentences, 1))
        cross_keys, cross_values = [], []
        for layer in self.spec.layers:
            attn = layer.cross_attn
            cross_keys.append(_split_heads(apply_linear(attn.k, projected)[::stride], attn.kv_heads).contiguous())
            cross_values.append(_split_heads(apply_linear(attn.v, projected)[::stride], attn.kv_heads).contiguous())
        return self._with_bias_table(DecodeState(cache, key_keep, next_position, cross_keys, cross_values,
                                                 encoder_keep, expand, position_limit))

    def _with_bias_table(self, state: DecodeState) -> DecodeState:
        if self.spec.relative_position_bias is not None:
            state.position_bias_table = self.spec.relative_position_bias.table(state.cache.max_len)
        return state

    def _position_rows(self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the position table for ``tokens`` at ``positions``."""
        spec = self.spec
        rows = positions + spec.position_offset
        pad = spec.position_padding_idx
        if pad is None:
            return rows.contiguous()
        real = tokens != pad
        if state.cache.length == 0:
            # HF numbers a prompt's real tokens with a cumulative sum (a padding token takes no position);
            # after it, one token a step, every token counts and only a padding token itself takes row pad.
            rows = positions[:, :1] + torch.cumsum(real, dim=1) - 1 + spec.position_offset
        return torch.where(real, rows, pad)

    def _self_attention_mask(self, state: DecodeState, positions: torch.Tensor) -> torch.Tensor | None:
        """The key mask of a padded prompt, with a relative position bias (additive) folded in."""
        if state.position_bias_table is None:
            return state.key_keep
        bias = RelativePositionBias.scores_bias(state.position_bias_table, positions, state.cache.max_len)
        if state.key_keep is not None:
            bias = bias.masked_fill(~state.key_keep[:, None, None, :], float("-inf"))
        return bias

    def prefill(self, state: DecodeState, input_ids: torch.Tensor, positions: torch.Tensor | None = None):
        """The prompt pass: the prompt's tokens (or its ``state.prompt_embeds``) after those a caller's cache
        holds (``state.cached_prompt``; all of them without one), with their token types."""
        cached, embeds = state.cached_prompt, state.prompt_embeds
        prompt = embeds if embeds is not None else input_ids
        if cached and cached >= prompt.shape[1]:
            raise ValueError(f"lightgen generate: the cache holds {cached} positions and the input has "
                             f"{prompt.shape[1]}: continuing needs at least one token after the cached ones")
        length = prompt.shape[1] - cached
        types = state.token_types[:, -length:] if state.token_types is not None else None
        if positions is not None:  # HF keeps the last ones, as many as it feeds
            positions = positions[:, -length:]
        state.in_prompt = True
        try:
            if embeds is not None:
                return self.step(state, None, positions, embeds=embeds[:, cached:], token_types=types)
            return self.step(state, input_ids[:, cached:], positions, token_types=types)
        finally:
            state.in_prompt = False

    def step(self, state: DecodeState, tokens: torch.Tensor | None, positions: torch.Tensor | None = None,
             all_positions: bool = False, scored: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
             token_types: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``tokens`` [N, T]; returns float32 logits of the last position [N, V], of every
        position [N, T, V] with ``all_positions`` (to verify a draft in one pass), or of the positions
        ``scored`` [N, T] (bool) marks, [M, V] in row-major order (verification skips the padding after
        short drafts: the LM head is the largest matmul of a pass, a third of it on the demo model).

        ``positions`` [N, T] gives position ids (HF's, for padded prompts); by default each row
        continues from its last position. ``embeds`` [N, T, E] replaces the tokens' lookup (HF's
        ``inputs_embeds``; ``tokens`` is then None); ``token_types`` [N, T] (GPT-2's token_type_ids) default
        to each row's last prompt token type. With ``state.observed`` set, the step also records HF's
        attentions and hidden states. One-token steps after the prompt on a GPU replay the request's CUDA graph
        (``_replayable``; modules/step_graph.py), the same computation as ``_step``.
        """
        cache = state.cache
        length = (tokens if embeds is None else embeds).shape[1]
        if cache.length + length > cache.max_len:
            raise RuntimeError(f"decoder cache of {cache.max_len} positions is full")
        if (positions is None and not all_positions and scored is None and embeds is None and token_types is None
                and self._replayable(state, tokens)):
            if state.step_graph is None:
                state.step_graph = step_graph.StepGraph(functools.partial(self._step, state), state.addresses, cache)
            return state.step_graph(tokens)
        return self._step(state, tokens, positions, all_positions, scored, embeds, token_types)

    @staticmethod
    def _replayable(state: DecodeState, tokens: torch.Tensor) -> bool:
        """A one-token step after the prompt on a GPU, with nothing the host decides per step (a position limit
        check, token types, recorded attentions): it can run as a replayed CUDA graph."""
        return (tokens.is_cuda and tokens.shape[1] == 1 and state.cache.length > 0 and state.token_types is None
                and state.observed is None and state.position_limit is None and step_graph.enabled())

    def _step(self, state: DecodeState, tokens: torch.Tensor | None, positions: torch.Tensor | None = None,
              all_positions: bool = False, scored: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
              token_types: torch.Tensor | None = None) -> torch.Tensor:
        spec, cache = self.spec, state.cache
        rows, length = (tokens if embeds is None else embeds).shape[:2]
        device = (tokens if embeds is None else embeds).device
        if positions is None:
            positions = state.next_position[:, None] + torch.arange(length, device=device)
        if state.position_limit is not None and int(positions.max()) >= state.position_limit:
            raise IndexError(f"position {int(positions.max())} is past the model's {state.position_limit} positions "
                             f"(max_position_embeddings): Hugging Face's forward fails here too")
        if token_types is None and state.token_types is not None:
            token_types = state.token_types[:, -1:].expand(rows, length)
        hidden = self._embed(state, tokens, positions, embeds, token_types)
        if spec.embedding_norm is not None:
            hidden = apply_norm(spec.embedding_norm, hidden)
        hidden = self._layers(state, hidden, positions)
        cache.length += length
        state.lengths += length
        state.next_position.copy_(positions[:, -1] + 1)
        # A multi-token prompt pass in fp16 / bf16 runs the head over every position where HF's does, and keeps the
        # last: ATen's half matmul rounds a row otherwise at another row count (a bf16 Pegasus decoder prompt of 3
        # tokens: 2 of 97 logits an ulp apart). fp32 rows run lightgen's kernels, whose rows do not depend on others.
        whole_prompt = (not all_positions and scored is None and state.in_prompt and state.prompt_head_everywhere
                        and length > 1 and hidden.dtype != torch.float32)
        last = hidden[scored] if scored is not None else hidden if all_positions or whole_prompt else hidden[:, -1]
        if spec.final_norm is not None:
            last = apply_norm(spec.final_norm, last)
        if spec.project_out is not None:
            last = apply_linear(spec.project_out, last)
        if spec.lm_head_input_scale != 1.0:
            last = last * spec.lm_head_input_scale
        logits = self._vocabulary_logits(last)
        return (logits[:, -1] if whole_prompt else logits).float()

    def _layers(self, state: DecodeState, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every decoder layer on ``hidden`` [N, T, E], the step's K/V written into the cache: one native call
        where the spec and the step allow it (the same result; not when attentions or hidden states are
        recorded), else the loop below, which specifies it."""
        spec = self.spec
        self_mask = self._self_attention_mask(state, positions)
        observed = state.observed
        plan = self._native_plan(state, hidden) if observed is None and not state.spreading else None
        if plan is not None:
            self.native_steps += 1
            tables = [rotary(hidden, positions) for rotary in plan.rotaries]
            return native_step.run(plan, state, hidden, tables, self_mask)
        tables = {}  # rotary cos/sin per rotary module, computed once per step
        weights = ([], []) if observed is not None and observed.attentions else (None, None)
        hiddens = [hidden] if observed is not None and observed.hidden_states else None
        for index, layer in enumerate(spec.layers):
            rotary = layer.rotary or spec.rotary
            if rotary is not None and id(rotary) not in tables:
                tables[id(rotary)] = rotary(hidden, positions)
            attend = functools.partial(self._self_attention, state, index, layer.self_attn,
                                       rotary=tables.get(id(rotary)), mask=self_mask, weights=weights[0])
            sublayers = [(_with_out_norm(attend, layer.self_out_norm), layer.self_norm)]
            if layer.cross_attn is not None:
                sublayers.append((functools.partial(self._cross_attention, state, index, layer.cross_attn,
                                                    weights=weights[1]), layer.cross_norm))
            ffn = functools.partial(feed_forward, layer.ffn_owner, spec.block)
            sublayers.append((_with_out_norm(ffn, layer.ffn_out_norm), layer.ffn_norm))
            hidden = run_block(spec.block, hidden, sublayers)
            if hiddens is not None:
                hiddens.append(hidden)
        if observed is not None:
            self._observe(observed, weights, hiddens, state.eager)
        return hidden

    def _native_plan(self, state: DecodeState, hidden: torch.Tensor) -> native_step.Plan | None:
        plan = self._request_plan(state)
        return plan if plan and plan.takes(hidden) else None

    def _request_plan(self, state: DecodeState) -> native_step.Plan | bool | None:
        """The native plan of ``state``'s request (None: the spec has none; False: some projection runs on ATen)."""
        if self.native_reason is not None:
            return None
        if state.native_plan is None:  # once per request: the packed weights are current while it decodes
            state.native_plan = native_step.plan(self.spec) or False
        return state.native_plan

    def _observe(self, observed: Observed, weights, hiddens, eager: bool) -> None:
        """Record this step's attention weights (over the keys HF's cache layer hands attention; a query without
        keys spread evenly over them with ``eager``, as HF's eager softmax does) and hidden states (the last one
        after the final norm, as HF's ``last_hidden_state``)."""
        self_weights, cross_weights = weights
        if self_weights is not None:
            past, end = self_weights[0][1], self_weights[0][2]
            kept = [probs[..., max(0, past - window + 1) if window else 0:end]
                    for (probs, _, _), window in zip(self_weights, observed.windows, strict=True)]
            if eager:
                kept = [torch.where(probs.sum(-1, keepdim=True) == 0, 1.0 / probs.shape[-1], probs) for probs in kept]
            observed.self_attentions += (tuple(kept),)
            if cross_weights:
                observed.cross_attentions += (tuple(cross_weights),)
        if hiddens is not None:
            last = hiddens[-1]
            if self.spec.final_norm is not None:
                last = apply_norm(self.spec.final_norm, last)
            if self.spec.project_out is not None:
                last = apply_linear(self.spec.project_out, last)
            observed.hidden += ((*hiddens[:-1], last),)

    def _embed(self, state: DecodeState, tokens: torch.Tensor | None, positions: torch.Tensor, embeds=None,
               token_types=None) -> torch.Tensor:
        hidden = self._embed_tokens(state, tokens, positions, embeds)
        if token_types is not None:  # after the positions, as GPT-2 adds them
            hidden = hidden + ops.embedding(token_types, self.spec.token_type_embedding)
        return hidden

    def _embed_tokens(self, state: DecodeState, tokens: torch.Tensor | None, positions: torch.Tensor,
                      embeds=None) -> torch.Tensor:
        spec = self.spec
        table_positions = None
        if spec.position_table is not None:
            if embeds is not None and spec.position_padding_idx is not None:
                raise ValueError("lightgen generate: a prompt given as embeddings has no padding tokens to number "
                                 "positions around (M2M100's positions skip them)")
            table_positions = self._position_rows(state, tokens, positions)
        if embeds is not None:
            hidden = embeds * spec.input_embeds_scale if spec.input_embeds_scale != 1.0 else embeds
        elif spec.project_in is not None or table_positions is None:
            hidden = ops.embedding(tokens, spec.token_embedding, spec.embed_scale)
        else:
            return ops.embedding(tokens, spec.token_embedding, spec.embed_scale, spec.position_table, table_positions)
        if spec.project_in is not None:  # positions are added after the projection, as HF's OPT does
            hidden = apply_linear(spec.project_in, hidden)
        if table_positions is None:
            return hidden
        return hidden + ops.embedding(table_positions, spec.position_table)

    def _vocabulary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head plus the model's extra logits bias (BART's final_logits_bias), the bias fused into the
        matmul where the kernel runs the head: added afterwards, it cost a pass that reads every logit back
        from the core that wrote it (a BART batch-8 step: ~0.4 ms of 11)."""
        head, bias, cap = self.spec.lm_head, self.spec.logits_bias, self.spec.logits_softcap
        weights = None
        if bias is not None and bias.dtype == torch.float32 and getattr(head, "bias", None) is None:
            weights = kernel_weights(head, hidden)
        if weights is not None:
            logits = weights.run(hidden, bias.reshape(-1))
        else:
            logits = head(hidden)
            if bias is not None:
                logits = logits + bias
        return torch.tanh(logits / cap) * cap if cap else logits

    def _self_attention(self, state: DecodeState, index: int, attn: AttentionWeights, h: torch.Tensor, rotary=None,
                        mask=None, weights: list | None = None):
        """``weights``: a list to append (the attention weights, the cached length, the keys after the step) to."""
        rows, length, _ = h.shape
        query, key, value = attn.project(h)
        if rotary is not None:
            query, key = self.spec.apply_rotary(query, key, *rotary)
        keys, values = state.cache.layer(index)
        static_slots = state.static_slots[index] if state.static_slots else 0
        out = ops.attention(query, keys, values, key, value, state.lengths, mask, attn.score_scale, True,
                            attn.window, attn.softcap, stepwise=not state.in_prompt, eager=state.eager,
                            upcast=attn.upcast, softmax_in_dtype=state.eager_softmax_in_dtype,
                            pack_gqa=sdpa_packs_gqa(), static_slots=static_slots)
        keyless = None
        if state.spreading:
            out, keyless = _spread_keyless(state, state.eager_spans[index], attn, query, keys, values, out)
        if weights is not None:
            # Over the keys HF's cache layer hands (a full window's last ones): fp16 / bf16 scores round with their
            # matmul's width.
            first = max(0, state.cache.length - attn.window + 1) if attn.window else 0
            end = state.cache.length + length
            probs = ops.attention_probs(query, keys[:, :, first:end], state.lengths + length - first,
                                        None if mask is None else mask[..., first:end], attn.score_scale, True,
                                        attn.window, attn.softcap, state.eager, attn.upcast,
                                        state.eager_softmax_in_dtype)
            probs = torch.nn.functional.pad(probs, (first, keys.shape[2] - end))
            if keyless is not None:  # fp16 / bf16: eager's own weights there, over the keys HF's cache handed
                rows_without, steps_without, handed_weights = keyless
                probs[rows_without, :, steps_without, first:end] = handed_weights[..., :end - first].float()
            weights.append((probs.to(query.dtype), state.cache.length, end))
        return apply_linear(attn.out, out.view(rows, length, -1))

    def _cross_attention(self, state: DecodeState, index: int, attn: AttentionWeights, h: torch.Tensor,
                         weights: list | None = None):
        rows, length, _ = h.shape
        keys, values, keep = state.cross_attended(index, h.dtype)
        sentences = keys.shape[0]
        expand = rows // sentences
        # Each sentence's rows (beams) become extra queries over that sentence's encoder K/V (or rows of their own).
        query = apply_linear(attn.q, h).view(sentences, expand * length, attn.heads, -1).transpose(1, 2)
        out = ops.attention(query, keys, values, None, None, None, keep, attn.scaling, False, eager=state.eager,
                            softmax_in_dtype=state.eager_softmax_in_dtype)
        if weights is not None:  # [sentences, H, expand * T, S] -> per decoder row [rows, H, T, S]
            probs = ops.attention_probs(query, keys, torch.full((sentences,), keys.shape[2], device=h.device),
                                        keep, attn.scaling, False, eager=state.eager,
                                        softmax_in_dtype=state.eager_softmax_in_dtype)
            weights.append(probs.to(query.dtype).view(sentences, attn.heads, expand, length, -1).transpose(1, 2)
                           .reshape(rows, attn.heads, length, -1))
        return apply_linear(attn.out, out.view(rows, length, -1))  # heads x head_dim may differ from the width (T5)
