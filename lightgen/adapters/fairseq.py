"""fairseq's Transformer (``TransformerModel`` and its hub interface) on lightgen's decoder step.

fairseq's ``SequenceGenerator`` drives decoding through two decoder methods: ``forward(tokens,
encoder_out, incremental_state)`` for one step and ``reorder_incremental_state_scripting`` after
each beam selection. Patching exactly those two on the model instance puts lightgen's static-cache
``Decoder`` under every fairseq search (beam, greedy, sampling, diverse beams, prefixes, constraints,
ensembles) while fairseq's own code still makes every decision, so hypotheses and scores are
fairseq's. The decoding state lives in the ``incremental_state`` dict fairseq creates per
``generate`` call, so concurrent calls and ensemble members never share one. The encoder keeps
fairseq's forward (prefill gains nothing from the decode kernels).

Greedy decoding can also run as aggressive decoding: that strategy lives in
``lightgen.generation.fairseq_greedy`` (``AggressiveGenerator``, re-exported here); this adapter only
maps the decoder's weights, patches the model (and a hub's task) and hands the strategy the function
that starts decoding over each decoder.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch import nn

from lightgen._compat import check_fairseq_version
from lightgen.adapters.base import UnsupportedModelError
from lightgen.generation import fairseq_greedy
from lightgen.generation.fairseq_greedy import (  # noqa: F401  (their old import path)
    AggressiveGenerator,
    AggressiveStats,
    aggressive_generator,
    encoder_for_drafting,
    iad_unsupported,
)
from lightgen.modules.block import BlockSpec
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec, DecodeState

check_fairseq_version()

from fairseq.hub_utils import GeneratorHubInterface  # noqa: E402
from fairseq.models.transformer import TransformerDecoderBase  # noqa: E402
from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding  # noqa: E402
from fairseq.modules import gelu as fairseq_gelu  # noqa: E402

STATE_KEY = "lightgen"  # our entry in fairseq's per-call incremental_state dict
FIRST_CACHE_LEN = 64  # positions; the cache doubles when an output grows past it

# fairseq activation functions -> lightgen's fused bias+activation; others run fairseq's function.
_ACTIVATIONS = {F.relu: "relu", fairseq_gelu: "gelu"}


def allow_fairseq_checkpoints() -> None:
    """fairseq checkpoints pickle ``argparse.Namespace``; torch >= 2.6 loads with ``weights_only=True``.
    Allow exactly that class, not unsafe loading."""
    torch.serialization.add_safe_globals([argparse.Namespace])


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise UnsupportedModelError(f"lightgen cannot accelerate this fairseq decoder: {what}")


def _attention(mha) -> AttentionWeights:
    _require(mha.bias_k is None and mha.bias_v is None and not mha.add_zero_attn,
             "attention with bias_kv or add_zero_attn")
    return AttentionWeights(mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj, mha.num_heads, mha.num_heads,
                            mha.head_dim, mha.scaling)


def _check_norm(module) -> None:
    # Subclasses (Fp32LayerNorm, FusedLayerNorm) compute differently from nn.LayerNorm.
    _require(module is None or type(module) is nn.LayerNorm, f"norm of type {type(module).__name__}")


def _check_layer(layer, pre_norm: bool) -> None:
    _require(layer.encoder_attn is not None, "a decoder layer without encoder attention")
    _require(not layer.cross_self_attention, "cross_self_attention")
    for extra in ("attn_ln", "c_attn", "ffn_layernorm", "w_resid"):
        _require(getattr(layer, extra, None) is None, f"decoder layers with '{extra}' (scale_attn/heads/fc/resids)")
    _require(layer.normalize_before == pre_norm, "layers that mix pre- and post-norm")
    _require(type(layer.fc1) is nn.Linear and type(layer.fc2) is nn.Linear, "quantized or replaced fc1/fc2")
    for norm in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm):
        _check_norm(norm)


def check_decoder(decoder) -> None:
    """Raise ``UnsupportedModelError`` naming the first feature the decoder step does not implement."""
    _require(isinstance(decoder, TransformerDecoderBase), f"decoder of type {type(decoder).__name__}")
    _require(decoder.adaptive_softmax is None, "adaptive softmax")
    _require(decoder.project_in_dim is None and decoder.project_out_dim is None, "decoder input/output projections")
    _require(decoder.quant_noise is None, "quant-noise embeddings")
    _require(not decoder.cross_self_attention, "cross_self_attention")
    _require(decoder.output_projection.bias is None, "an output projection with a bias")
    positions = decoder.embed_positions
    _require(positions is None or type(positions) in (SinusoidalPositionalEmbedding, LearnedPositionalEmbedding),
             f"positions of type {type(positions).__name__}")
    _require(len(decoder.layers) > 0, "no decoder layers")
    _check_norm(decoder.layernorm_embedding)
    _check_norm(decoder.layer_norm)
    for layer in decoder.layers:
        _check_layer(layer, decoder.layers[0].normalize_before)
        _attention(layer.self_attn)
        _attention(layer.encoder_attn)


def build_decoder(decoder) -> Decoder:
    """The decoder's own modules and tensors mapped onto lightgen's spec (no copies).

    Built per ``generate`` call: the sinusoidal table is a buffer, which ``.to()`` replaces."""
    first = decoder.layers[0]
    block = BlockSpec(pre_norm=first.normalize_before, act=_ACTIVATIONS.get(first.activation_fn), ffn_in=("fc1",),
                      ffn_out="fc2", act_module="activation_fn")
    layers = tuple(
        DecoderLayerWeights(self_attn=_attention(layer.self_attn), self_norm=layer.self_attn_layer_norm,
                            ffn_owner=layer, ffn_norm=layer.final_layer_norm,
                            cross_attn=_attention(layer.encoder_attn), cross_norm=layer.encoder_attn_layer_norm)
        for layer in decoder.layers
    )
    positions = decoder.embed_positions
    table = None
    if isinstance(positions, SinusoidalPositionalEmbedding):
        table = positions.weights
    elif positions is not None:
        table = positions.weight
    return Decoder(DecoderSpec(
        block=block, layers=layers, token_embedding=decoder.embed_tokens.weight,
        lm_head=decoder.output_projection, embed_scale=float(decoder.embed_scale), position_table=table,
        # fairseq numbers the token at index t padding_idx + 1 + t.
        position_offset=decoder.padding_idx + 1,
        embedding_norm=decoder.layernorm_embedding, final_norm=decoder.layer_norm,
    ))


class _StateHolder:
    """Owns one call's ``DecodeState``; fairseq drops the incremental_state dict when ``generate``
    returns, and the pooled buffers go back with it."""

    def __init__(self, decoder: Decoder, state) -> None:
        self.decoder = decoder
        self.state = state

    def __del__(self) -> None:
        self.state.release()


def start_decoding(decoder_module, rows: int, encoder_out, max_len: int | None = None,
                   spare_positions: int = 0) -> tuple[Decoder, DecodeState]:
    """lightgen's decoder for a fairseq decoder, and a state for ``rows`` rows (one per sentence) over
    fairseq's encoder output; ``max_len`` positions, or without it a first cache that grows by doubling."""
    _require(encoder_out is not None and len(encoder_out["encoder_out"]) > 0, "decoding without encoder output")
    encoder_hidden = encoder_out["encoder_out"][0].transpose(0, 1)  # fairseq keeps [S, N, E]
    padding = encoder_out["encoder_padding_mask"]
    keep = ~padding[0] if len(padding) > 0 else None
    decoder = build_decoder(decoder_module)
    weight = decoder.spec.token_embedding
    state = decoder.start(rows=rows, max_len=max_len or min(FIRST_CACHE_LEN, decoder.spec.position_limit),
                          dtype=weight.dtype, device=weight.device, encoder_hidden=encoder_hidden,
                          encoder_mask=keep, spare_positions=spare_positions)
    return decoder, state


