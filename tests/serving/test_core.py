"""The serving core, without a server: validation, grouping by settings, answers equal direct generate,
one failing request does not fail its batch-mates. Needs no serving extra."""

import copy

import pytest
import torch

import lightgen
from lightgen.demo import EXAMPLES, held_out_pairs, load_demo_drafter, load_demo_model
from lightgen.serving.core import Generator, Limits

from models import build


@pytest.fixture(scope="module")
def demo():
    reference, tokenizer = load_demo_model()
    accelerated = lightgen.accelerate_model(copy.deepcopy(reference))
    return reference, accelerated, tokenizer


@pytest.fixture
def generator(demo):
    _, accelerated, tokenizer = demo
    return Generator(accelerated, tokenizer, accelerated=True, limits=Limits(max_input_tokens=64, max_new_tokens=60),
                     drafter=load_demo_drafter())


def _direct(model, tokenizer, text, seed=None, **kwargs):
    """What ``model.generate`` gives for this one sentence, cut like the server's answer."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        row = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=60, **kwargs)[0].tolist()[1:]
    return row[:row.index(2) + 1] if 2 in row else row


def test_answers_equal_direct_generate_for_every_decoding(demo, generator):
    reference, accelerated, tokenizer = demo
    sentences = EXAMPLES[:4] + held_out_pairs(2)[0]
    settings = [{}, {"num_beams": 3}, {"decoding": "iad", "max_draft": 8}, {"decoding": "gad"},
                {"decoding": "gad", "max_draft": 4, "beta": 1, "tau": 2.0}]
    requests = [dict(text=text, **extra) for extra in settings for text in sentences]
    answers = generator.generate(requests)
    direct = {(text, beams): _direct(reference, tokenizer, text, num_beams=beams) for text in sentences
              for beams in (1, 3)}
    for request, answer in zip(requests, answers, strict=True):
        expected = direct[request["text"], request.get("num_beams", 1)]  # IAD returns greedy's tokens
        assert answer["output_ids"] == expected, request
        assert answer["text"] == tokenizer.decode(expected, skip_special_tokens=True).strip()
    # One model call per group of equal settings, the whole group at once.
    assert generator.stats()["group_sizes"] == {len(sentences): len(settings)}
    assert generator.stats()["batch_sizes"] == {len(requests): 1}


def test_seeded_sampling_does_not_depend_on_batch_mates(demo, generator):
    _, accelerated, tokenizer = demo
    text = EXAMPLES[0]
    sample = dict(text=text, do_sample=True, top_k=20, temperature=1.5, seed=7)
    alone = generator.generate([sample])[0]
    crowded = generator.generate([dict(sample, text=s) for s in EXAMPLES[1:3]] + [sample, dict(sample, seed=8)])
    assert crowded[2] == alone
    assert alone["output_ids"] == _direct(accelerated, tokenizer, text, seed=7, do_sample=True, top_k=20,
                                          temperature=1.5)


@pytest.mark.parametrize("request_, message", [
    ({"text": "ok", "num_beam": 2}, "unknown setting(s) ['num_beam']"),
    ({"text": "ok", "num_beams": "2"}, "'num_beams' must be an integer, got str"),
    ({"text": "ok", "num_beams": 9}, "'num_beams' must be in [1, 8], got 9"),
    ({"text": "ok", "do_sample": 1}, "'do_sample' must be true or false"),
    ({"text": "ok", "top_k": 5}, "'top_k' needs do_sample=true"),
    ({"text": "ok", "do_sample": True, "top_p": 1.5}, "'top_p' must be in (0.0, 1.0], got 1.5"),
    ({"text": "ok", "do_sample": True, "temperature": 0}, "'temperature' must be in (0.0, 100.0], got 0"),
    ({"text": "ok", "decoding": "beam"}, "'decoding' must be one of 'auto', 'iad', 'gad', got 'beam'"),
    ({"text": "ok", "decoding": "iad", "num_beams": 2}, "decoding='iad' is greedy decoding"),
    ({"text": "ok", "decoding": "gad", "do_sample": True}, "decoding='gad' is greedy decoding"),
    ({"text": "ok", "max_draft": 4}, "'max_draft' needs decoding='iad' or 'gad'"),
    ({"text": "ok", "decoding": "iad", "beta": 2}, "'beta' needs decoding='gad'"),
    ({"text": "ok", "decoding": "gad", "tau": -1}, "'tau' must be in [0.0, 100.0], got -1"),
    ({"text": "ok", "decoding": "gad", "beta": 0}, "'beta' must be in [1, 64], got 0"),
    ({"text": "ok", "max_new_tokens": 61}, "'max_new_tokens' must be in [1, 60], got 61"),
    ({"text": "word " * 80}, "takes at most 64"),
    ({"text": ""}, "'text' must be a non-empty string"),
    ({"text": ["a"]}, "'text' must be a non-empty string"),
    ({"input_ids": [0, 5, 3000]}, "'input_ids' must lie in [0, 3000)"),
    ({"input_ids": [0, True]}, "'input_ids' must be a non-empty list of integers"),
    ({"input_ids": []}, "'input_ids' must be a non-empty list of integers"),
    ({"text": "ok", "input_ids": [0, 2]}, "exactly one of 'text' or 'input_ids'"),
    ({}, "exactly one of 'text' or 'input_ids'"),
    ("text", "a request is an object, got str"),
])
def test_bad_requests_get_an_error_and_their_batch_mates_an_answer(generator, request_, message):
    good = {"text": EXAMPLES[1]}
    answers = generator.generate([good, request_, good])
    assert answers[1] == {"error": answers[1]["error"]} and message in answers[1]["error"]
    assert answers[0] == answers[2] and answers[0]["output_ids"][-1] == 2


def test_a_request_that_fails_inside_generate_fails_alone(demo, generator, monkeypatch):
    _, accelerated, tokenizer = demo
    poison = 2999  # the last id of the vocabulary; in no example's tokens
    assert all(poison not in tokenizer(text)["input_ids"] for text in (EXAMPLES[0], EXAMPLES[2]))
    original = type(accelerated).generate

    def generate(model, *args, **kwargs):
        if (kwargs["input_ids"] == poison).any():
            raise RuntimeError("boom")
        return original(model, *args, **kwargs)

    monkeypatch.setattr(accelerated, "generate", generate.__get__(accelerated))
    answers = generator.generate([{"text": EXAMPLES[0]}, {"input_ids": [0, poison, 2]}, {"text": EXAMPLES[2]}])
    assert answers[1] == {"error": "generation failed: RuntimeError: boom"}
    assert answers[0]["output_ids"] == _direct(accelerated, tokenizer, EXAMPLES[0])
    assert answers[2]["output_ids"] == _direct(accelerated, tokenizer, EXAMPLES[2])


def test_plain_hf_server_refuses_iad_and_gad(demo):
    reference, _, tokenizer = demo
    plain = Generator(reference, tokenizer, accelerated=False, drafter=load_demo_drafter())
    assert plain.generate([{"text": "ok", "decoding": "iad"}, {"text": "ok", "decoding": "gad"}]) == [
        {"error": f"decoding='{decoding}' needs lightgen's engine; this server runs plain HF generate"}
        for decoding in ("iad", "gad")]


def test_a_server_without_a_drafter_refuses_gad(demo):
    _, accelerated, tokenizer = demo
    answer, = Generator(accelerated, tokenizer, accelerated=True).generate([{"text": "ok", "decoding": "gad"}])
    assert answer == {"error": "decoding='gad' needs a drafter; this server has none (lightgen serve --drafter DIR)"}


def test_gad_plus_plus_requests_keep_near_best_tokens(generator):
    """beta > 1 may differ from greedy; the answer is a finished sentence either way."""
    answer, = generator.generate([{"text": EXAMPLES[3], "decoding": "gad", "beta": 3, "tau": 1.0}])
    assert answer["output_ids"][-1] == 2 and answer["text"]


def test_decoder_only_folder_token_ids_in_and_out(tmp_path):
    """A saved GPT-2 without a tokenizer: ids in and out, left-padded prompts, the positions limit."""
    model = build("gpt2")
    model.save_pretrained(tmp_path)
    generator = Generator.load(tmp_path, max_new_tokens=8)
    assert generator.info()["tokenizer"] is False and generator.encoder_decoder is False
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [3, 4, 5]]
    answers = generator.generate([{"input_ids": p} for p in prompts] + [{"text": "hello"},
                                                                        {"input_ids": [3] * 60}])
    for prompt, answer in zip(prompts, answers, strict=False):
        with torch.no_grad():
            row = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = row[0, len(prompt):].tolist()
        expected = expected[:expected.index(2) + 1] if 2 in expected else expected
        assert answer == {"output_ids": expected}
    assert answers[3] == {"error": "this model has no tokenizer: send 'input_ids'"}
    assert "exceed the model's 64 positions" in answers[4]["error"]


def test_serve_command_checks_its_options(capsys):
    from lightgen.cli import main

    for argv, message in [(["--num-replicas", "2", "--max-replicas", "1"], "--max-replicas must be at least"),
                          (["--max-batch-size", "0"], "--max-batch-size must be positive"),
                          (["--backend", "ray", "--export-repository", "x"], "--export-repository is for --backend")]:
        with pytest.raises(SystemExit):
            main(["serve"] + argv)
        assert message in capsys.readouterr().err


def test_exported_triton_repository(tmp_path, monkeypatch):
    """The files a standalone tritonserver loads (run for real in test_servers.py, with the triton extra)."""
    import json

    from lightgen.cli import main
    from lightgen.demo import MODEL_DIR

    monkeypatch.chdir(MODEL_DIR.parent)  # a relative model folder is written as an absolute one
    main(["serve", "model", "--export-repository", str(tmp_path), "--max-batch-size", "12", "--max-delay-ms", "2.5",
          "--max-new-tokens", "40"])
    config = (tmp_path / "lightgen" / "config.pbtxt").read_text()
    assert "max_batch_size: 12" in config and "max_queue_delay_microseconds: 2500" in config
    options = json.loads(json.loads(config.split("string_value: ")[1].rsplit(" }", 2)[0]))
    assert options["max_new_tokens"] == 40 and options["model_dir"] == str(MODEL_DIR)
    assert "TritonPythonModel" in (tmp_path / "lightgen" / "1" / "model.py").read_text()
