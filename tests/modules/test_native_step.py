"""The native decoder step (one C++ call for all layers, lightgen/modules/native_step.py) against the Python step it
replaces, bit for bit, and against unpatched HF, token for token, on tiny models of every family with a decoder
step."""

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from models import BUILDERS, VOCAB, build, padded_batch

import lightgen
from lightgen.modules import native_step
from lightgen.modules.decoder import DECODER_ATTR

# GQA in the first four; Mistral, Qwen2, Phi-3 and Gemma 2/3 with windows shorter than the prompt. GPT-2's fused
# q|k|v (Conv1D), Phi-3's fused q|k|v and gate|up with half-rotary heads, GPT-NeoX's q|k|v per head, partial rotary and
# parallel residual, Gemma's (1 + w) RMSNorm and GeGLU, Gemma 2's output norms and soft-capped scores, Gemma 3's q/k
# norms and a rotary table per layer type.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3", "gpt_neox", "gemma", "gemma2", "gemma3_text")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("LIGHTGEN_DISABLE_EXT") == "1",
                                reason="the native step needs the built kernels (its absence: the last test here)")


def _decoder(model):
    return getattr(model, DECODER_ATTR)


@torch.no_grad()
def _scenario(decoder, native: bool, ids, mask):
    """A left-padded prompt, single-token steps, a beam reorder, a draft verified at all positions, a rollback to
    ragged lengths and a step on them: every step's logits, the filled caches and how many steps ran natively."""
    reason, before = decoder.native_reason, decoder.native_steps
    decoder.native_reason = reason if native else "the test's Python step"
    rows = ids.shape[0]
    state = decoder.start(rows, ids.shape[1] + 12, torch.float32, "cpu", prompt_mask=mask)
    for layer in (*state.cache.keys, *state.cache.values):
        layer.fill_(float("nan"))  # pooled buffers hold the other run's values: a slot one run missed differs
    try:
        logits = [decoder.step(state, ids, (mask.cumsum(-1) - 1).clamp_min(0))]
        for _ in range(3):
            logits.append(decoder.step(state, logits[-1].argmax(-1, keepdim=True)))
        state.reorder(torch.arange(rows).flip(0))
        logits.append(decoder.step(state, logits[-1].argmax(-1, keepdim=True)))
        draft = torch.randint(3, VOCAB, (rows, 3), generator=torch.Generator().manual_seed(1))
        logits.append(decoder.step(state, draft, all_positions=True))
        state.roll_back(torch.arange(rows) % 3)
        logits.append(decoder.step(state, draft[:, :1]))
        # Each row's filled positions (after the rollback the rest holds what the spare buffers held).
        caches = [layer[row, :, :length].clone() for layer in (*state.cache.keys, *state.cache.values)
                  for row, length in enumerate(state.lengths.tolist())]
        return logits, caches, decoder.native_steps - before
    finally:
        state.release()
        decoder.native_reason = reason


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("quantize", "pack"), [(None, True), ("int8", True), ("int4", True), ("bf16", True),
                                                ("int8-dynamic", True), ("int4-dynamic", True), (None, False)],
                         ids=["fp32", "int8", "int4", "bf16", "int8-dynamic", "int4-dynamic", "fp32-in-place"])
@pytest.mark.filterwarnings("ignore:lightgen. quantize='int[48]-dynamic' needs AVX-512 VNNI")
def test_native_step_is_bit_identical_to_the_python_step(family, quantize, pack):
    """Packed weights run each layer's q/k/v and gate/up in one parallel loop (linear_panels); in place, one by one."""
    decoder = _decoder(lightgen.accelerate_model(build(family, seed=4), quantize=quantize, pack=pack))
    assert decoder.native_reason is None
    ids, mask = padded_batch(family, 3, 9, seed=4)
    assert not mask.all()
    python_logits, python_caches, python_native = _scenario(decoder, False, ids, mask)
    native_logits, native_caches, native_steps = _scenario(decoder, True, ids, mask)
    assert (python_native, native_steps) == (0, len(native_logits))
    for step, (got, expected) in enumerate(zip(native_logits, python_logits, strict=True)):
        assert torch.equal(got, expected), f"step {step}: max difference {(got - expected).abs().max()}"
    for got, expected in zip(native_caches, python_caches, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "int8-dynamic", "int4-dynamic"])