def _fast_path(decoder_module, incremental_state, flags) -> bool:
    if incremental_state is None or any(flags):
        return False
    holder = incremental_state.get(STATE_KEY)
    inference = not decoder_module.training and not torch.is_grad_enabled()
    if holder is not None and not inference:
        raise RuntimeError("lightgen: a fairseq decoding started in inference mode continued with autograd or "
                           "training enabled")
    # An incremental_state fairseq's own layers already fill stays theirs.
    return inference and (holder is not None or not incremental_state)


def decoder_forward(decoder_module, prev_output_tokens, encoder_out=None, incremental_state=None,
                    features_only=False, full_context_alignment=False, alignment_layer=None, alignment_heads=None,
                    src_lengths=None, return_all_hiddens=False):
    """fairseq ``TransformerDecoder.forward``; one incremental inference step runs on lightgen."""
    flags = (features_only, full_context_alignment, alignment_layer is not None, alignment_heads is not None,
             return_all_hiddens)
    if not _fast_path(decoder_module, incremental_state, flags):
        return decoder_module._lightgen_forward(
            prev_output_tokens, encoder_out=encoder_out, incremental_state=incremental_state,
            features_only=features_only, full_context_alignment=full_context_alignment,
            alignment_layer=alignment_layer, alignment_heads=alignment_heads, src_lengths=src_lengths,
            return_all_hiddens=return_all_hiddens)
    holder = incremental_state.get(STATE_KEY)
    if holder is None:
        holder = incremental_state[STATE_KEY] = _StateHolder(
            *start_decoding(decoder_module, prev_output_tokens.shape[0], encoder_out))
    decoder, state = holder.decoder, holder.state
    rows, length = prev_output_tokens.shape
    if state.cache.length != length - 1 or state.cache.rows != rows:
        raise RuntimeError(f"lightgen: fairseq decoder step got {rows} x {length} tokens but its incremental state "
                           f"holds {state.cache.rows} rows x {state.cache.length} positions")
    if state.cache.length == state.cache.max_len:
        state.cache.grow(min(2 * state.cache.max_len, decoder.spec.position_limit))
    # Like fairseq's incremental step, only the newest token is fed; earlier ones are in the cache.
    logits = decoder.step(state, prev_output_tokens[:, -1:])
    return logits[:, None, :], {"attn": [None], "inner_states": None}


