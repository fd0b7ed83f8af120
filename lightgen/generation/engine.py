"""lightgen's decoding loops behind Hugging Face's own ``generate()``.

``generate`` keeps HF's front half: argument merging with the model's ``generation_config``,
special tokens, the encoder pass (on patched layers), input expansion for beams, the logits
processors and stopping criteria. It hands us the prepared state through its official
``custom_generate`` hook, and we run the loop on lightgen's static-cache decoder step. Because the
processors, stopping criteria and beam bookkeeping are HF's own objects and helpers, the
decisions are HF's; what changes is the model step and the memory it uses.

Anything the loops do not cover falls back to HF's original method with one warning naming
the reason (``LIGHTGEN_STRICT=1`` raises instead), so a result is never silently different.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import threading
import warnings

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    TopKLogitsWarper,
)
from transformers.generation.utils import (
    ALL_CACHE_NAMES,
    GENERATION_MODES_MAPPING,
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
    GenerationMixin,
)

from lightgen import _build, ops
from lightgen.generation import hf_cache
from lightgen.generation.aggressive import (
    Acceptance,
    AggressiveDecoderOnlyOutput,
    AggressiveEncoderDecoderOutput,
    CopyFromInput,
    DraftBudget,
    aggressive_greedy,
)
from lightgen.generation.diverse import group_beam_search
from lightgen.generation.drafting import start_session
from lightgen.memory import cached_cpu_memory
from lightgen.modules import attention as lg_attention
from lightgen.modules import step_graph
from lightgen.modules.decoder import ACCELERATE_ATTR, DECODER_ATTR, KeySpan, Observed
from lightgen.modules.inference import skips_hooks

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                   GenerationMode.BEAM_SAMPLE, GenerationMode.GROUP_BEAM_SEARCH)

# generate() arguments that need HF's own loop (they replace model internals, or leave one process).
HF_ONLY_ARGUMENTS = (
    "assistant_model", "assistant_tokenizer", "prompt_lookup_num_tokens", "synced_gpus",
    "custom_generate", "decoder_inputs_embeds", "head_mask", "decoder_head_mask", "cross_attn_head_mask",
)
# Cache kinds whose values differ from the exact ones lightgen's loop computes (or that leave generate()).
HF_ONLY_CACHE_IMPLEMENTATIONS = ("quantized", "paged")

# Keys HF leaves in model_kwargs that the lightgen loop understands (the rest mean a fallback).
# ``inputs_embeds``: a decoder-only prompt's (the prefill reads it), or an encoder's (HF's encoder pass read it).
_KNOWN_MODEL_KWARGS = {"attention_mask", "encoder_outputs", "use_cache", "logits_to_keep", "position_ids",
                       "decoder_attention_mask", "inputs_embeds", "output_attentions", "output_hidden_states",
                       *ALL_CACHE_NAMES}


class UnsupportedGenerateArgument(ValueError):
    """LIGHTGEN_STRICT=1 and a generate() argument lightgen's engine does not implement."""


def _fall_back(reason: str, instead: str = "Hugging Face's own generate loop") -> None:
    if _build.strict():
        raise UnsupportedGenerateArgument(f"lightgen generate: {reason} (LIGHTGEN_STRICT=1 forbids the fallback to "
                                          f"{instead})")
    warnings.warn(f"lightgen generate: {reason}; running {instead} instead", RuntimeWarning, stacklevel=4)


def _check_lightgen_arguments(decoding, max_draft, block_size, drafter, beta, tau) -> None:
    if decoding not in ("auto", "iad", "gad"):
        raise ValueError(f"lightgen generate: decoding must be 'auto', 'iad' or 'gad', got {decoding!r}")
    if (max_draft is not None and max_draft < 1) or block_size < 1:
        raise ValueError(f"lightgen generate: max_draft and block_size must be >= 1, got {max_draft}, {block_size}")
    if (decoding == "gad") != (drafter is not None):
        raise ValueError("lightgen generate: decoding='gad' needs a drafter, and a drafter needs decoding='gad'")
    if decoding != "gad" and (beta != 1 or tau != 0.0):
        raise ValueError("lightgen generate: beta and tau (GAD++) apply to decoding='gad' only")


def accelerated_generate(model: nn.Module, inputs=None, generation_config=None, *, decoding: str = "auto",
                         max_draft: int | None = None, draft_ids=None, drafter=None, block_size: int = 8, beta: int = 1,
                         tau: float = 0.0, **kwargs):
    """``model.generate`` after ``accelerate_model``: HF's arguments and outputs, lightgen's loop.

    ``decoding="iad"`` runs greedy decoding with input-guided aggressive decoding (drafts copied
    from the input, verified in one pass, at most ``max_draft`` tokens each; by default 32 for one row,
    fewer as the batch grows, see ``aggressive.DraftBudget``): the same tokens as
    greedy, in fewer decoder passes when the output resembles the input. ``draft_ids`` (one token
    list per row) replaces the input as the text drafts are copied from.

    ``decoding="gad"`` drafts ``block_size`` tokens per pass with ``drafter`` (see
    ``lightgen.generation.drafting``): the same tokens as greedy with ``beta=1``; GAD++ (``beta`` > 1) also
    accepts a drafted token among the verifier's top-``beta`` within ``tau`` of the top-1's log-probability.
    """
    if kwargs.get("assistant_model") is not None and kwargs.get("assistant_tokenizer") is None and decoding == "auto":
        # HF's assisted decoding, batched: the assistant drafts for GAD (greedy: the same tokens as HF's).
        decoding, drafter = "gad", kwargs.pop("assistant_model")
    if kwargs.get("prompt_lookup_num_tokens") and decoding == "auto" and _greedy_call(model, generation_config, kwargs):
        # HF's prompt lookup decoding is IAD: drafts copied from the prompt (batched here; HF takes one row).
        decoding, max_draft = "iad", kwargs.pop("prompt_lookup_num_tokens")
    _check_lightgen_arguments(decoding, max_draft, block_size, drafter, beta, tau)
    aggressive = None
    if decoding != "auto":
        aggressive = Aggressive(drafter=drafter, draft_ids=draft_ids, acceptance=Acceptance(beta, tau),
                                max_draft=block_size if decoding == "gad" else max_draft or DraftBudget())
    original = type(model).generate
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if isinstance(input_ids, torch.Tensor) and (input_ids.dim() != 2 or 0 in input_ids.shape):
        raise ValueError(f"lightgen generate: input_ids must be a non-empty [batch, length] tensor (at least one "
                         f"row and one token), got shape {tuple(input_ids.shape)}")
    reason = next((f"argument '{name}' is not supported by lightgen's engine" for name in HF_ONLY_ARGUMENTS
                   if kwargs.get(name) is not None and kwargs.get(name) is not False), None)
    if reason is None and kwargs.get("cache_implementation") in HF_ONLY_CACHE_IMPLEMENTATIONS:
        reason = f"cache_implementation='{kwargs['cache_implementation']}' is not supported by lightgen's engine"
    reason = reason or _modules_refusal(model)
    if reason is not None:
        return unaccelerated_generate(model, inputs, generation_config, reason=reason, decoding=decoding,
                                      max_draft=max_draft, draft_ids=draft_ids, drafter=drafter,
                                      block_size=block_size, beta=beta, tau=tau, **kwargs)
    # HF hands a streamer only to its own loops; it still streams the prompt itself.
    decode = functools.partial(lightgen_decode, aggressive=aggressive, streamer=kwargs.get("streamer"))
    decode.__signature__ = _decode_signature()  # HF reads it every call: ~0.1 ms to derive from a partial
    _deferred.pending = True
    try:
        with cached_cpu_memory():
            return original(model, inputs, generation_config, custom_generate=decode, **kwargs)
    finally:
        _deferred.pending = False
        _deferred.call = None


