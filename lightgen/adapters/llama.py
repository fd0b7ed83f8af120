"""Llama-family decoders (Llama, Mistral, Qwen2): pre-RMSNorm, rotary, grouped-query, SwiGLU."""

from __future__ import annotations

from lightgen.adapters._blocks import first_cache, patch_matching
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block

_LAYER_CLASS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


def patch_llama(model, patcher) -> None:
    spec = BlockSpec(pre_norm=True, act=activation_for(model.config.hidden_act), ffn_in=("gate_proj", "up_proj"),
                     ffn_out="down_proj", act_module="act_fn")

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


register_adapter(Adapter("llama", patch_llama), *_LAYER_CLASS)
