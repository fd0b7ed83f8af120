"""accelerate_model / restore_model as a user sees them: in place, reversible, explicit."""

import copy
import inspect
import sys

import accelerate
import pytest
import torch
import transformers as tf
from models import BUILDERS, build, forward_logits, padded_batch
from transformers.models.bert.modeling_bert import eager_attention_forward as bert_eager_attention_forward

import lightgen
from lightgen.adapters.base import patched_summary


def test_registry_covers_every_family_we_test():
    assert set(lightgen.ADAPTERS) == set(BUILDERS)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_patch_is_in_place_and_state_dict_is_unchanged(family):
    model = build(family)
    before = model.state_dict()
    assert lightgen.accelerate_model(model) is model
    after = model.state_dict()
    assert list(before) == list(after)
    assert all(before[k].data_ptr() == after[k].data_ptr() for k in before)
    assert patched_summary(model)
    assert "lightgen:" in repr(model)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_restore_is_bit_identical_to_never_patched(family):
    model = build(family, seed=5)
    never_patched = copy.deepcopy(model)
    implementation = model.config._attn_implementation
    ids, mask = padded_batch(family, 3, 11, seed=5)
    lightgen.restore_model(lightgen.accelerate_model(model))
    assert torch.equal(forward_logits(model, family, ids, mask), forward_logits(never_patched, family, ids, mask))
    assert "lightgen" not in repr(model)
    assert model.config._attn_implementation == implementation
    assert all("forward" not in vars(m) and "extra_repr" not in vars(m) for m in model.modules())


def test_accelerating_twice_is_a_no_op_and_restore_needs_a_patch():
    model = build("bart")
    lightgen.accelerate_model(model)
    count = len(patched_summary(model))
    lightgen.accelerate_model(model)
    assert len(patched_summary(model)) == count
    lightgen.restore_model(model)
    with pytest.raises(ValueError, match="was not accelerated"):
        lightgen.restore_model(model)


def test_unsupported_model_lists_supported_families():
    model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=4))
    with pytest.raises(lightgen.UnsupportedModelError, match="model_type 'bloom'.*bart.*llama"):
        lightgen.accelerate_model(model)
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel"):
        lightgen.accelerate_model("facebook/bart-base")
    with pytest.raises(TypeError, match="unknown options: speed"):
        lightgen.accelerate_model(build("gpt2"), speed=11)


def test_attention_runs_through_lightgen(monkeypatch):
    calls = []
    from lightgen.modules import attention as lg_attention

    original = lg_attention.ops.attention
    monkeypatch.setattr(lg_attention.ops, "attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = lightgen.accelerate_model(build("llama"))
    ids, mask = padded_batch("llama", 2, 1)  # one query per row: a decode-shaped call
    forward_logits(model, "llama", ids, mask)
    assert model.config._attn_implementation == "lightgen"
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_eager_softmax_rounding_is_the_familys(family):
    """Where a family's eager attention rounds its softmax is read off its function: in the dtype for the BART
    family, GPT-2, T5 and BERT (which writes ``softmax(attn_weights)``), in float32 for the others (which write
    ``softmax(..., dtype=torch.float32)``)."""
    from lightgen.modules import attention as lg_attention

    model = build(family)
    family_eager = getattr(sys.modules[type(model).__module__], "eager_attention_forward", bert_eager_attention_forward)
    source = inspect.getsource(family_eager)
    assert lg_attention.softmax_in_dtype(model) == ("dtype=torch.float32" not in source)


def test_training_mode_uses_original_forward_and_backprops():
    model = lightgen.accelerate_model(build("bart"))
    model.train()
    ids, mask = padded_batch("bart", 2, 6)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert model.model.encoder.layers[0].fc1.weight.grad is not None


@pytest.mark.parametrize("order", ["hooks_then_patch", "patch_then_hooks"])
def test_accelerate_cpu_offload_hooks_keep_working(order):
    model = build("gpt2", seed=3)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch("gpt2", 2, 6, seed=3)
    if order == "hooks_then_patch":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        lightgen.accelerate_model(model)
    else:
        lightgen.accelerate_model(model)
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    got, expected = forward_logits(model, "gpt2", ids, mask), forward_logits(reference, "gpt2", ids, mask)
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)


def test_forward_with_autograd_on_gives_true_gradients():
    model = lightgen.accelerate_model(build("llama", seed=2))
    reference = copy.deepcopy(lightgen.restore_model(copy.deepcopy(model)))
    ids, _ = padded_batch("llama", 1, 6)
    grads = []
    for m in (model, reference):
        m.zero_grad()
        m(input_ids=ids).logits.sum().backward()
        grads.append(m.model.layers[0].mlp.gate_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_deepcopy_of_accelerated_model_runs_its_own_weights():
    model = lightgen.accelerate_model(build("bart", seed=4))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for param in clone.parameters():
            param.mul_(1.5)
    ids, mask = padded_batch("bart", 2, 6)
    expected = forward_logits(lightgen.restore_model(copy.deepcopy(clone)), "bart", ids, mask)
    torch.testing.assert_close(forward_logits(clone, "bart", ids, mask), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(forward_logits(model, "bart", ids, mask), expected)


def test_dispatch_model_with_disk_offload_keeps_outputs(tmp_path):
    model = build("llama", seed=1)
    reference = copy.deepcopy(model)
    ids, mask = padded_batch("llama", 2, 6)
    lightgen.accelerate_model(model)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    got, expected = forward_logits(model, "llama", ids, mask), forward_logits(reference, "llama", ids, mask)
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    with pytest.warns(RuntimeWarning, match="accelerate hooks"):
        generated = model.generate(**kwargs)
    assert torch.equal(generated, reference.generate(**kwargs))