def unaccelerated_generate(model: nn.Module, inputs=None, generation_config=None, *, reason: str,
                           decoding: str = "auto", max_draft: int | None = None, draft_ids=None, drafter=None,
                           block_size: int = 8, beta: int = 1, tau: float = 0.0, **kwargs):
    """``model.generate`` after ``accelerate_model`` for a model lightgen's engine cannot run (``reason``): HF's
    loop on the patched layers, with the fallback warning. lightgen's own arguments never reach HF: IAD and GAD
    give greedy's tokens, so they are dropped (the warning says so); GAD++ (``beta`` > 1) changes the tokens, so
    it is an error."""
    _check_lightgen_arguments(decoding, max_draft, block_size, drafter, beta, tau)
    if beta != 1 or tau != 0.0:
        raise ValueError(f"lightgen generate: GAD++ (beta={beta}, tau={tau}) needs lightgen's engine, and {reason}")
    ours = [name for name, given in (("decoding", decoding != "auto"), ("max_draft", max_draft is not None),
                                     ("draft_ids", draft_ids is not None), ("drafter", drafter is not None),
                                     ("block_size", block_size != 8)) if given]
    dropped = f" (without lightgen's {', '.join(ours)}: greedy's tokens)" if ours else ""
    _fall_back(f"{reason}{dropped}")
    return type(model).generate(model, inputs, generation_config, **kwargs)


_DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "activation_dropout", "layerdrop")


def _modules_refusal(model: nn.Module) -> str | None:
    """Why the model's modules keep it off the engine, in one walk over them (every call pays it), or None.
    lightgen's decoder reads weights directly, so it would skip hooks on them (HF's output recorders aside: the
    engine returns attentions and hidden states itself); and it runs inference only, so dropout in train() mode
    (nn.Dropout, or the float rates HF's modules pass to F.dropout) needs HF's loop."""
    dropout = None
    for name, module in model.named_modules():
        name = name or type(model).__name__
        if skips_hooks(module, output_recorders=False):
            kind = "accelerate hooks (offloaded or dispatched weights)" if "_hf_hook" in vars(module) else \
                "forward hooks"
            return f"module '{name}' carries {kind}"
        if dropout is None and module.training and _applies_dropout(module):
            dropout = name
    if dropout is not None:
        return f"module '{dropout}' applies dropout in train() mode (call model.eval() for lightgen's engine)"
    return None


def _applies_dropout(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return any(isinstance(rate, float) and rate > 0 for rate in map(vars(module).get, _DROPOUT_ATTRIBUTES))


@functools.cache
def _decode_signature() -> inspect.Signature:
    return inspect.signature(functools.partial(lightgen_decode, aggressive=None, streamer=None))


def _greedy_call(model, generation_config, kwargs) -> bool:
    """Whether generate's arguments ask for greedy search (argument, then ``generation_config``, then the model's)."""
    def setting(name):
        for source in (kwargs, vars(generation_config) if generation_config is not None else {},
                       vars(model.generation_config)):
            if source.get(name) is not None:
                return source[name]
        return None
    return not setting("do_sample") and (setting("num_beams") or 1) == 1


# HF's generate builds its KV cache object before it hands over to lightgen's loop, which never reads it;
# on the demo model that is 1.6 ms a call (a config walk and two DynamicCache objects), a fifth of an IAD
# call at batch 1. Inside ``accelerated_generate`` the patched ``_prepare_cache_for_generation`` only
# records its arguments; a fall back to HF's own loop builds the cache from them first.
_deferred = threading.local()


def deferred_cache_preparation(model, generation_config, model_kwargs, *args, **kwargs) -> None:
    """``model._prepare_cache_for_generation`` after ``accelerate_model``."""
    if getattr(_deferred, "pending", False):
        _deferred.pending = False  # this call's only: a nested generate (other model) prepares its own
        _deferred.call = (generation_config, model_kwargs, args, kwargs)
        return
    type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)


def _prepare_deferred_cache(model, model_kwargs: dict) -> None:
    call = getattr(_deferred, "call", None)
    if call is None:
        return
    _deferred.call = None
    generation_config, hf_model_kwargs, args, kwargs = call
    type(model)._prepare_cache_for_generation(model, generation_config, hf_model_kwargs, *args, **kwargs)
    model_kwargs.update((name, hf_model_kwargs[name]) for name in ALL_CACHE_NAMES if name in hf_model_kwargs)


