"""Llama-family decoders (Llama, Mistral, Qwen2): pre-RMSNorm, rotary, grouped-query, SwiGLU."""

from __future__ import annotations

from lightgen.adapters._blocks import first_cache, patch_matching
from lightgen.adapters.base import Adapter, register_adapter
import sys

from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec

_LAYER_CLASS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


def _block_spec(config) -> BlockSpec:
    return BlockSpec(pre_norm=True, act=activation_for(config.hidden_act), ffn_in=("gate_proj", "up_proj"),
                     ffn_out="down_proj", act_module="act_fn")


def patch_llama(model, patcher) -> None:
    spec = _block_spec(model.config)

    def layer_fast(layer, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                   position_embeddings=None, past_key_values=None, **kwargs):
        cache = first_cache(cache, past_key_values)

        def self_attention(h):
            return layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                   **kwargs)[0]

        return run_block(spec, hidden_states, [
            (self_attention, layer.input_layernorm),
            (lambda h: feed_forward(layer.mlp, spec, h), layer.post_attention_layernorm),
        ])

    patch_matching(model, patcher, _LAYER_CLASS[model.config.model_type], layer_fast,
                   f"fused residual+RMSNorm, gated {spec.act or 'HF activation'}")


def _uses_sliding_window(config) -> bool:
    if getattr(config, "sliding_window", None) is None:
        return False
    return config.model_type == "mistral" or bool(getattr(config, "use_sliding_window", False))


def llama_decoder(model) -> Decoder | None:
    """The static-cache decoder step for *ForCausalLM (None without an LM head or with sliding windows)."""
    if not hasattr(model, "lm_head") or _uses_sliding_window(model.config):
        return None
    body = model.model
    attention_module = sys.modules[type(body.layers[0].self_attn).__module__]
    config = model.config
    layers = tuple(
        DecoderLayerWeights(
            self_attn=AttentionWeights(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                       layer.self_attn.o_proj, config.num_attention_heads, config.num_key_value_heads,
                                       layer.self_attn.head_dim, layer.self_attn.scaling),
            self_norm=layer.input_layernorm, ffn_owner=layer.mlp, ffn_norm=layer.post_attention_layernorm)
        for layer in body.layers
    )
    return Decoder(DecoderSpec(block=_block_spec(config), layers=layers, token_embedding=body.embed_tokens.weight,
                               lm_head=model.lm_head, rotary=body.rotary_emb, apply_rotary=attention_module.apply_rotary_pos_emb,
                               final_norm=body.norm))


register_adapter(Adapter("llama", patch_llama, decoder=llama_decoder), *_LAYER_CLASS)
