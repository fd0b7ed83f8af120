"""``accelerate_model`` / ``restore_model`` and the registry of model families."""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable

from torch import nn
from transformers import GenerationMixin

from lightgen.adapters._patch import Patcher
from lightgen.generation import engine
from lightgen.memory import WeightArena
from lightgen.modules import attention as lg_attention
from lightgen.modules.decoder import NoEngine
from lightgen.modules.linear import HEAD_PRECISION, check_precision, is_conv1d, linear_forward, linear_weights
from lightgen.modules.norm import apply_norm, norm_kind

PATCHER_ATTR = "_lightgen_patcher"


class UnsupportedModelError(TypeError):
    """The object is not a model lightgen knows how to accelerate."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    family: str
    patch_layers: Callable[[nn.Module, Patcher], None]  # patches the family's transformer blocks
    attention_interface: bool = True  # the family's attention dispatches through AttentionInterface
    # Builds the static-cache decoder step that lightgen's generate() runs (None: HF's generate loop).
    decoder: Callable[[nn.Module], object] | None = None


# model_type -> Adapter; filled by the family modules below.
ADAPTERS: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter, *model_types: str) -> None:
    for model_type in model_types:
        ADAPTERS[model_type] = adapter


def _model_type(model) -> str:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"accelerate_model expects a transformers PreTrainedModel (an nn.Module), got {type(model).__name__}"
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        supported = ", ".join(sorted(ADAPTERS))
        found = f"model_type '{model_type}'" if model_type else f"{type(model).__name__} without a config.model_type"
        raise UnsupportedModelError(f"lightgen cannot accelerate {found}; supported families: {supported}")
    return model_type


def _patch_norms(model: nn.Module, patcher: Patcher) -> None:
    """Every affine LayerNorm / RMSNorm not already inside a patched block runs the lightgen op."""
    for name, module in model.named_modules():
        kind = norm_kind(module)
        if kind is not None and kind != "rms_offset":  # (1 + w) norms run a composite: nothing to patch
            patcher.replace_forward(module, apply_norm, f"{kind}_norm", name)


def _patch_linears(model: nn.Module, patcher: Patcher, quantize: str | None, pack: bool) -> None:
    """Every nn.Linear and HF Conv1D runs the decode-shaped matmul where it pays."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    arena = WeightArena()
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            continue
        # int4 keeps the LM head at int8, as llama.cpp's 4-bit files keep their output tensor at 6-8 bits: on
        # SmolLM2-135M a 4-bit head holds most of int4's error (benchmarks/quantize_quality.py).
        precision = HEAD_PRECISION.get(quantize, quantize) if module is head else quantize
        weights = linear_weights(module, precision, pack, arena)
        if weights is not None:
            patcher.set(module, "_lightgen_linear", weights)
            layout = "packed" if weights.source else "in place"
            patcher.replace_forward(module, linear_forward, f"linear {precision or 'fp32'} {layout}", name)