def _hf_cache(model, generation_config, model_kwargs):
    """The cache HF's loop would return or extend (the caller's, or the one HF prepares for this call), built
    only when the call returns it or the caller passed one; None otherwise."""
    if not generation_config.return_dict_in_generate and hf_cache.cache_key(model_kwargs) is None:
        return None
    _prepare_deferred_cache(model, model_kwargs)
    key = hf_cache.cache_key(model_kwargs)
    return model_kwargs[key] if key is not None else None


@dataclasses.dataclass(frozen=True)
class Aggressive:
    """How to draft (copy the input or ``draft_ids``, or ask ``drafter``) and what to accept."""

    drafter: object
    draft_ids: list | None
    acceptance: Acceptance
    max_draft: int | DraftBudget

    @property
    def longest_draft(self) -> int:
        return self.max_draft.longest if isinstance(self.max_draft, DraftBudget) else self.max_draft

    @property
    def name(self) -> str:
        return "iad" if self.drafter is None else "gad"


def _observes(generation_config) -> bool:
    """Whether the call returns attentions or hidden states (HF computes them and drops them without a dict)."""
    return bool(generation_config.return_dict_in_generate
                and (generation_config.output_attentions or generation_config.output_hidden_states))


def _observing_unsupported(generation_config) -> str | None:
    if not _observes(generation_config):
        return None
    if generation_config.get_generation_mode() == GenerationMode.GROUP_BEAM_SEARCH:
        return "attentions and hidden states of group beam search are not supported"
    if not generation_config.use_cache:  # HF then reruns the whole sequence each step: its outputs cover it all
        return "attentions and hidden states with use_cache=False are not supported"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:  # HF's then are the last chunk's
        return "attentions and hidden states with prefill_chunk_size are not supported"
    if not isinstance(generation_config.output_hidden_states, (bool, type(None))):
        return f"selecting hidden states (output_hidden_states={generation_config.output_hidden_states!r}) is " \
               f"not supported"
    return None


def _attention_windows(cache, layers: int) -> tuple[int, ...] | str:
    """Per layer, the keys HF's cache hands attention (see ``Observed.windows``), or why lightgen cannot tell:
    a static cache's weights span its whole length, other layers hold other states."""
    self_cache = getattr(cache, "self_attention_cache", cache)
    cache_layers = getattr(self_cache, "layers", None)
    if cache_layers == [] and getattr(self_cache, "layer_class_to_replicate", None) is DynamicLayer:
        return (0,) * layers  # a DynamicCache() without a config makes its layers on first use
    if cache_layers is None or len(cache_layers) != layers:
        return f"attentions with a {type(cache).__name__} cache are not supported"
    windows = []
    for layer in cache_layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            return f"attentions with {type(layer).__name__} cache layers are not supported"
        windows.append(getattr(layer, "sliding_window", 0))
    return tuple(windows)


def _follow_hf(state, model, cache, static_slots, past: int, new: int) -> None:
    """What ``state`` follows of HF's call where fp16 / bf16 round by it: the static cache's slots, whether the prompt
    pass's LM head runs over every position, and on HF's eager attention where its softmax rounds and per layer the
    keys HF's cache layer hands attention in a prompt pass of ``new`` positions after ``past``."""
    state.static_slots = static_slots
    state.prompt_head_everywhere = not _keeps_logits(model)
    if model.config._attn_implementation == lg_attention.EAGER_IMPLEMENTATION:
        state.eager_spans = _eager_key_spans(model, cache, past, new)
        state.eager_softmax_in_dtype = lg_attention.softmax_in_dtype(model)


def _keeps_logits(model) -> bool:
    """Whether HF's generate has ``model``'s forward compute the last position's logits alone (``logits_to_keep``)."""
    return _forward_takes(type(model).forward, "logits_to_keep")


@functools.cache
def _forward_takes(forward, name: str) -> bool:
    return name in inspect.signature(forward).parameters


def _layout_cache(model, generation_config, model_kwargs, cache):
    """The cache whose layers say which keys HF's attention gets: ``cache`` (the one the call returns or extends) or,
    for a ``cache_implementation``, the one HF prepares for the call (its layers allocate nothing before their first
    update; a static one's size HF takes from earlier calls too)."""
    if cache is None and generation_config.cache_implementation is not None:
        _prepare_deferred_cache(model, model_kwargs)
        key = hf_cache.cache_key(model_kwargs)
        cache = model_kwargs[key] if key is not None else None
    return cache


def _static_slots(cache) -> tuple[int, ...] | None:
    """Per layer, the slots of HF's static cache layer (0: a dynamic one), every one of which its attention gets;
    None without a static layer."""
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", ())
    slots = tuple(layer.max_cache_len if isinstance(layer, StaticLayer) else 0 for layer in layers)
    return slots if any(slots) else None


def _eager_key_spans(model, cache, past: int, new: int) -> tuple[KeySpan, ...]:
    """Per layer, the keys HF's cache layer hands attention in a prompt pass of ``new`` positions after ``past`` (as
    the layers' ``update`` returns them; a DynamicCache's without ``cache``). A prompt position that sees no key
    spreads over them: the cache and hidden states hold it, and a row of padding alone takes its first token from
    it."""
    layers = len(getattr(model, DECODER_ATTR).spec.layers)
    cache_layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None) or [DynamicLayer()] * layers
    spans = []
    for layer in cache_layers:
        if isinstance(layer, StaticSlidingWindowLayer):
            size = layer.max_cache_len
            if past >= size:  # full: its last size - 1 and the new ones
                spans.append(KeySpan(past - size + 1, size - 1 + new))
            else:  # every slot, or more than fit: the cached and the new ones
                spans.append(KeySpan(0, max(size, past + new)))
        elif isinstance(layer, StaticLayer):
            spans.append(KeySpan(0, layer.max_cache_len))
        elif isinstance(layer, DynamicSlidingWindowLayer):
            kept = min(past, layer.sliding_window - 1)
            spans.append(KeySpan(past - kept, kept + new))
        else:
            spans.append(KeySpan(0, past + new))
    return tuple(spans)


