"""Qwen3: the Llama mapping plus per-head RMSNorms on q and k (``q_norm``/``k_norm``, read by the mapping)."""

from __future__ import annotations

from lightgen.adapters.base import Adapter, register_adapter
from lightgen.adapters.llama import block_spec, patch_rotary_layers, rotary_decoder


def patch_qwen3(model, patcher) -> None:
    patch_rotary_layers(model, patcher, "Qwen3DecoderLayer", block_spec(model.config))


def qwen3_decoder(model):
    return rotary_decoder(model, block_spec(model.config))


register_adapter(Adapter("qwen3", patch_qwen3, decoder=qwen3_decoder), "qwen3")
