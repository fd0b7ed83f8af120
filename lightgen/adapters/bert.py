"""BERT: post-LN blocks whose residual+LayerNorm live in the *Output submodules."""

from __future__ import annotations

import torch.nn.functional as F

from lightgen import ops
from lightgen.adapters._blocks import patch_matching
from lightgen.adapters.base import Adapter, register_adapter
from lightgen.modules.block import activation_for


def patch_bert(model, patcher) -> None:
    act = activation_for(model.config.hidden_act)

    def output_fast(module, hidden_states, input_tensor):
        norm = module.LayerNorm
        return ops.add_layer_norm(module.dense(hidden_states), input_tensor, norm.weight, norm.bias, norm.eps)[1]

    def intermediate_fast(module, hidden_states):
        dense = module.dense
        return ops.bias_act(F.linear(hidden_states, dense.weight), dense.bias, act)

    # BertSelfOutput and BertOutput share the shape dense -> dropout -> LayerNorm(x + input).
    patch_matching(model, patcher, "BertSelfOutput", output_fast, "fused residual+LayerNorm")
    patch_matching(model, patcher, "BertOutput", output_fast, "fused residual+LayerNorm")
    if act is not None:
        patch_matching(model, patcher, "BertIntermediate", intermediate_fast, f"bias+{act}")


register_adapter(Adapter("bert", patch_bert), "bert")