def _unknown_inputs(model, model_kwargs) -> str | None:
    known = _KNOWN_MODEL_KWARGS
    if getattr(model, DECODER_ATTR).spec.token_type_embedding is not None:
        known = known | {"token_type_ids"}
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in known)
    return f"model inputs {unknown} are not supported" if unknown else None


def _passes_unfollowed(model, generation_config) -> str | None:
    """HF passes whose results lightgen's one prefill and cached steps do not give. use_cache=False: HF runs the
    whole sequence again each step; the same tokens, but for positions that skip padding tokens, and for fp16 / bf16
    rounding (a whole-sequence pass's last row rounds otherwise than a one-token step: scores differed in 4 of 4
    tiny Llama, GPT-2 and Qwen2 cases). prefill_chunk_size: HF's prompt chunks round otherwise than one pass in
    fp16 / bf16 (2 of ~1,100 fuzz cases: OPT bf16, Gemma 3 fp16)."""
    half = model.dtype in (torch.float16, torch.bfloat16)
    dtype = str(model.dtype).removeprefix("torch.")
    if not generation_config.use_cache:
        if getattr(model, DECODER_ATTR).spec.position_padding_idx is not None:
            return "use_cache=False where positions skip padding tokens (M2M100, NLLB): HF then numbers the " \
                   "whole sequence again each step, past the padding tokens it generated, which cached steps number on"
        if half:
            return f"use_cache=False in {dtype}: HF then runs the whole sequence again each step, which rounds " \
                   f"otherwise than cached steps"
    if half and getattr(generation_config, "prefill_chunk_size", None) is not None:
        return f"prefill_chunk_size in {dtype}: HF's prompt chunks round otherwise than one prefill pass"
    return None


def _unsupported(model, generation_config, model_kwargs, input_ids) -> str | None:
    mode = generation_config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        return f"generation mode '{mode.value}' is not supported"
    unfollowed = _passes_unfollowed(model, generation_config)
    if unfollowed is not None:
        return unfollowed
    if getattr(generation_config, "low_memory", False):
        return "'low_memory=True' is not supported"
    if generation_config.cache_implementation in HF_ONLY_CACHE_IMPLEMENTATIONS:
        return f"cache_implementation='{generation_config.cache_implementation}' is not supported"
    unknown = _unknown_inputs(model, model_kwargs)
    if unknown is not None:
        return unknown
    if mode == GenerationMode.GROUP_BEAM_SEARCH and (_prompt_embeds(model, model_kwargs) is not None
                                                     or model_kwargs.get("token_type_ids") is not None):
        return "group beam search from inputs_embeds or token_type_ids is not supported"
    reason = _observing_unsupported(generation_config)
    if reason is not None:
        return reason
    decoder_mask = model_kwargs.get("decoder_attention_mask")
    if decoder_mask is not None and decoder_mask.shape != input_ids.shape:
        return f"a decoder_attention_mask of shape {tuple(decoder_mask.shape)} for decoder inputs of shape " \
               f"{tuple(input_ids.shape)} is not supported"
    key = hf_cache.cache_key(model_kwargs)
    if key is not None:
        reason = hf_cache.unsupported(model_kwargs[key], input_ids.shape[0])
        if reason is not None:
            return f"continuing from {reason} is not supported"
        if mode == GenerationMode.GROUP_BEAM_SEARCH:
            return "group beam search does not continue from a cache"
    return None


def _aggressive_unsupported(name, model, generation_config, logits_processor, stopping_criteria, rows, streamer,
                            model_kwargs) -> str | None:
    if generation_config.get_generation_mode() != GenerationMode.GREEDY_SEARCH:
        return f"decoding='{name}' is greedy decoding (num_beams=1, do_sample=False)"
    if streamer is not None and rows > 1:
        return f"decoding='{name}' streams one row (as HF's assisted decoding), not {rows}"
    if hf_cache.cache_key(model_kwargs) is not None:
        return f"decoding='{name}' does not continue from a cache"
    others = [p for p in logits_processor if not isinstance(p, ForcedEOSTokenLogitsProcessor)]
    if others:
        names = ", ".join(type(p).__name__ for p in others)
        return f"decoding='{name}' does not run logits processors ({names})"
    if any(type(c).__name__ not in ("MaxLengthCriteria", "EosTokenCriteria") for c in stopping_criteria):
        return f"decoding='{name}' supports only max-length and EOS stopping"
    if generation_config.return_dict_in_generate and (generation_config.output_scores
                                                      or generation_config.output_logits):
        return f"decoding='{name}' does not return scores or logits"
    if _observes(generation_config):
        return f"decoding='{name}' does not return attentions or hidden states"
    if model_kwargs.get("token_type_ids") is not None or _prompt_embeds(model, model_kwargs) is not None:
        return f"decoding='{name}' runs a prompt of tokens without token types (not inputs_embeds or " \
               f"token_type_ids)"
    return _unknown_inputs(model, model_kwargs)