def accelerate_model(model, *, quantize: str | None = None, pack: bool = True, **options):
    """Patch ``model`` in place to run lightgen's kernels; returns the same object.

    The parameters, buffers and ``state_dict()`` are untouched. Linear layers get a packed copy of
    their weight for decode-shaped matmuls (+100% of the fp32 linear weights' memory; ``pack=False``
    runs them in their own layout, slower, at no extra memory). ``quantize="int8"`` (weight-only
    int8 with a scale per 32 input features of a column, +28%), ``"int4"`` (4-bit with a scale and a
    zero point per 32, +19%) or ``"bf16"`` (+50%) makes that copy compact: faster and lossy; the default
    float32 keeps outputs exact. ``"int8-dynamic"`` (+31%) is int8 that also rounds each row's
    activations to int8 per 32 (CPUs with AVX2 or AVX-512; elsewhere plain int8): faster there, lossier;
    ``"int4-dynamic"`` (+19%) is int4 with int8 activations in the same way (elsewhere plain int4). Calling it
    twice with the same settings is a no-op; ``restore_model`` undoes it.
    """
    if options:
        raise TypeError(f"accelerate_model got unknown options: {', '.join(sorted(options))}")
    if _is_fairseq(model):
        return _accelerate_fairseq(model, quantize, pack)
    adapter = ADAPTERS[_model_type(model)]
    patched = getattr(model, PATCHER_ATTR, None)
    if patched is not None:
        if (patched.quantize, patched.pack) != (quantize, pack):
            raise ValueError(f"this model is already accelerated with quantize={patched.quantize!r}, "
                             f"pack={patched.pack}; call lightgen.restore_model(model) before accelerating it with "
                             f"quantize={quantize!r}, pack={pack}")
        return model
    check_precision(model, quantize)
    from lightgen import _build

    _build.load()
    patcher = Patcher(model)
    patcher.quantize, patcher.pack = quantize, pack
    adapter.patch_layers(model, patcher)
    _patch_norms(model, patcher)
    _patch_linears(model, patcher, quantize, pack)
    if adapter.attention_interface:
        lg_attention.register()
        patcher.previous_attn_implementation = model.config._attn_implementation
        model.set_attn_implementation(lg_attention.implementation_for(model.config._attn_implementation))
    decoder, reason = _decoder(adapter, model)
    if decoder is not None:
        patcher.set(model, engine.DECODER_ATTR, decoder)
        patcher.set(model, engine.ACCELERATE_ATTR, accelerate_model)
        patcher.set(model, "generate", types.MethodType(engine.accelerated_generate, model))
        patcher.set(model, "_prepare_cache_for_generation", types.MethodType(engine.deferred_cache_preparation,
                                                                              model))
    elif isinstance(model, GenerationMixin):
        # Never silently off the engine: generate warns (or raises under LIGHTGEN_STRICT=1) and keeps
        # lightgen's own arguments away from HF's loop.
        patcher.set(model, "generate", types.MethodType(functools.partial(engine.unaccelerated_generate,
                                                                          reason=reason), model))
    patcher.set(model, PATCHER_ATTR, patcher)
    return model


def _decoder(adapter: Adapter, model) -> tuple[object | None, str]:
    """The engine's decoder for ``model``, or None and why not."""
    if adapter.decoder is None:
        return None, f"lightgen's engine does not run {adapter.family} models"
    try:
        decoder = adapter.decoder(model)
    except NoEngine as reason:
        return None, str(reason)
    if decoder is None:
        return None, f"lightgen's engine does not run {type(model).__name__} (it runs the family's LM-head models)"
    return decoder, ""


def _is_fairseq(model) -> bool:
    # fairseq is optional: its adapter (and fairseq itself) is imported only for fairseq objects.
    return any(cls.__module__.partition(".")[0] == "fairseq" for cls in type(model).__mro__)


def _accelerate_fairseq(obj, quantize: str | None, pack: bool):
    """A fairseq ``TransformerModel`` or hub interface (``TransformerModel.from_pretrained``)."""
    from lightgen import _build
    from lightgen.adapters import fairseq as fairseq_adapter

    models = fairseq_adapter.models_of(obj)
    if any(getattr(m, PATCHER_ATTR, None) is not None for m in [obj, *models]):
        return obj
    for model in models:
        check_precision(model, quantize)
    _build.load()
    patcher = Patcher(obj)
    patcher.quantize, patcher.pack = quantize, pack
    fairseq_adapter.patch_fairseq(obj, patcher)
    for model in models:
        _patch_linears(model, patcher, quantize, pack)
    for target in {id(m): m for m in [obj, *models]}.values():
        patcher.set(target, PATCHER_ATTR, patcher)
    return obj


def restore_model(model):
    """Undo ``accelerate_model`` exactly; returns the same object."""
    patcher = getattr(model, PATCHER_ATTR, None)
    if patcher is None:
        raise ValueError("restore_model: this model was not accelerated by lightgen")
    patcher.undo()
    return model


def patched_summary(model) -> list[str]:
    patcher = getattr(model, PATCHER_ATTR, None)
    return list(patcher.patched) if patcher else []


# Family modules register themselves on import.
from lightgen.adapters import (  # noqa: E402,F401
    bart, bert, gemma, gpt2, gpt_neox, llama, m2m_100, opt, pegasus, phi3, qwen3, t5,
)