@pytest.mark.filterwarnings("ignore:lightgen. quantize='int[48]-dynamic' needs AVX-512 VNNI")
def test_layers_sharing_one_parallel_loop_split_across_threads_as_alone(quantize):
    """Wide enough that linear_panels' two threads split a layer's panels: fp32 q/k/v (4 + 1 + 1 panels) in the
    middle of q, gate/up (4 + 4, 8-column tails) between them; int8 / int4 (coarser tasks) between q and k, or not
    at all. Still the Python step's logits bit for bit."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, intermediate_size=200, max_position_embeddings=64)
    decoder = _decoder(lightgen.accelerate_model(transformers.LlamaForCausalLM(config).eval(), quantize=quantize))
    ids, mask = padded_batch("llama", 3, 9, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        python_logits, _, _ = _scenario(decoder, False, ids, mask)
        native_logits, _, native_steps = _scenario(decoder, True, ids, mask)
    finally:
        torch.set_num_threads(threads)
    assert native_steps == len(native_logits)
    for got, expected in zip(native_logits, python_logits, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_the_native_step_matches_hf(family):
    model = build(family, seed=5)
    reference = copy.deepcopy(model)
    decoder = _decoder(lightgen.accelerate_model(model))
    ids, mask = padded_batch(family, 3, 9, seed=5)
    for settings in (dict(), dict(num_beams=3, num_return_sequences=2), dict(decoding="iad")):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        before = decoder.native_steps
        got = model.generate(**kwargs, **settings)
        assert decoder.native_steps > before, settings
        assert torch.equal(got, reference.generate(**kwargs, **{k: v for k, v in settings.items() if k != "decoding"}))


# Encoder-decoder families (post-norm BART and Marian, pre-norm mBART, M2M-100 and Pegasus: LayerNorm, cross-attention,
# a plain GELU / SiLU FFN; T5 and mT5: RMSNorm, the relative position bias as an additive mask, ReLU or gated GELU,
# attention wider than the model) and OPT (pre-norm LayerNorm, ReLU, queries scaled before the scores).
CROSS_ATTENTION_AND_OPT = ("bart", "mbart", "marian", "m2m_100", "pegasus", "t5", "mt5", "opt")


@pytest.mark.parametrize("family", CROSS_ATTENTION_AND_OPT)
@pytest.mark.parametrize("quantize", [None, "int8", "int8-dynamic", "int4-dynamic"])
@pytest.mark.filterwarnings("ignore:lightgen. quantize='int[48]-dynamic' needs AVX-512 VNNI")
def test_cross_attention_families_and_opt_step_natively_bit_identical(family, quantize):
    """Their logits from generate (greedy with padding, beams reordering rows and the cross-attention's sentences)
    with the native step equal the Python step's bit for bit, and the tokens are unpatched HF's."""
    model = build(family, seed=9)
    reference = copy.deepcopy(model)
    decoder = _decoder(lightgen.accelerate_model(model, quantize=quantize))
    assert decoder.native_reason is None
    ids, mask = padded_batch(family, 3, 9, seed=9)
    for settings in (dict(), dict(num_beams=3, num_return_sequences=2)):
        kwargs = dict(input_ids=ids, attention_mask=mask, min_new_tokens=8, max_new_tokens=8, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, **settings)
        reason, before = decoder.native_reason, decoder.native_steps
        native = model.generate(**kwargs)
        assert decoder.native_steps - before >= 8, settings
        decoder.native_reason = "the test's Python step"
        try:
            python = model.generate(**kwargs)
        finally:
            decoder.native_reason = reason
        assert torch.equal(native.sequences, python.sequences)
        for got, expected in zip(native.logits, python.logits, strict=True):
            assert torch.equal(got, expected), f"{settings}: max difference {(got - expected).abs().max()}"
        if quantize is None:
            assert torch.equal(native.sequences, reference.generate(**kwargs).sequences)


@torch.no_grad()
def test_steps_the_kernels_would_not_take_run_in_python():
    """More rows than the fp32 kernels run (a long prompt: ATen's GEMM runs the Python step's projections) and
    models the kernels do not run at all (bf16 weights: ATen) keep the Python loop."""
    decoder = _decoder(lightgen.accelerate_model(build("llama", seed=6)))
    ids, mask = padded_batch("llama", 3, 90, seed=6)
    state = decoder.start(3, 92, torch.float32, "cpu", prompt_mask=mask)
    try:
        decoder.step(state, ids, (mask.cumsum(-1) - 1).clamp_min(0))
        assert decoder.native_steps == 0  # 270 rows: more than PACKED_MAX_ROWS
        decoder.step(state, ids[:, -1:])
        assert decoder.native_steps == 1
    finally:
        state.release()
    bf16 = lightgen.accelerate_model(build("llama", seed=6, dtype=torch.bfloat16))
    ids, mask = padded_batch("llama", 2, 5, seed=6)
    bf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert _decoder(bf16).native_reason is None and _decoder(bf16).native_steps == 0


def test_every_family_with_a_decoder_step_steps_natively():
    """Each family's tiny model takes the native step (GPT-2, Phi-3, GPT-NeoX, Gemma 1/2/3 and T5 once fell back)."""
    for family in BUILDERS:
        decoder = getattr(lightgen.accelerate_model(build(family)), DECODER_ATTR, None)
        if decoder is not None:
            assert decoder.native_reason is None, (family, decoder.native_reason)


def _config_model(cls, config_cls, **fields):
    torch.manual_seed(0)
    return cls(config_cls(vocab_size=VOCAB, **fields)).eval()


@pytest.mark.parametrize(("model", "why"), [
    (lambda: _config_model(transformers.GPT2LMHeadModel, transformers.GPT2Config, n_embd=32, n_layer=2, n_head=4,
                           n_positions=64, scale_attn_by_inverse_layer_idx=True), "the same attention shape"),
    (lambda: _config_model(transformers.GPT2LMHeadModel, transformers.GPT2Config, n_embd=32, n_layer=2, n_head=4,
                           n_positions=64, activation_function="quick_gelu"), "kernel activation"),
    (lambda: _config_model(transformers.OPTForCausalLM, transformers.OPTConfig, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, ffn_dim=40, max_position_embeddings=64, word_embed_proj_dim=32,
                           layer_norm_elementwise_affine=False), "norm kind"),
], ids=["layer-scaled-attention", "hf-activation", "layer-norm-without-weights"])
def test_blocks_the_native_step_does_not_run_say_why_and_step_in_python(model, why):
    model = model()
    reference = copy.deepcopy(model)
    decoder = _decoder(lightgen.accelerate_model(model))
    assert decoder.native_reason is not None and why in decoder.native_reason, decoder.native_reason
    ids, mask = padded_batch("gpt2", 2, 6, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(**kwargs), reference.generate(**kwargs))
    assert decoder.native_steps == 0


def test_q_k_norms_the_native_step_cannot_run_keep_the_python_step():
    """Its q/k norm slots hold weights only, of the block's norm kind: LayerNorms (biases, even in a LayerNorm block)
    or norms of a kind of their own keep the Python loop."""
    for family in ("qwen3", "opt"):
        spec = _decoder(lightgen.accelerate_model(build(family))).spec
        assert native_step.unsupported(spec) is None
        width = spec.layers[0].self_attn.head_dim
        attn = dataclasses.replace(spec.layers[0].self_attn, q_norm=torch.nn.LayerNorm(width),
                                   k_norm=torch.nn.LayerNorm(width))
        layers = (dataclasses.replace(spec.layers[0], self_attn=attn), *spec.layers[1:])
        assert "q/k RMSNorms" in native_step.unsupported(dataclasses.replace(spec, layers=layers)), family


@torch.no_grad()
def test_the_native_op_names_what_is_wrong_with_its_arguments():
    decoder = _decoder(lightgen.accelerate_model(build("llama", seed=8)))
    plan = native_step.plan(decoder.spec)
    state = decoder.start(2, 6, torch.float32, "cpu")
    hidden = torch.randn(2, 1, decoder.spec.token_embedding.shape[1])
    try:
        tensors, ints = [None] * 66 * 2, [0] * 20 * 2
        with pytest.raises(RuntimeError, match="'weights' must hold 66 tensors per layer"):
            native_step.layer_weights(tensors[:-1], ints)
        with pytest.raises(RuntimeError, match="'layer_ints' must hold 20 values per layer"):
            native_step.layer_weights(tensors, ints[:-1])
        layers = len(decoder.spec.layers)
        with pytest.raises(RuntimeError, match=f"'weights' are {layers + 1} layers' but the caches are {layers}"):
            native_step.run(dataclasses.replace(plan, weights=native_step.layer_weights(
                [None] * 66 * (layers + 1), [0] * 20 * (layers + 1))), state, hidden, [], None)
        with pytest.raises(RuntimeError, match="the caches decode 2 rows but 'hidden' has 3"):
            native_step.run(plan, state, torch.randn(3, 1, hidden.shape[-1]), [], None)
        with pytest.raises(RuntimeError, match="'hidden' must be float32"):
            native_step.run(plan, state, hidden.double(), [], None)
        with pytest.raises(RuntimeError, match="'cos' and 'sin' must be float32 CPU"):  # Llama's rotate whole heads
            cos = torch.ones(1, 1, decoder.spec.layers[0].self_attn.head_dim - 2)
            native_step.run(plan, state, hidden, [(cos, cos)], None)
    finally:
        state.release()


@pytest.mark.slow
def test_without_the_extension_the_python_step_runs():
    code = textwrap.dedent("""
        import copy, torch, lightgen
        from models import build, padded_batch
        from lightgen.modules.decoder import DECODER_ATTR
        model = build("qwen2", seed=7)
        reference = copy.deepcopy(model)
        lightgen.accelerate_model(model)
        ids, mask = padded_batch("qwen2", 2, 7, seed=7)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        decoder = getattr(model, DECODER_ATTR)
        print(torch.equal(model.generate(**kwargs), reference.generate(**kwargs)), decoder.native_steps)
        print(decoder.native_reason)
    """)
    result = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c", code], check=False,
                            capture_output=True, text=True, cwd=ROOT / "tests", timeout=300,
                            env={**os.environ, "LIGHTGEN_DISABLE_EXT": "1",
                                 "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    same_and_steps, reason = result.stdout.splitlines()[:2]
    assert same_and_steps == "True 0" and "LIGHTGEN_DISABLE_EXT=1" in reason, result.stdout