def decoder_reorder(decoder_module, incremental_state, new_order):
    """fairseq ``reorder_incremental_state_scripting``: beam reordering and finished sentences leaving.

    Cross-attention K/V are selected only when rows leave: beams of one sentence share them,
    the same shortcut fairseq's MultiheadAttention takes."""
    holder = incremental_state.get(STATE_KEY) if incremental_state is not None else None
    if holder is None:
        return decoder_module._lightgen_reorder(incremental_state, new_order)
    state = holder.state
    if new_order.numel() == state.cache.rows:
        state.reorder(new_order)
    else:
        state.keep_rows(new_order)
    return incremental_state


def models_of(obj) -> list[nn.Module]:
    """The fairseq models behind ``obj``: a hub interface's ensemble, or the model itself."""
    if isinstance(obj, GeneratorHubInterface):
        return list(obj.models)
    _require(isinstance(getattr(obj, "decoder", None), nn.Module),
             f"{type(obj).__name__} has no decoder (expected a TransformerModel or its hub interface)")
    return [obj]


def check_supported(obj) -> list[nn.Module]:
    """The fairseq models behind ``obj``, each checked; raises ``UnsupportedModelError`` otherwise."""
    models = models_of(obj)
    for model in models:
        check_decoder(model.decoder)
    return models


def patch_fairseq(obj, patcher) -> None:
    """Check every model first (nothing is patched when one is unsupported), then patch them."""
    for model in check_supported(obj):
        decoder = model.decoder
        patcher.set(decoder, "_lightgen_forward", decoder.forward)
        patcher.set(decoder, "_lightgen_reorder", decoder.reorder_incremental_state_scripting)
        patcher.set(decoder, "forward", decoder_forward.__get__(decoder))
        patcher.set(decoder, "reorder_incremental_state_scripting", decoder_reorder.__get__(decoder))
        patcher.set(decoder, fairseq_greedy.START_DECODING_ATTR, functools.partial(start_decoding, decoder))
        patcher.patched.append(f"{type(model).__name__}.decoder: incremental steps on lightgen's static-cache decoder")
    if isinstance(obj, GeneratorHubInterface):
        task = obj.task
        patcher.set(task, "_lightgen_build_generator", task.build_generator)
        patcher.set(task, "build_generator", _hub_build_generator.__get__(task))
        patcher.patched.append(f"{type(task).__name__}.build_generator: lightgen_decoding='iad'|'gad' runs aggressive "
                               f"decoding")


def _hub_build_generator(task, models, args, **kwargs):
    """The hub task's ``build_generator``; ``hub.translate(..., lightgen_decoding="iad"|"gad")`` (with
    ``lightgen_block_size``, ``lightgen_drafter``, ``lightgen_beta``, ``lightgen_tau`` as the plugin's
    flags) returns an ``AggressiveGenerator`` over it."""
    generator = task._lightgen_build_generator(models, args, **kwargs)
    decoding = getattr(args, "lightgen_decoding", None) or "beam"
    if decoding == "beam":
        return generator
    if decoding not in ("iad", "gad"):
        raise ValueError(f"lightgen_decoding must be 'beam', 'iad' or 'gad' here, got {decoding!r}")
    if getattr(args, "beam", None) != 1:
        raise ValueError(f"lightgen_decoding={decoding!r} is greedy decoding: pass beam=1")
    settings = {name: getattr(args, name, default) for name, default in fairseq_greedy.AGGRESSIVE_SETTINGS.items()}
    return aggressive_generator(generator, task.source_dictionary, decoding, **settings)

