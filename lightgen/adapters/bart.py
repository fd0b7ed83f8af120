"""BART, mBART (pre-LN) and Marian (post-LN, sinusoidal positions): encoder and decoder blocks.

Pegasus and M2M100/NLLB keep BART's layer layout; their files register this mapping with their own
class prefix and positions.
"""

from __future__ import annotations

from lightgen.adapters._blocks import cache_argument, first_cache, patch_matching, patch_scaled_embeddings
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec

# model_type -> (layer class prefix, pre-LN); other families' files add theirs (``register_bart_style``).
_LAYOUT = {"bart": ("Bart", False), "mbart": ("MBart", True), "marian": ("Marian", False)}


def _spec(config, *, encoder: bool) -> BlockSpec:
    return BlockSpec(
        pre_norm=_LAYOUT[config.model_type][1],
        act=activation_for(config.activation_function),
        ffn_in=("fc1",),
        ffn_out="fc2",
        act_module="activation_fn",
        clamp_fp16=encoder,
    )


def patch_bart(model, patcher) -> None:
    config = model.config
    prefix = _LAYOUT[config.model_type][0]
    enc_spec, dec_spec = _spec(config, encoder=True), _spec(config, encoder=False)

    def encoder_fast(layer, hidden_states, attention_mask=None, **kwargs):
        return run_block(enc_spec, hidden_states, [
            (lambda h: layer.self_attn(h, attention_mask=attention_mask, **kwargs)[0], layer.self_attn_layer_norm),
            (lambda h: feed_forward(layer, enc_spec, h), layer.final_layer_norm),
        ])

    def decoder_fast(layer, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                     cache=None, use_cache=True, past_key_values=None, **kwargs):
        cached = cache_argument(first_cache(cache, past_key_values))
        sublayers = [(lambda h: layer.self_attn(h, **cached, attention_mask=attention_mask, **kwargs)[0],
                      layer.self_attn_layer_norm)]
        if encoder_hidden_states is not None:
            sublayers.append((lambda h: layer.encoder_attn(h, key_value_states=encoder_hidden_states,
                                                           attention_mask=encoder_attention_mask, **cached,
                                                           **kwargs)[0],
                              layer.encoder_attn_layer_norm))
        sublayers.append((lambda h: feed_forward(layer, dec_spec, h), layer.final_layer_norm))
        return run_block(dec_spec, hidden_states, sublayers)

    norm_label = "pre-LN" if enc_spec.pre_norm else "post-LN"
    fused = f"fused residual+LayerNorm ({norm_label}), bias+{enc_spec.act or 'HF activation'}"
    patch_matching(model, patcher, f"{prefix}EncoderLayer", encoder_fast, fused)
    patch_matching(model, patcher, f"{prefix}DecoderLayer", decoder_fast, fused)
    patch_scaled_embeddings(model, patcher)


def _attention(attn) -> AttentionWeights:
    return AttentionWeights(attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, attn.num_heads, attn.num_heads,
                            attn.head_dim, attn.scaling)


def _learned_or_fixed_positions(embed_positions) -> dict:
    """BART's learned table (from index ``offset``) or Marian's and Pegasus' sinusoidal nn.Embedding."""
    return dict(position_table=embed_positions.weight, position_offset=getattr(embed_positions, "offset", 0))


def bart_decoder(model, positions=_learned_or_fixed_positions) -> Decoder | None:
    """The static-cache decoder step for a *ForConditionalGeneration or *ForCausalLM model (None
    without an LM head);
    ``positions(decoder.embed_positions)`` gives the DecoderSpec's position fields."""
    if not hasattr(model, "lm_head") or not hasattr(model, "get_decoder"):
        return None
    decoder = model.get_decoder()
    embed_tokens = decoder.embed_tokens
    scale = embed_tokens.embed_scale if hasattr(embed_tokens, "embed_scale") else decoder.embed_scale
    # BartForCausalLM's layers carry cross-attention too, which HF skips without encoder states.
    crossed = model.config.is_encoder_decoder
    layers = tuple(
        DecoderLayerWeights(self_attn=_attention(layer.self_attn), self_norm=layer.self_attn_layer_norm,
                            ffn_owner=layer, ffn_norm=layer.final_layer_norm,
                            cross_attn=_attention(layer.encoder_attn) if crossed else None,
                            cross_norm=layer.encoder_attn_layer_norm if crossed else None)
        for layer in decoder.layers
    )
    return Decoder(DecoderSpec(
        block=_spec(model.config, encoder=False), layers=layers, token_embedding=embed_tokens.weight,
        lm_head=model.lm_head, embed_scale=float(scale or 1.0), **positions(decoder.embed_positions),
        embedding_norm=getattr(decoder, "layernorm_embedding", None), final_norm=getattr(decoder, "layer_norm", None),
        logits_bias=getattr(model, "final_logits_bias", None),
    ))


def register_bart_style(model_type: str, prefix: str, *, pre_norm: bool, decoder=bart_decoder) -> None:
    """A family with BART's layers (self_attn, encoder_attn, fc1/fc2, *_layer_norm) under class ``prefix``."""
    _LAYOUT[model_type] = (prefix, pre_norm)
    register_adapter(Adapter(model_type, patch_bart, decoder=decoder), model_type)


register_adapter(Adapter("bart", patch_bart, decoder=bart_decoder), "bart", "mbart", "marian")