def lightgen_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor=None,
                    aggressive: Aggressive | None = None, streamer=None, **model_kwargs):
    """HF ``custom_generate`` callable: greedy, sampling and beam search on lightgen's decoder, and
    aggressive decoding (IAD, GAD) for greedy."""
    if streamer is not None and generation_config.num_beams > 1:
        if generation_config.get_generation_mode() != GenerationMode.BEAM_SAMPLE:  # HF's refusal, word for word
            raise ValueError("`streamer` cannot be used with beam search (yet!). Make sure that `num_beams` is set "
                             "to 1.")
        streamer = None  # HF's beam sampling streams the prompt alone (generate's own put), and no end
    if getattr(generation_config, "prefill_chunk_size", None) is not None and not generation_config.use_cache:
        raise ValueError("Cannot use prefill chunking without a cache")  # HF's prefill, word for word
    # HF's loops append int64 tokens to the prompt, so int32 input_ids come back int64: the same here.
    input_ids = input_ids.long() if input_ids.dtype == torch.int32 else input_ids
    if aggressive is not None and _passes_unfollowed(model, generation_config) is None:  # else HF's loop, below
        reason = _aggressive_unsupported(aggressive.name, model, generation_config, logits_processor,
                                         stopping_criteria, input_ids.shape[0], streamer, model_kwargs)
        if reason is None:
            return _aggressive(model, input_ids, inputs_tensor, generation_config, logits_processor, aggressive,
                               streamer, model_kwargs)
        _fall_back(reason, instead=f"lightgen's loop without decoding='{aggressive.name}'")
    decoder = getattr(model, DECODER_ATTR)
    group_beams = generation_config.get_generation_mode() == GenerationMode.GROUP_BEAM_SEARCH
    reason = _unsupported(model, generation_config, model_kwargs, input_ids)
    cache = windows = None
    if reason is None and not group_beams:
        cache = _hf_cache(model, generation_config, model_kwargs)
        if _observes(generation_config) and generation_config.output_attentions:
            windows = _attention_windows(cache, len(decoder.spec.layers))
            reason = windows if isinstance(windows, str) else None
    if reason is None:
        logits_processor = _without_vocabulary_scans(logits_processor)
    else:
        hf_method_name = GENERATION_MODES_MAPPING[generation_config.get_generation_mode()]
        if "/" in hf_method_name:  # transformers 5 moved this mode to a Hub repo
            raise ValueError(f"lightgen generate: {reason}, and transformers ships it only as the Hub repo "
                             f"'{hf_method_name}': pass custom_generate='{hf_method_name}' (with "
                             f"trust_remote_code=True) to run it through Hugging Face")
        _fall_back(reason)
        _prepare_deferred_cache(model, model_kwargs)
        hf_method = getattr(GenerationMixin, hf_method_name)
        if streamer is not None:
            model_kwargs["streamer"] = streamer
        return hf_method(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                         generation_config=generation_config, synced_gpus=False, **model_kwargs)
    embedding = decoder.spec.token_embedding
    mask_key = "decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask"
    past = hf_cache.past_length(cache) if cache is not None else 0
    layout = _layout_cache(model, generation_config, model_kwargs, cache)
    static_slots = _static_slots(layout)
    embeds = _prompt_embeds(model, model_kwargs)
    # HF feeds the input after the cached positions, or (without a mask of the input's length) all of it again;
    # a prompt given as embeddings always after them.
    cached = past if embeds is not None else hf_cache.cached_prompt(past, input_ids, model_kwargs.get(mask_key),
                                                                     generation_config)
    # The embeddings stand for the prompt: the tokens HF returns are input_ids (often none) and the new ones.
    prompt_len = embeds.shape[1] if embeds is not None else input_ids.shape[1]
    max_len = generation_config.max_length - input_ids.shape[1] + prompt_len + past - cached
    start = dict(rows=input_ids.shape[0], max_len=max_len, dtype=embedding.dtype, device=embedding.device,
                 prompt_mask=_step_mask(model_kwargs.get(mask_key), static_slots))
    if model.config.is_encoder_decoder:
        state = decoder.start(**start, encoder_hidden=model_kwargs["encoder_outputs"][0],
                              encoder_mask=model_kwargs.get("attention_mask"),
                              expand=max(generation_config.num_beams, generation_config.num_return_sequences))
    else:
        state = decoder.start(**start)
    outputs = _OUTPUTS[model.config.is_encoder_decoder]
    prompt_positions = model_kwargs.get("position_ids")
    state.prompt_embeds, state.token_types = embeds, model_kwargs.get("token_type_ids")
    if _observes(generation_config):
        state.observed = Observed(bool(generation_config.output_attentions),
                                  bool(generation_config.output_hidden_states), windows or ())
    _follow_hf(state, model, layout, static_slots, past, prompt_len - cached)
    try:
        if cache is not None:
            hf_cache.load(state, cache)
            state.cached_prompt = cached
        if group_beams:
            result = group_beam_search(decoder, state, input_ids, prompt_positions, logits_processor,
                                       stopping_criteria, generation_config, outputs[1])
        elif generation_config.num_beams > 1:
            result = _beam_search(model, decoder, state, input_ids, prompt_positions, logits_processor,
                                  stopping_criteria, generation_config, outputs[1], cache is not None)
        else:
            result = _greedy_or_sample(decoder, state, input_ids, prompt_positions, logits_processor,
                                       stopping_criteria, generation_config, outputs[0], streamer, cache is not None)
        if cache is not None:
            hf_cache.store(state, cache, past)
        if not generation_config.return_dict_in_generate:
            return result
        if state.observed is not None:  # set in HF's field order, before the cache (its last field)
            fields = state.observed.fields(model.config.is_encoder_decoder, model_kwargs.get("encoder_outputs"))
            for name, value in fields.items():
                if value is not None:
                    result[name] = value
        return hf_cache.with_cache(result, cache)
    finally:
        state.release()


def _prompt_embeds(model, model_kwargs):
    """A decoder-only prompt given as embeddings (``inputs_embeds``), or None (an encoder's were its input)."""
    return None if model.config.is_encoder_decoder else model_kwargs.get("inputs_embeds")


def _step_mask(mask: torch.Tensor | None, static_slots) -> torch.Tensor | None:
    """The prompt's mask where HF's attention gets one at every step (a padded prompt, or a static cache's empty
    slots), else None: with a mask transformers 5.23+'s sdpa runs a grouped-query step otherwise (``pack_gqa``)."""
    return mask if mask is None or static_slots or not bool(mask.all()) else None


