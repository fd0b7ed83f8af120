"""Phi-3: the Llama mapping with fused projections (``qkv_proj`` = [q | k | v], ``gate_up_proj`` = [gate | up])
and partial rotary (Phi-3's own ``apply_rotary_pos_emb`` rotates the first dimensions of each head)."""

from __future__ import annotations

from lightgen.adapters.base import Adapter, register_adapter
from lightgen.adapters.llama import block_spec, patch_rotary_layers, rotary_decoder


def _block_spec(config):
    return block_spec(config, ffn_in=("gate_up_proj",), fused_gate_up=True, act_module="activation_fn")


def patch_phi3(model, patcher) -> None:
    patch_rotary_layers(model, patcher, "Phi3DecoderLayer", _block_spec(model.config))


def phi3_decoder(model):
    return rotary_decoder(model, _block_spec(model.config))


register_adapter(Adapter("phi3", patch_phi3, decoder=phi3_decoder), "phi3")
