"""The serving core, without a server: validation, grouping by settings, answers equal direct generate,
one failing request does not fail its batch-mates. Needs no serving extra."""

import copy
import dataclasses
import json

import pytest
import torch

import lightgen
from lightgen.demo import EXAMPLES, held_out_pairs, load_demo_drafter, load_demo_model
from lightgen.serving.core import SETTINGS, Generator, Limits, answer_json, internal_error

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
    ({"text": "ok", "do_sample": True, "temperature": 0}, "'temperature' must be in [0.01, 100.0], got 0"),
    ({"text": "ok", "do_sample": True, "temperature": 1e-300}, "'temperature' must be in [0.01, 100.0], got 1e-300"),
    ({"text": "ok", "num_beams": 10**5000}, "got an integer of 16610 bits"),
    ({"text": "a \ud800"}, "'text' is not valid Unicode: surrogates not allowed (character 2)"),
    ({"text": "é" * 1500}, "'text' is 3000 bytes; this server takes at most 2048 (lightgen serve --max-text-bytes)"),
    ({"text": "x" * 10**6}, "'text' is at least 1000000 bytes; this server takes at most 2048"),
    ({"input_ids": [5] * 10**5}, "input is 100000 tokens; this server takes at most 64"),
    ({"input_ids": [[[5]]]}, "'input_ids' must be a non-empty list of integers"),
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


def test_every_bad_setting_is_reported_at_once(generator):
    (answer,) = generator.generate([{"text": "", "num_beams": 0, "decoding": "beam", "top_k": 5, "colour": 1}])
    assert answer["error"].split("; ") == [
        "'text' must be a non-empty string", f"unknown setting(s) ['colour'] (known: text or input_ids, {', '.join(SETTINGS)})",
        "'top_k' needs do_sample=true",
        "'decoding' must be one of 'auto', 'iad', 'gad', got 'beam'", "'num_beams' must be in [1, 8], got 0"]


class _CountingTokenizer:
    """The demo tokenizer, counting its calls and raising ``raises`` for the text "poison"."""

    def __init__(self, tokenizer, raises=None):
        self.tokenizer, self.raises, self.calls = tokenizer, raises, 0

    def __call__(self, text):
        self.calls += 1
        if text == "poison":
            raise self.raises
        return self.tokenizer(text)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)


def test_limits_refuse_before_tokenizing(generator):
    counting = generator.tokenizer = _CountingTokenizer(generator.tokenizer)
    answers = generator.generate([{"text": "x" * 5000}, {"text": "a \ud800"}, {"text": "ok", "num_beams": 0}])
    assert all("error" in answer for answer in answers) and counting.calls == 0
    # What Ray's route asks before queueing a request for a batch: the same refusals, no tokenizer.
    assert generator.refusal({"text": "a \ud800"}) == answers[1]["error"]
    assert generator.refusal({"text": "ok"}) is None and counting.calls == 0


@pytest.mark.parametrize("error", [TypeError("boom"), RecursionError(), KeyError("k"), MemoryError()])
def test_any_exception_while_reading_a_request_fails_it_alone(demo, generator, error, caplog):
    _, accelerated, tokenizer = demo
    generator.tokenizer = _CountingTokenizer(tokenizer, raises=error)
    with caplog.at_level("ERROR", logger="lightgen.serving"):
        answers = generator.generate([{"text": EXAMPLES[0]}, {"text": "poison"}, {"text": EXAMPLES[2]}])
    assert answers[1] == internal_error() and "Traceback" not in answers[1]["error"]
    assert [answers[0]["output_ids"], answers[2]["output_ids"]] == [
        _direct(accelerated, tokenizer, EXAMPLES[0]), _direct(accelerated, tokenizer, EXAMPLES[2])]
    assert type(error).__name__ in caplog.text  # the traceback is logged server-side


def test_triton_rows_poison_never_fails_their_batch_mates(demo, generator):
    """Triton's JSON rows: nesting past Python's recursion limit (a RecursionError in ``json`` before), past
    what a request needs, rows over the body limit, bytes that are not UTF-8, integers json refuses."""
    _, accelerated, tokenizer = demo
    generator.limits = dataclasses.replace(generator.limits, max_body_bytes=8192)
    good = json.dumps({"text": EXAMPLES[0]}).encode()
    rows = [good, b"[" * 5000, b'{"text": "a", "x": [[[[[1]]]]]}', json.dumps({"text": "a" * 9000}).encode(),
            b'{"text": "\xff\xfe"}', b"\xff\xfe{}", b'{"seed": ' + b"9" * 5000 + b"}", good]
    answers = [json.loads(answer) for answer in answer_json(generator, rows)]
    expected = _direct(accelerated, tokenizer, EXAMPLES[0])
    assert answers[0]["output_ids"] == expected and answers[-1] == answers[0]
    messages = [answer["error"] for answer in answers[1:-1]]
    assert "request JSON nests deeper than 4 levels" in messages[0] and "deeper than 4" in messages[1]
    assert messages[2] == f"request is {len(rows[3])} bytes; this server takes at most 8192 (lightgen serve " \
                          "--max-body-bytes)"
    assert all(m.startswith("request is not JSON") for m in messages[3:]), messages


def test_an_unforeseen_failure_answers_every_row(generator, monkeypatch, caplog):
    monkeypatch.setattr(generator, "_generate_all", lambda requests: 1 / 0)
    with caplog.at_level("ERROR", logger="lightgen.serving"):
        answers = answer_json(generator, [b'{"text": "a"}', b'{"text": "b"}'])
    assert [json.loads(a) for a in answers] == [internal_error()] * 2 and "ZeroDivisionError" in caplog.text


def test_cold_sampling_still_samples(generator):
    (answer,) = generator.generate([{"text": EXAMPLES[0], "do_sample": True, "temperature": 0.01, "seed": 1}])
    assert answer["output_ids"][-1] == 2


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
    assert answer == {"error": "decoding='gad' needs a drafter; this server has none (lightgen serve --drafter DIR or "
                               "--self-drafter int4)"}


def test_a_server_with_a_self_drafter_answers_gad_with_greedys_tokens(demo):
    """``lightgen serve --self-drafter int4``: the loaded model's own int4 copy drafts GAD requests."""
    from lightgen.demo import MODEL_DIR

    reference, _, tokenizer = demo
    generator = Generator.load(MODEL_DIR, self_drafter="int4", max_new_tokens=60)
    assert generator.drafter._lightgen_patcher.quantize == "int4"
    sentences = EXAMPLES[:3]
    answers = generator.generate([{"text": text, "decoding": "gad", "max_draft": 6} for text in sentences])
    assert [a["output_ids"] for a in answers] == [_direct(reference, tokenizer, text) for text in sentences]
    for wrong in (dict(drafter_dir=MODEL_DIR), dict(accelerate=False)):
        with pytest.raises(ValueError, match="self-drafter"):
            Generator.load(MODEL_DIR, self_drafter="int4", **wrong)


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
                          (["--max-body-bytes", "0", "--drain-timeout", "-1"],  # all at once
                           "--max-body-bytes must be positive; --drain-timeout must be positive"),
                          (["--backend", "ray", "--export-repository", "x"], "--export-repository is for --backend"),
                          (["--self-drafter", "int4", "--no-accelerate"], "--self-drafter takes neither")]:
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