def _aggressive(model, input_ids, inputs_tensor, generation_config, logits_processor, aggressive: Aggressive,
                streamer, model_kwargs):
    decoder = getattr(model, DECODER_ATTR)
    embedding = decoder.spec.token_embedding
    # Spare cache room for the padding after short drafts, which is written and then rolled back.
    start = dict(rows=input_ids.shape[0], max_len=generation_config.max_length, dtype=embedding.dtype,
                 device=embedding.device, spare_positions=aggressive.longest_draft)
    mask = model_kwargs.get("attention_mask")
    source = inputs_tensor if model.config.is_encoder_decoder else input_ids
    keep = mask.bool() if mask is not None else torch.ones_like(source, dtype=torch.bool)
    sources = [row[row_keep].tolist() for row, row_keep in zip(source, keep, strict=True)]
    if aggressive.draft_ids is not None:
        sources = [list(map(int, ids)) for ids in aggressive.draft_ids]
        if len(sources) != input_ids.shape[0]:
            raise ValueError(f"lightgen generate: draft_ids has {len(sources)} rows for a batch of "
                             f"{input_ids.shape[0]}")
    eos = generation_config._eos_token_tensor
    pad = generation_config._pad_token_tensor
    # Forcing EOS at the last position picks the lowest forced id, as argmax over HF's scores does.
    forced = [int(p.eos_token_id.min()) for p in logits_processor if isinstance(p, ForcedEOSTokenLogitsProcessor)]
    # One row keeps every position to the end (finished rows leave the batch): its cache can be returned.
    cache = _hf_cache(model, generation_config, model_kwargs) if input_ids.shape[0] == 1 else None
    layout = _layout_cache(model, generation_config, model_kwargs, cache)
    static_slots = _static_slots(layout)
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if model.config.is_encoder_decoder:
        state = decoder.start(**start, encoder_hidden=encoder_outputs[0], encoder_mask=mask)
    else:
        state = decoder.start(**start, prompt_mask=_step_mask(mask, static_slots))
    try:
        _follow_hf(state, model, layout, static_slots, 0, input_ids.shape[1])
        if aggressive.drafter is None:
            drafts = CopyFromInput(sources)
        else:
            drafts = start_session(aggressive.drafter, sources=sources, source_ids=source, source_mask=mask,
                                   max_length=generation_config.max_length, max_draft=aggressive.longest_draft,
                                   encoder_hidden=encoder_outputs[0] if encoder_outputs is not None else None,
                                   accelerate=getattr(model, ACCELERATE_ATTR),
                                   decoder_only=not model.config.is_encoder_decoder, verifier=model, state=state)
        try:
            sequences, gained = aggressive_greedy(
                decoder, state, input_ids, model_kwargs.get("position_ids"), drafts,
                set(eos.tolist()) if eos is not None else set(), int(pad) if pad is not None else 0,
                generation_config.max_length, aggressive.max_draft, aggressive.acceptance,
                forced[0] if forced else None, streamer)
        finally:
            drafts.close()
        if cache is not None:  # the last pass may have verified past an EOS or the length limit
            state.cache.length = sequences.shape[1] - 1
            hf_cache.store(state, cache, 0)
    finally:
        state.release()
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return sequences
    output_class = AggressiveEncoderDecoderOutput if model.config.is_encoder_decoder else AggressiveDecoderOnlyOutput
    return hf_cache.with_cache(output_class(sequences=sequences, iterations=torch.tensor([len(row) for row in gained]),
                                            tokens_per_iteration=tuple(torch.tensor(row) for row in gained)), cache)


# is_encoder_decoder -> (sampling output class, beam output class), as HF returns them.
_OUTPUTS = {
    True: (GenerateEncoderDecoderOutput, GenerateBeamEncoderDecoderOutput),
    False: (GenerateDecoderOnlyOutput, GenerateBeamDecoderOnlyOutput),
}


class _EosBlockedUntil(LogitsProcessor):
    """HF's MinLength / MinNewTokensLength processors, same scores, without the isin over the whole
    vocabulary they run every step (~160 us at 32k tokens: 2-7% of a batch-1 decode step), and in
    place when the scores are the engine's own (a copy of [8, 32000] logits cost ~0.3 ms a step)."""

    def __init__(self, min_length: int, eos_ids: torch.Tensor, in_place: bool) -> None:
        self.min_length = min_length  # total sequence length below which EOS is blocked
        self.eos_ids = eos_ids[eos_ids >= 0]  # isin never matched a negative id
        self.in_place = in_place

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.min_length:
            return scores
        block = scores.index_fill_ if self.in_place else scores.index_fill
        return block(1, self.eos_ids.to(scores.device), -math.inf)


class _TopK(LogitsProcessor):
    """HF's TopKLogitsWarper (on by default when sampling: top_k=50), same scores: the k-th largest score from
    ``ops.beam_topk``'s threshold filter instead of ``torch.topk`` over the vocabulary (11 ms a step for 32 rows
    of 50k tokens at 1 thread). HF's own call for scores the kernel does not take: NaN or +inf, other dtypes,
    other devices."""

    def __init__(self, warper: TopKLogitsWarper) -> None:
        self.warper = warper

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if (scores.dtype != torch.float32 or scores.device.type != "cpu" or scores.dim() != 2
                or not _build.load().compiled):
            return self.warper(input_ids, scores)
        top_k = min(self.warper.top_k, scores.shape[-1])
        try:
            values, _, _ = ops.beam_topk(scores, None, 1, top_k, False, stable=True)
        except RuntimeError as error:
            if not ops.refuses_non_finite(error):
                raise
            return self.warper(input_ids, scores)
        return scores.masked_fill(scores < values[:, -1:], self.warper.filter_value)


def _without_vocabulary_scans(logits_processor: LogitsProcessorList) -> LogitsProcessorList:
    """The processors with HF's min-length and top-k ones replaced. The scores the engine passes in are fresh
    tensors of its own, and HF's processors return their input or a new tensor: up to the first other
    processor (one that might keep the tensor it returns), blocking EOS can write in place."""
    lean = LogitsProcessorList()
    scores_are_ours = True
    for processor in logits_processor:
        if type(processor) is MinLengthLogitsProcessor:
            processor = _EosBlockedUntil(processor.min_length, processor.eos_token_id, scores_are_ours)
        elif type(processor) is MinNewTokensLengthLogitsProcessor:
            processor = _EosBlockedUntil(processor.prompt_length_to_skip + processor.min_new_tokens,
                                         processor.eos_token_id, scores_are_ours)
        elif type(processor) is TopKLogitsWarper:
            processor = _TopK(processor)  # returns a tensor of its own, as HF's does
        else:
            scores_are_ours = scores_are_ours and type(processor).__module__.startswith("transformers.")
        lean.append(processor)
    return lean


