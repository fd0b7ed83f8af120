"""T5, T5 v1.1 / Flan-T5 and mT5: pre-RMSNorm blocks, relative position bias, ReLU or gated-GELU FFN."""

from __future__ import annotations

from lightgen.adapters._blocks import cache_argument, first_cache, patch_matching
from lightgen.adapters.base import Adapter, UnsupportedModelError, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import (
    AttentionWeights,
    Decoder,
    DecoderLayerWeights,
    DecoderSpec,
)
from lightgen.modules.position_bias import RelativePositionBias


def _spec(config) -> BlockSpec:
    return BlockSpec(pre_norm=True, act=activation_for(config.dense_act_fn),
                     ffn_in=("wi_0", "wi_1") if config.is_gated_act else ("wi",), ffn_out="wo", act_module="act",
                     clamp_fp16=True)


def _check_one_dtype(model) -> None:
    # from_pretrained keeps T5's `wo` in float32 (_keep_in_fp32_modules) when the rest is loaded in 16 bits;
    # the fused blocks run one dtype.
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        raise UnsupportedModelError(
            f"lightgen cannot accelerate a {model.config.model_type} model with mixed parameter dtypes "
            f"({', '.join(sorted(map(str, dtypes)))}; from_pretrained keeps the 'wo' layers in float32): convert it "
            f"to one dtype first, e.g. model.to(torch.bfloat16)")


def patch_t5(model, patcher) -> None:
    _check_one_dtype(model)
    spec = _spec(model.config)

    def block_fast(block, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                   encoder_attention_mask=None, encoder_decoder_position_bias=None, cache=None, past_key_values=None,
                   **kwargs):
        cached = cache_argument(first_cache(cache, past_key_values))
        # The first block computes the position biases; the stack hands them to the others.
        biases = [position_bias, encoder_decoder_position_bias]

        def attend(which, attention, **call):
            def run(h):
                out, biases[which], _ = attention(h, position_bias=biases[which], **cached, **call, **kwargs)
                return out
            return run

        self_layer, ff_layer = block.layer[0], block.layer[-1]
        sublayers = [(attend(0, self_layer.SelfAttention, mask=attention_mask), self_layer.layer_norm)]
        cross = block.is_decoder and encoder_hidden_states is not None
        if cross:
            cross_layer = block.layer[1]
            sublayers.append((attend(1, cross_layer.EncDecAttention, mask=encoder_attention_mask,
                                     key_value_states=encoder_hidden_states), cross_layer.layer_norm))
        sublayers.append((lambda h: feed_forward(ff_layer.DenseReluDense, spec, h), ff_layer.layer_norm))
        hidden = run_block(spec, hidden_states, sublayers)
        return hidden, biases[0], biases[1] if cross else None

    patch_matching(model, patcher, "T5Block", block_fast,
                   f"fused residual+RMSNorm, {'gated ' if spec.gated else ''}{spec.act or 'HF activation'}")


def _attention(attn) -> AttentionWeights:
    return AttentionWeights(attn.q, attn.k, attn.v, attn.o, attn.n_heads, attn.n_heads, attn.key_value_proj_dim,
                            attn.scaling)


def t5_decoder(model) -> Decoder | None:
    """The static-cache decoder step for *ForConditionalGeneration (None without an LM head)."""
    if not hasattr(model, "lm_head") or not hasattr(model, "get_decoder"):
        return None
    config, decoder = model.config, model.get_decoder()
    layers = tuple(
        DecoderLayerWeights(self_attn=_attention(block.layer[0].SelfAttention), self_norm=block.layer[0].layer_norm,
                            ffn_owner=block.layer[-1].DenseReluDense, ffn_norm=block.layer[-1].layer_norm,
                            cross_attn=_attention(block.layer[1].EncDecAttention),
                            cross_norm=block.layer[1].layer_norm)
        for block in decoder.block
    )
    biased = decoder.block[0].layer[0].SelfAttention
    relative = RelativePositionBias(biased.relative_attention_bias, biased.relative_attention_num_buckets,
                                    biased.relative_attention_max_distance, bidirectional=False,
                                    bucket=type(biased)._relative_position_bucket)
    # T5 (not v1.1, Flan-T5 or mT5) scales the decoder output for its tied LM head.
    scale = config.d_model ** -0.5 if getattr(config, "scale_decoder_outputs", False) else 1.0
    return Decoder(DecoderSpec(block=_spec(config), layers=layers, token_embedding=decoder.embed_tokens.weight,
                               lm_head=model.lm_head, final_norm=decoder.final_layer_norm,
                               relative_position_bias=relative, lm_head_input_scale=scale))


register_adapter(Adapter("t5", patch_t5, decoder=t5_decoder), "t5", "mt5")
