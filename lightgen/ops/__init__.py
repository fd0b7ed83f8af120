"""lightgen ops: thin wrappers over ``torch.ops.lightgen.*`` plus their pure-PyTorch references.

Each ``<op>_ref`` is the specification its C++ (and later CUDA) kernels must match; it is also
what runs when a kernel could not be built.
"""

from lightgen.ops import activation, attention as _attention_mod, beam, embedding as _embedding_mod, norm
from lightgen.ops import linear as _linear_mod, sampling
from lightgen.ops.activation import ACTIVATIONS, bias_act, bias_act_ref, gated_act, gated_act_ref
from lightgen.ops.attention import attention, attention_probs, attention_ref, repeat_kv
from lightgen.ops.beam import beam_topk, beam_topk_ref, greedy_tokens, refuses_non_finite
from lightgen.ops.embedding import embedding, embedding_ref
from lightgen.ops.linear import (
    linear,
    linear_grouped,
    linear_grouped_ref,
    linear_int8_dynamic,
    linear_int8_dynamic_ref,
    linear_ref,
)
from lightgen.ops.norm import (
    add_layer_norm,
    add_layer_norm_ref,
    add_rms_norm,
    add_rms_norm_ref,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from lightgen.ops.sampling import sample_tokens, sample_tokens_ref

REFERENCES = {}
FAKES = {}
for _module in (norm, activation, _attention_mod, _embedding_mod, _linear_mod, beam, sampling):
    REFERENCES.update(_module.REFERENCES)
    FAKES.update(_module.FAKES)

__all__ = [
    "ACTIVATIONS",
    "REFERENCES",
    "FAKES",
    "layer_norm",
    "add_layer_norm",
    "rms_norm",
    "add_rms_norm",
    "bias_act",
    "gated_act",
    "attention",
    "attention_probs",
    "repeat_kv",
    "embedding",
    "linear",
    "linear_grouped",
    "linear_int8_dynamic",
    "beam_topk",
    "greedy_tokens",
    "sample_tokens",
    "refuses_non_finite",
    "layer_norm_ref",
    "add_layer_norm_ref",
    "rms_norm_ref",
    "add_rms_norm_ref",
    "bias_act_ref",
    "gated_act_ref",
    "attention_ref",
    "embedding_ref",
    "linear_ref",
    "linear_grouped_ref",
    "linear_int8_dynamic_ref",
    "beam_topk_ref",
    "sample_tokens_ref",
]