# Processors and stopping criteria that treat each row on its own: dropping finished rows from the
# batch cannot change what they decide for the others.
_ROW_WISE = {
    "_EosBlockedUntil", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor", "SequenceBiasLogitsProcessor", "MaxLengthCriteria", "EosTokenCriteria",
}


def _row_wise(processor, rows: int) -> bool:
    # A tensor with one entry per row (e.g. a per-row prompt length) ties it to batch positions.
    per_row_state = any(isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows
                        for value in vars(processor).values())
    return type(processor).__name__ in _ROW_WISE and not per_row_state


def _can_drop_finished_rows(state, rows, generation_config, logits_processor, stopping_criteria) -> bool:
    """Greedy rows that finished early stop costing compute, when nothing observes the full batch:
    sampling draws from the RNG per row of the full batch, and scores/logits are reported per row
    (a streamer and a returned cache also see every row: the callers check those). Not on a GPU, where
    steps replay a CUDA graph: it costs the same for every row, and fewer rows would mean capturing again."""
    replayed = state.next_position.is_cuda and step_graph.enabled()
    return (not replayed and not generation_config.do_sample and state.expand == 1 and state.observed is None
            and not (generation_config.return_dict_in_generate
                     and (generation_config.output_scores or generation_config.output_logits))
            and all(_row_wise(p, rows) for p in [*logits_processor, *stopping_criteria]))


def _applying(processors):
    """``processors(input_ids, scores)`` as HF's LogitsProcessorList computes it, without the list's
    ``inspect.signature`` of every processor at every step (~10 us each): a list whose processors all take
    (input_ids, scores) is applied in a plain loop; any other list is called as it is (HF's own error then)."""
    if any(len(inspect.signature(processor.__call__).parameters) > 2 for processor in processors):
        return processors

    def apply(input_ids, scores):
        for processor in processors:
            scores = processor(input_ids, scores)
        return scores
    return apply


def _greedy_or_sample(decoder, state, input_ids, prompt_positions, logits_processor, stopping_criteria,
                      generation_config, output_class, streamer=None, keep_every_row=False):
    """HF's ``_sample`` semantics: same processors, same RNG calls, same stopping and padding, the same
    streamer calls. ``keep_every_row``: the cache is returned, so finished rows stay in it."""
    rows, cur_len = input_ids.shape
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores = () if keep_scores else None
    raw_logits = () if keep_logits else None
    drop_finished = (has_eos_stopping_criteria and streamer is None and not keep_every_row
                     and _can_drop_finished_rows(state, rows, generation_config, logits_processor, stopping_criteria))

    sequences = torch.empty((rows, generation_config.max_length), dtype=input_ids.dtype, device=input_ids.device)
    sequences[:, :cur_len] = input_ids
    output = None  # [rows, max_length] once finished rows have been dropped from ``sequences``
    live_rows = None  # which output row each row of ``sequences`` is, after a drop
    unfinished = torch.ones(rows, dtype=torch.long, device=input_ids.device)
    process = _applying(logits_processor)
    logits = decoder.prefill(state, input_ids, prompt_positions)
    while True:
        if keep_logits:  # before the processors, which may write in place
            raw_logits += (logits.clone(),)
        next_token_scores = process(sequences[:, :cur_len], logits)
        if keep_scores:
            scores += (next_token_scores,)
        if generation_config.do_sample:
            next_tokens = ops.sample_tokens(nn.functional.softmax(next_token_scores, dim=-1))
        else:
            next_tokens = ops.greedy_tokens(next_token_scores)
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        sequences[:, cur_len] = next_tokens
        cur_len += 1
        unfinished = unfinished & ~stopping_criteria(sequences[:, :cur_len], scores)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        if unfinished.max() == 0:
            break
        if drop_finished and not unfinished.all():
            if output is None:
                output = torch.full_like(sequences, pad_token_id)
                live_rows = torch.arange(rows, device=input_ids.device)
            finished = (unfinished == 0).nonzero().squeeze(1)
            output[live_rows[finished], :cur_len] = sequences[finished, :cur_len]
            keep = unfinished.nonzero().squeeze(1)
            sequences, live_rows = sequences.index_select(0, keep), live_rows[keep]
            unfinished, next_tokens = unfinished[keep], next_tokens[keep]
            state.keep_rows(keep)
        logits = decoder.step(state, next_tokens[:, None])

    if streamer is not None:
        streamer.end()
    if output is None:
        output = sequences
    else:
        output[live_rows, :cur_len] = sequences[:, :cur_len]
    output = output[:, :cur_len]
    if not generation_config.return_dict_in_generate:
        return output
    return output_class(sequences=output, scores=scores, logits=raw_logits)


def _r_top_k_continuations(model, log_probs, running_beam_scores, running_sequences, running_beam_indices, cur_len,
                           decoder_prompt_len, beams_to_keep, apply_log_softmax):
    """HF's ``_get_top_k_continuations`` (greedy case) with its log_softmax + add + top-k done by the
    R-top-k kernel, which returns the same candidates in the same order."""
    batch_size, num_beams = running_beam_scores.shape
    vocab_size = log_probs.shape[-1]
    try:
        topk_log_probs, topk_indices, _ = ops.beam_topk(log_probs, running_beam_scores.reshape(-1), num_beams,
                                                        beams_to_keep, apply_log_softmax)
    except RuntimeError as error:
        if not ops.refuses_non_finite(error):
            raise
        # The kernel refuses NaN and +inf (NaN weights, a processor writing +inf); HF's composite ranks them.
        if apply_log_softmax:
            log_probs = nn.functional.log_softmax(log_probs, dim=-1)
        accumulated = log_probs.view(batch_size, num_beams, vocab_size) + running_beam_scores[:, :, None]
        return model._get_top_k_continuations(
            accumulated_log_probs=accumulated.reshape(batch_size, -1), running_sequences=running_sequences,
            running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=decoder_prompt_len,
            do_sample=False, beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size)
    topk_current_beam_indices = topk_indices // vocab_size
    topk_running_beam_indices = model._gather_beams(running_beam_indices, topk_current_beam_indices)
    topk_running_sequences = model._gather_beams(running_sequences, topk_current_beam_indices)
    topk_running_sequences[:, :, cur_len] = topk_indices % vocab_size
    batch_offset = torch.arange(batch_size, device=log_probs.device).view(-1, 1) * num_beams
    topk_running_beam_indices[:, :, cur_len - decoder_prompt_len] = topk_current_beam_indices + batch_offset
    return topk_log_probs, topk_running_sequences, topk_running_beam_indices


