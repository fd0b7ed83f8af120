"""Shared plumbing for adapters: find blocks, keep training on the original forward."""

from __future__ import annotations

import inspect
from typing import Callable

from torch import nn

from lightgen import ops
from lightgen.adapters._patch import Patcher


def patch_matching(model: nn.Module, patcher: Patcher, class_suffix: str, fast: Callable, label: str) -> None:
    """Give every submodule whose class name ends with ``class_suffix`` the inference forward
    ``fast(module, ...)``."""
    for name, module in model.named_modules():
        if type(module).__name__.endswith(class_suffix):
            patcher.replace_forward(module, fast, label, name)


def patch_scaled_embeddings(model: nn.Module, patcher: Patcher) -> None:
    """HF's ``*ScaledWordEmbedding`` (lookup x embed_scale) -> one fused lookup."""

    def fast(module, input_ids):
        return ops.embedding(input_ids, module.weight, float(module.embed_scale))

    patch_matching(model, patcher, "ScaledWordEmbedding", fast, "embedding x scale")


def first_cache(cache, past_key_values):
    """Layers accept the cache as ``cache`` (5.24 name) or the deprecated ``past_key_values``."""
    return cache if cache is not None else past_key_values


def _layer_cache_name() -> str:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


# What HF's attention modules call their cache argument: ``cache`` from 5.24, ``past_key_values`` before
# (every family renamed at once). A cache passed under the other name lands in **kwargs, unused: the layer
# would attend to this step's keys alone.
LAYER_CACHE = _layer_cache_name()


def cache_argument(cache) -> dict:
    """``cache`` as a keyword argument of HF's attention modules of the installed release."""
    return {LAYER_CACHE: cache}
