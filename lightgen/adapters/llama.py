"""Llama-family decoders (Llama, Mistral, Qwen2): pre-RMSNorm, rotary, grouped-query, gated FFN.

The mapping here serves every decoder of this shape: Qwen3, Phi-3 and Gemma reuse it with their
differences stated as spec fields (q/k norms, fused projections, sandwich norms, soft-capping).
"""

from __future__ import annotations

import sys

from lightgen.adapters._blocks import cache_argument, first_cache, patch_matching
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec
from lightgen.modules.norm import apply_norm

_LAYER_CLASS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


def block_spec(config, **fields) -> BlockSpec:
    act = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma 2/3 name it hidden_activation
    return BlockSpec(**{"pre_norm": True, "act": activation_for(act), "ffn_in": ("gate_proj", "up_proj"),
                        "ffn_out": "down_proj", "act_module": "act_fn", **fields})


def patch_rotary_layers(model, patcher, layer_class: str, spec: BlockSpec, sandwich: bool = False) -> None:
    """HF's ``*DecoderLayer`` of a Llama-shaped model runs ``run_block``. ``sandwich``: Gemma 2/3's layers, whose
    post-attention norm applies to the attention output and whose FFN has pre- and post-norms of its own."""

    def layer_fast(layer, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                   position_embeddings=None, past_key_values=None, **kwargs):
        cached = cache_argument(first_cache(cache, past_key_values))

        def self_attention(h):
            out = layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                  **cached, use_cache=use_cache, position_embeddings=position_embeddings,
                                  **kwargs)[0]
            return apply_norm(layer.post_attention_layernorm, out) if sandwich else out

        if sandwich:
            ffn = (lambda h: apply_norm(layer.post_feedforward_layernorm, feed_forward(layer.mlp, spec, h)),
                   layer.pre_feedforward_layernorm)
        else:
            ffn = (lambda h: feed_forward(layer.mlp, spec, h), layer.post_attention_layernorm)
        return run_block(spec, hidden_states, [(self_attention, layer.input_layernorm), ffn])

    patch_matching(model, patcher, layer_class, layer_fast,
                   f"fused residual+RMSNorm, gated {spec.act or 'HF activation'}")


def patch_llama(model, patcher) -> None:
    patch_rotary_layers(model, patcher, _LAYER_CLASS[model.config.model_type], block_spec(model.config))


def sliding_window(attn, config) -> int:
    """HF's window for one attention layer (0: none): the module's own ``sliding_window`` where it has one
    (Qwen2/3, Gemma 2/3: None on full-attention layers), else the config's (Mistral and Phi-3 window every
    layer). HF's masks let a query see ``sliding_window`` cache positions, its own included."""
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    return int(window or 0)


def rotary_attention(config, attn, **fields) -> AttentionWeights:
    """A Llama-shaped attention module (separate q/k/v projections, or the fused ``qkv_proj`` of Phi-3)."""
    fused = hasattr(attn, "qkv_proj")
    projections = (attn.qkv_proj, None, None) if fused else (attn.q_proj, attn.k_proj, attn.v_proj)
    return AttentionWeights(*projections, attn.o_proj, config.num_attention_heads, config.num_key_value_heads,
                            attn.head_dim, attn.scaling, window=sliding_window(attn, config),
                            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None), **fields)


def rotary_decoder(model, spec: BlockSpec, *, sandwich: bool = False, attention_fields=None, layer_rotary=None,
                   **spec_fields) -> Decoder | None:
    """The static-cache decoder step for a Llama-shaped *ForCausalLM (None without an LM head).
    ``layer_rotary(index)``: that layer's rotary function where layers differ (Gemma 3)."""
    if not hasattr(model, "lm_head"):
        return None
    body, config = model.model, model.config
    family = sys.modules[type(body.layers[0].self_attn).__module__]
    layers = tuple(
        DecoderLayerWeights(
            self_attn=rotary_attention(config, layer.self_attn, **(attention_fields or {})),
            self_norm=layer.input_layernorm, ffn_owner=layer.mlp,
            ffn_norm=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
            self_out_norm=layer.post_attention_layernorm if sandwich else None,
            ffn_out_norm=layer.post_feedforward_layernorm if sandwich else None,
            rotary=layer_rotary(index) if layer_rotary else None)
        for index, layer in enumerate(body.layers)
    )
    return Decoder(DecoderSpec(block=spec, layers=layers, token_embedding=body.embed_tokens.weight,
                               lm_head=model.lm_head,
                               rotary=body.rotary_emb, apply_rotary=family.apply_rotary_pos_emb,
                               final_norm=body.norm, **spec_fields))


def llama_decoder(model) -> Decoder | None:
    return rotary_decoder(model, block_spec(model.config))


register_adapter(Adapter("llama", patch_llama, decoder=llama_decoder), *_LAYER_CLASS)