def _beam_search(model, decoder, state, input_ids, prompt_positions, logits_processor, stopping_criteria,
                 generation_config, output_class, reorder_last=False):
    """HF's ``_beam_search`` bookkeeping (its own helpers), with lightgen's step and in-place cache reorder.
    ``reorder_last``: the cache is returned, reordered after the last step as HF's is."""
    pad_token_id = generation_config._pad_token_tensor
    eos_token_id = generation_config._eos_token_tensor
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    early_stopping = generation_config.early_stopping
    length_penalty = generation_config.length_penalty
    max_length = generation_config.max_length
    num_beams = generation_config.num_beams
    num_return_sequences = generation_config.num_return_sequences
    device = input_ids.device

    flat_rows, cur_len = input_ids.shape
    batch_size = flat_rows // num_beams
    decoder_prompt_len = cur_len
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams
    top_num_beam_mask = torch.zeros(beams_to_keep, dtype=torch.bool, device=device)
    top_num_beam_mask[:num_beams] = True

    all_scores = () if keep_scores else None
    raw_logits = () if keep_logits else None
    output_fill_value = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
    running_sequences = torch.full((batch_size, num_beams, max_length), fill_value=output_fill_value,
                                   dtype=torch.int64, device=device)
    running_sequences[:, :, :cur_len] = model._unflatten_beam_dim(input_ids, batch_size, num_beams)
    sequences = running_sequences.clone()
    running_beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float, device=device)
    running_beam_scores[:, 1:] = -1e9
    beam_scores = torch.full((batch_size, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    is_early_stop_heuristic_unsatisfied = torch.ones((batch_size, 1), dtype=torch.bool, device=device)
    running_beam_indices = torch.full((batch_size, num_beams, max_length - cur_len), fill_value=-1,
                                      dtype=torch.int32, device=device)
    beam_indices = running_beam_indices.clone()

    # Without processors between them, log_softmax fuses into the R-top-k pass.
    fuse_log_softmax = len(logits_processor) == 0 and not keep_scores
    flat_running_sequences = input_ids
    process = _applying(logits_processor)
    logits = decoder.prefill(state, input_ids, prompt_positions)
    while True:
        if keep_logits:
            raw_logits += (logits.clone(),)
        if fuse_log_softmax:
            log_probs = logits
        else:
            log_probs = process(flat_running_sequences, nn.functional.log_softmax(logits, dim=-1))
        if keep_scores:
            all_scores += (log_probs.clone(),)
        if generation_config.do_sample:
            accumulated = model._unflatten_beam_dim(log_probs, batch_size, num_beams) + running_beam_scores[:, :, None]
            topk_log_probs, topk_running_sequences, topk_running_beam_indices = model._get_top_k_continuations(
                accumulated_log_probs=accumulated.reshape(batch_size, -1), running_sequences=running_sequences,
                running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=decoder_prompt_len,
                do_sample=True, beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size,
            )
        else:
            topk_log_probs, topk_running_sequences, topk_running_beam_indices = _r_top_k_continuations(
                model, log_probs, running_beam_scores, running_sequences, running_beam_indices, cur_len,
                decoder_prompt_len, beams_to_keep, fuse_log_softmax)
        next_token_hits_stopping_criteria = stopping_criteria(
            model._flatten_beam_dim(topk_running_sequences[:, :, : cur_len + 1]), all_scores)
        next_token_hits_stopping_criteria = model._unflatten_beam_dim(
            next_token_hits_stopping_criteria, batch_size, beams_to_keep)
        running_sequences, running_beam_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs, topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices,
            next_token_hits_stopping_criteria=next_token_hits_stopping_criteria, num_beams=num_beams,
        )
        sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
            sequences=sequences, topk_running_sequences=topk_running_sequences, beam_scores=beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            is_sent_finished=is_sent_finished, next_token_hits_stopping_criteria=next_token_hits_stopping_criteria,
            top_num_beam_mask=top_num_beam_mask, num_beams=num_beams, cur_len=cur_len,
            decoder_prompt_len=decoder_prompt_len, length_penalty=length_penalty, early_stopping=early_stopping,
        )
        beam_idx = model._flatten_beam_dim(running_beam_indices[..., cur_len - decoder_prompt_len])
        cur_len += 1
        is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            running_beam_scores=running_beam_scores, beam_scores=beam_scores, is_sent_finished=is_sent_finished,
            cur_len=cur_len, max_length=max_length, decoder_prompt_len=decoder_prompt_len,
            early_stopping=early_stopping, length_penalty=length_penalty,
        )
        if not model._beam_search_has_unfinished_sequences(is_early_stop_heuristic_unsatisfied, is_sent_finished,
                                                            next_token_hits_stopping_criteria, early_stopping):
            if reorder_last:
                state.reorder(beam_idx.long())
            break
        state.reorder(beam_idx.long())
        flat_running_sequences = model._flatten_beam_dim(running_sequences[:, :, :cur_len])
        logits = decoder.step(state, flat_running_sequences[:, -1:])

    sequences = model._flatten_beam_dim(sequences[:, :num_return_sequences, :])
    beam_scores = model._flatten_beam_dim(beam_scores[:, :num_return_sequences])
    beam_indices = model._flatten_beam_dim(beam_indices[:, :num_return_sequences, :])
    max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
    output_length = decoder_prompt_len + max_generated_length
    sequences = sequences[:, :output_length]
    beam_indices = beam_indices[:, :max_generated_length]
    if not generation_config.return_dict_in_generate:
        return sequences
    return output_class(
        sequences=sequences, sequences_scores=beam_scores if keep_scores else None, scores=all_scores,
        logits=raw_logits, beam_indices=beam_indices)
