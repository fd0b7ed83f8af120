"""GPT-2: pre-LN decoder blocks with Conv1D projections (optional cross-attention)."""

from __future__ import annotations

from lightgen.adapters._blocks import cache_argument, first_cache, patch_matching
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec, NoEngine


def _block_spec(config) -> BlockSpec:
    return BlockSpec(pre_norm=True, act=activation_for(config.activation_function), ffn_in=("c_fc",),
                     ffn_out="c_proj", act_module="act")


def patch_gpt2(model, patcher) -> None:
    spec = _block_spec(model.config)

    def block_fast(block, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                   encoder_attention_mask=None, use_cache=False, past_key_values=None, **kwargs):
        cached = cache_argument(first_cache(cache, past_key_values))
        sublayers = [(lambda h: block.attn(h, **cached, attention_mask=attention_mask, use_cache=use_cache,
                                           **kwargs)[0], block.ln_1)]
        if encoder_hidden_states is not None:
            sublayers.append((lambda h: block.crossattention(h, **cached, attention_mask=attention_mask,
                                                             encoder_hidden_states=encoder_hidden_states,
                                                             encoder_attention_mask=encoder_attention_mask)[0],
                              block.ln_cross_attn))
        sublayers.append((lambda h: feed_forward(block.mlp, spec, h), block.ln_2))
        return run_block(spec, hidden_states, sublayers)

    patch_matching(model, patcher, "GPT2Block", block_fast,
                   f"fused residual+LayerNorm (pre-LN), bias+{spec.act or 'HF activation'}")


def gpt2_decoder(model) -> Decoder | None:
    """The static-cache decoder step for GPT2LMHeadModel (None for heads without an LM)."""
    if not hasattr(model, "lm_head"):
        return None
    if model.config.add_cross_attention:
        raise NoEngine("lightgen's engine runs GPT-2 without cross-attention, and this config sets "
                       "add_cross_attention")
    transformer = model.transformer
    layers = tuple(
        DecoderLayerWeights(
            self_attn=AttentionWeights(block.attn.c_attn, None, None, block.attn.c_proj, block.attn.num_heads,
                                       block.attn.num_heads, block.attn.head_dim, block.attn.scaling,
                                       upcast=block.attn.reorder_and_upcast_attn),
            self_norm=block.ln_1, ffn_owner=block.mlp, ffn_norm=block.ln_2)
        for block in transformer.h
    )
    return Decoder(DecoderSpec(block=_block_spec(model.config), layers=layers, token_embedding=transformer.wte.weight,
                               lm_head=model.lm_head, position_table=transformer.wpe.weight,
                               final_norm=transformer.ln_f, token_type_embedding=transformer.wte.weight))


register_adapter(Adapter("gpt2", patch_gpt2, decoder=gpt2_decoder), "gpt2")
