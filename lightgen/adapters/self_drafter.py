"""``self_drafter``: a GAD drafter that is the verifier itself with compact linear weights (the session that drafts
with it on the verifier's cache: lightgen/generation/drafting/self_drafter.py)."""

from __future__ import annotations

import copy
import weakref

from lightgen.adapters.base import PATCHER_ATTR, accelerate_model, restore_model
from lightgen.generation.drafting.self_drafter import VERIFIER_ATTR
from lightgen.modules.decoder import DECODER_ATTR


def self_drafter(model, quantize: str = "int4"):
    """A drafter for ``model.generate(..., decoding="gad", drafter=...)``: ``model`` with its linear layers in
    ``quantize`` ("int4", "int4-dynamic", "int8", "int8-dynamic" or "bf16"), its parameters and buffers shared
    (the extra memory is the compact copies only). ``model`` may be accelerated already or not; it is left as it
    was (an accelerated one is restored for the copy and accelerated again with its own settings, its packed
    weights made anew: ~3 s on SmolLM2-135M). The verifier decides every token, so with ``beta=1`` the output is
    greedy's."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"self_drafter: needs a Hugging Face model, got {type(model).__name__}")
    if quantize is None:
        raise ValueError("self_drafter: quantize must name a compact precision; a float32 copy of the verifier "
                         "would read as many bytes as the verifier and save nothing")
    patcher = getattr(model, PATCHER_ATTR, None)
    if patcher is not None:  # copy the model as the user gave it, not lightgen's patches and packed copies
        restore_model(model)
    try:
        shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
        drafter = copy.deepcopy(model, memo=shared)
    finally:
        if patcher is not None:
            accelerate_model(model, quantize=patcher.quantize, pack=patcher.pack)
    accelerate_model(drafter, quantize=quantize)
    if not hasattr(drafter, DECODER_ATTR):
        raise ValueError(f"self_drafter: lightgen's engine does not run {type(model).__name__}")
    object.__setattr__(drafter, VERIFIER_ATTR, weakref.ref(model))
    return drafter
