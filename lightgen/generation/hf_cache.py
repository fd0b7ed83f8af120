"""Hugging Face ``Cache`` objects in and out of lightgen's static KV cache.

Out: with ``return_dict_in_generate=True`` HF returns its cache; lightgen's loop never builds one, so
the cache HF would have used (``DynamicCache``, ``EncoderDecoderCache``, ``StaticCache``, as HF's own
``_prepare_cache_for_generation`` makes it for that call) is filled from the static cache once, at the
end, through the cache's own ``update``. Calls that do not return a cache never build one.

In: a cache the caller passes (from HF's or lightgen's ``generate``, or a forward pass) is copied into
the static cache as the first positions, the loop feeds only the tokens after them (as HF's prefill
does), and the new positions are appended to the caller's object, which HF also extends in place.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache, StaticLayer
from transformers.generation.utils import ALL_CACHE_NAMES

# Layers holding plain K/V of every position (no quantization, no recurrent state), and sliding-window ones,
# which keep the last ``sliding_window - 1`` positions: all that a later query of that layer attends to.
_PLAIN_LAYERS = (DynamicLayer, StaticLayer, DynamicSlidingWindowLayer)


def cache_key(model_kwargs: dict) -> str | None:
    """The name the cache goes by in ``model_kwargs`` ('cache' from transformers 5.24, 'past_key_values'
    before), when one is there."""
    return next((name for name in ALL_CACHE_NAMES if model_kwargs.get(name) is not None), None)


def _self_attention(cache):
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def unsupported(cache, rows: int) -> str | None:
    """Why lightgen cannot continue from ``cache`` (a user's), or None."""
    layers = getattr(_self_attention(cache), "layers", None)
    if layers is None:
        return f"a {type(cache).__name__} cache"
    odd = next((layer for layer in layers if type(layer) not in _PLAIN_LAYERS), None)
    if odd is not None:
        return f"a cache with {type(odd).__name__} layers"
    if past_length(cache) and layers[0].keys.shape[0] != rows:
        return f"a cache of {layers[0].keys.shape[0]} rows for {rows} decoder rows"
    return None


def past_length(cache) -> int:
    return int(_self_attention(cache).get_seq_length())


def cached_prompt(past: int, input_ids, mask, generation_config) -> int:
    """How many input tokens HF's prefill takes as cached: ``past``, when the mask (or the one HF dropped for
    being all ones) is as long as the input; otherwise HF feeds the whole input after the cache."""
    mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
    return past if mask_length == input_ids.shape[1] else 0


def load(state, cache) -> int:
    """Copy ``cache``'s positions into ``state`` as its first ones; returns how many."""
    past = past_length(cache)
    if past == 0:
        return 0
    for index, layer in enumerate(_self_attention(cache).layers):
        keys, values = state.cache.layer(index)
        kept = min(past, layer.keys.shape[2]) if isinstance(layer, DynamicSlidingWindowLayer) else past
        # A windowed layer's older positions are outside every later query's window: zeros, never read.
        keys[:, :, :past - kept].zero_()
        values[:, :, :past - kept].zero_()
        keys[:, :, past - kept:past] = layer.keys[:, :, layer.keys.shape[2] - kept:][:, :, :kept]
        values[:, :, past - kept:past] = layer.values[:, :, layer.values.shape[2] - kept:][:, :, :kept]
    state.cache.length = past
    state.lengths.fill_(past)
    state.next_position.fill_(past)
    return past


def store(state, cache, start: int) -> None:
    """Append positions ``start`` .. ``state``'s length to ``cache`` (HF's ``update``: the cache keeps its own
    copies); an empty cross-attention part gets each sentence's encoder K/V once per decoder row."""
    self_cache, end = _self_attention(cache), state.cache.length
    for index in range(len(state.cache.keys)):
        keys, values = state.cache.layer(index)
        self_cache.update(keys[:, :, start:end], values[:, :, start:end], index)
    if isinstance(cache, EncoderDecoderCache) and cache.cross_attention_cache.get_seq_length() == 0:
        for index, (keys, values) in enumerate(zip(state.cross_keys, state.cross_values, strict=True)):
            cache.cross_attention_cache.update(keys.repeat_interleave(state.expand, 0),
                                               values.repeat_interleave(state.expand, 0), index)
            cache.is_updated[index] = True


def with_cache(output, cache):
    """``output`` carrying ``cache`` in the field HF's version names ('cache' or 'past_key_values')."""
    if cache is not None:  # HF's outputs hold no key for a None field
        output["cache" if "cache" in type(output).__dataclass_fields__ else "past_key_values"] = cache
    return output
