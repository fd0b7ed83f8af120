"""``accelerate_model`` / ``restore_model`` and the registry of model families."""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

from torch import nn

from lightgen.adapters._patch import Patcher
from lightgen.generation import engine
from lightgen.modules import attention as lg_attention
from lightgen.modules.linear import check_precision, is_conv1d, linear_forward, linear_weights
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
        if kind is not None:
            patcher.replace_forward(module, apply_norm, f"{kind}_norm", name)


def _patch_linears(model: nn.Module, patcher: Patcher, quantize: str | None, pack: bool) -> None:
    """Every nn.Linear and HF Conv1D runs the decode-shaped matmul where it pays."""
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            continue
        weights = linear_weights(module, quantize, pack)
        if weights is not None:
            patcher.set(module, "_lightgen_linear", weights)
            layout = "packed" if weights.source else "in place"
            patcher.replace_forward(module, linear_forward, f"linear {quantize or 'fp32'} {layout}", name)


def accelerate_model(model, *, quantize: str | None = None, pack: bool = True, **options):
    """Patch ``model`` in place to run lightgen's kernels; returns the same object.

    The parameters, buffers and ``state_dict()`` are untouched. Linear layers get a packed copy of
    their weight for decode-shaped matmuls (+100% of the fp32 linear weights' memory; ``pack=False``
    runs them in their own layout, slower, at no extra memory). ``quantize="int8"`` (per-output-
    channel weight-only int8, +25%) or ``"bf16"`` (+50%) makes that copy compact: faster and lossy;
    the default float32 keeps outputs exact. Calling it twice with the same settings is a no-op;
    ``restore_model`` undoes it.
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
        model.set_attn_implementation(lg_attention.IMPLEMENTATION)
    decoder = adapter.decoder(model) if adapter.decoder else None
    if decoder is not None:
        patcher.set(model, engine.DECODER_ATTR, decoder)
        patcher.set(model, "generate", types.MethodType(engine.accelerated_generate, model))
        patcher.set(model, "_prepare_cache_for_generation", types.MethodType(engine.deferred_cache_preparation,
                                                                              model))
    patcher.set(model, PATCHER_ATTR, patcher)
    return model


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
from lightgen.adapters import bart, bert, gpt2, llama, m2m_100, pegasus, t5  # noqa: E402,F401
