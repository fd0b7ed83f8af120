"""OPT: BART-style decoder blocks (pre-LN, or post-LN for OPT-350m), learned positions offset by 2, queries
scaled before the dot products, and OPT-350m's projections between embedding and model widths."""

from __future__ import annotations

from lightgen.adapters._blocks import cache_argument, first_cache, patch_matching
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec


def _block_spec(config) -> BlockSpec:
    return BlockSpec(pre_norm=config.do_layer_norm_before, act=activation_for(config.activation_function),
                     ffn_in=("fc1",), ffn_out="fc2", act_module="activation_fn")


def patch_opt(model, patcher) -> None:
    spec = _block_spec(model.config)

    def layer_fast(layer, hidden_states, attention_mask=None, cache=None, use_cache=False, position_ids=None,
                   past_key_values=None, **kwargs):
        cached = cache_argument(first_cache(cache, past_key_values))
        return run_block(spec, hidden_states, [
            (lambda h: layer.self_attn(hidden_states=h, **cached, position_ids=position_ids,
                                       attention_mask=attention_mask, **kwargs)[0], layer.self_attn_layer_norm),
            (lambda h: feed_forward(layer, spec, h), layer.final_layer_norm),
        ])

    norm_label = "pre-LN" if spec.pre_norm else "post-LN"
    patch_matching(model, patcher, "OPTDecoderLayer", layer_fast,
                   f"fused residual+LayerNorm ({norm_label}), bias+{spec.act or 'HF activation'}")


def opt_decoder(model) -> Decoder | None:
    """The static-cache decoder step for OPTForCausalLM (None without an LM head)."""
    if not hasattr(model, "lm_head"):
        return None
    decoder, config = model.model.decoder, model.config
    layers = tuple(
        DecoderLayerWeights(
            self_attn=AttentionWeights(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                       layer.self_attn.out_proj, layer.self_attn.num_heads, layer.self_attn.num_heads,
                                       layer.self_attn.head_dim, layer.self_attn.scaling, scale_queries=True),
            self_norm=layer.self_attn_layer_norm, ffn_owner=layer, ffn_norm=layer.final_layer_norm)
        for layer in decoder.layers
    )
    return Decoder(DecoderSpec(
        block=_block_spec(config), layers=layers, token_embedding=decoder.embed_tokens.weight, lm_head=model.lm_head,
        position_table=decoder.embed_positions.weight, position_offset=decoder.embed_positions.offset,
        final_norm=decoder.final_layer_norm, project_in=decoder.project_in, project_out=decoder.project_out))


register_adapter(Adapter("opt", patch_opt, decoder=opt_decoder), "opt")
