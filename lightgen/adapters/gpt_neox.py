"""GPT-NeoX (Pythia): pre-LN blocks with a parallel residual (``use_parallel_residual``), a fused
query_key_value projection laid out per head, and partial rotary (NeoX's own ``apply_rotary_pos_emb``
rotates the first ``rotary_pct`` of each head)."""

from __future__ import annotations

import sys

from lightgen.adapters._blocks import patch_matching
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import BlockSpec, activation_for, feed_forward, run_block
from lightgen.modules.decoder import AttentionWeights, Decoder, DecoderLayerWeights, DecoderSpec


def _block_spec(config) -> BlockSpec:
    return BlockSpec(pre_norm=True, act=activation_for(config.hidden_act), ffn_in=("dense_h_to_4h",),
                     ffn_out="dense_4h_to_h", act_module="act", parallel_residual=config.use_parallel_residual)


def patch_gpt_neox(model, patcher) -> None:
    spec = _block_spec(model.config)

    def layer_fast(layer, hidden_states, attention_mask=None, position_ids=None, use_cache=False, layer_past=None,
                   position_embeddings=None, **kwargs):
        return run_block(spec, hidden_states, [
            (lambda h: layer.attention(h, attention_mask=attention_mask, position_ids=position_ids,
                                       layer_past=layer_past, use_cache=use_cache,
                                       position_embeddings=position_embeddings, **kwargs)[0], layer.input_layernorm),
            (lambda h: feed_forward(layer.mlp, spec, h), layer.post_attention_layernorm),
        ])

    residual = "parallel residual" if spec.parallel_residual else "fused residual"
    patch_matching(model, patcher, "GPTNeoXLayer", layer_fast,
                   f"{residual}+LayerNorm (pre-LN), bias+{spec.act or 'HF activation'}")


def gpt_neox_decoder(model) -> Decoder | None:
    """The static-cache decoder step for GPTNeoXForCausalLM (None without an LM head)."""
    if not hasattr(model, "lm_head"):
        return None
    body, config = model.gpt_neox, model.config
    layers = tuple(
        DecoderLayerWeights(
            self_attn=AttentionWeights(layer.attention.query_key_value, None, None, layer.attention.dense,
                                       config.num_attention_heads, config.num_attention_heads,
                                       layer.attention.head_size, layer.attention.scaling, interleaved_qkv=True),
            self_norm=layer.input_layernorm, ffn_owner=layer.mlp, ffn_norm=layer.post_attention_layernorm)
        for layer in body.layers
    )
    family = sys.modules[type(body.layers[0].attention).__module__]
    return Decoder(DecoderSpec(block=_block_spec(config), layers=layers, token_embedding=body.embed_in.weight,
                               lm_head=model.lm_head,
                               rotary=body.rotary_emb, apply_rotary=family.apply_rotary_pos_emb,
                               final_norm=body.final_layer_norm))


register_adapter(Adapter("gpt_neox", patch_gpt_neox, decoder=gpt_neox_decoder), "gpt_neox")
