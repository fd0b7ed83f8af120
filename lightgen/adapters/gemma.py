"""Gemma, Gemma 2 and Gemma 3 (text): the Llama mapping with embeddings scaled by sqrt(hidden), ``(1 + w)``
RMSNorms, GeGLU, and from Gemma 2 on sandwich norms, alternating sliding/global layers, the query
pre-attention scalar (HF's ``scaling``), soft-capped attention scores (Gemma 2) and logits; Gemma 3 adds
q/k norms and a rotary table per layer type."""

from __future__ import annotations

import functools

from lightgen.adapters.base import Adapter, register_adapter
from lightgen.adapters.llama import block_spec, patch_rotary_layers, rotary_decoder
from lightgen.modules.decoder import NoEngine
from lightgen.modules.norm import UNIT_OFFSET_RMS_NORMS

_PREFIX = {"gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}
UNIT_OFFSET_RMS_NORMS.update(f"{prefix}RMSNorm" for prefix in _PREFIX.values())


def patch_gemma(model, patcher) -> None:
    config = model.config
    patch_rotary_layers(model, patcher, f"{_PREFIX[config.model_type]}DecoderLayer", block_spec(config),
                        sandwich=config.model_type != "gemma")


def gemma_decoder(model):
    config, body = model.config, getattr(model, "model", None)
    if getattr(config, "use_bidirectional_attention", False):
        raise NoEngine("lightgen's engine decodes causally, and this Gemma config sets use_bidirectional_attention")
    layer_rotary = None
    if config.model_type == "gemma3_text":  # one rotary table per layer type (local layers: another theta)
        tables = {kind: functools.partial(body.rotary_emb, layer_type=kind) for kind in set(config.layer_types)}
        layer_rotary = [tables[kind] for kind in config.layer_types].__getitem__
    embed = body.embed_tokens if body is not None else None
    return rotary_decoder(
        model, block_spec(config), sandwich=config.model_type != "gemma", layer_rotary=layer_rotary,
        # Gemma 3 keeps the attribute but, as HF's attention does, never applies it.
        attention_fields=dict(softcap=float(config.attn_logit_softcapping or 0.0)) if config.model_type == "gemma2"
        else None,
        # HF multiplies by the scale cast to the weights' dtype (sqrt(3072) is 55.5 in bf16).
        embed_scale=float(embed.embed_scale.to(embed.weight.dtype)) if embed is not None else 1.0,
        logits_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0))


register_adapter(Adapter("gemma", patch_gemma, decoder=gemma_decoder), *_PREFIX)
