"""NAR drafters for decoder-only verifiers: distilled from the verifier's continuations, which are exactly what
a GAD session shows the drafter's decoder (the drafter's own encoder reads the prompt)."""

import copy
import dataclasses
import json

import pytest
import torch
from models import VOCAB, build

import lightgen
from lightgen.generation.drafting import NARDrafter, drafter_for, greedy_targets, train_drafter
from lightgen.generation.drafting.training import start_from_embeddings

SIZES = dict(d_model=16, heads=2, ffn_dim=32, encoder_layers=1, decoder_layers=1, max_positions=64, max_block_size=6)
# Prompts of different lengths; one holds the pad id (0) as a real token, as chat prompts hold SmolLM2's.
PROMPTS = [[5, 6, 7, 8, 9], [10, 0, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20]]


def _verifier(family, seed=3):
    model = build(family, seed=seed)
    model.generation_config.forced_eos_token_id = None
    return lightgen.accelerate_model(model)


def _alone(verifier, prompt, new_tokens):
    """The verifier's greedy continuation of one unpadded prompt."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])  # the mask says the pad id inside it is a token
        out = verifier.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_targets_are_each_prompts_continuation_up_to_its_first_eos(family):
    verifier = _verifier(family)
    alone = [_alone(verifier, prompt, 10) for prompt in PROMPTS]
    verifier.generation_config.eos_token_id = alone[0][3]  # a token greedy emits: row 0 ends there, maybe others
    targets = greedy_targets(verifier, PROMPTS, pad_token_id=0, batch_size=3, max_new_tokens=10)
    for prompt, target in zip(PROMPTS, targets, strict=True):
        expected = _alone(verifier, prompt, 10)
        assert target == expected, (prompt, target, expected)
    assert targets[0] == alone[0][:alone[0].index(alone[0][3]) + 1]


class _SeenByDecoder:
    """Wraps ``NARDrafter.decode`` (the module path) to record each row's tokens before its mask tokens."""

    def __init__(self, drafter):
        self.drafter, self.decode, self.seen = drafter, drafter.decode, []

    def __call__(self, memory, source_pad, target, target_pad):
        for row, pad in zip(target.tolist(), target_pad.tolist(), strict=True):
            real = [token for token, is_pad in zip(row, pad, strict=True) if not is_pad]
            self.seen.append(real[:real.index(self.drafter.mask_token_id)])
        return self.decode(memory, source_pad, target, target_pad)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_decoder_only_session_shows_the_drafter_the_continuation_only(family, monkeypatch):
    """Not the left-padded prompt the verifier's sequences start with: what greedy_targets trains on."""
    verifier = _verifier(family)
    drafter = drafter_for(verifier, **SIZES).eval()
    monkeypatch.setattr(NARDrafter, "drafting_layers", lambda self: None)
    spy = _SeenByDecoder(drafter)
    drafter.decode = spy
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.inference_mode():
        out = verifier.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                pad_token_id=0, decoding="gad", drafter=drafter, block_size=4)
    continuations = [row[width:] for row in out.tolist()]
    assert spy.seen and all(spy.seen)
    for seen in spy.seen:
        assert any(seen == row[:len(seen)] for row in continuations), seen


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_distilled_drafter_for_a_decoder_only_verifier(family, tmp_path, flat_pass_cost):
    """A few training steps on the verifier's own continuations: right shapes, GAD still greedy's tokens at batch 1
    and 4, more tokens per pass than the untrained drafter, and the same drafts after a save/load round trip."""
    verifier = _verifier(family)
    gen = torch.Generator().manual_seed(5)
    sources = [torch.randint(3, VOCAB, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(96)]
    targets = greedy_targets(verifier, sources, pad_token_id=0, batch_size=32, max_new_tokens=16)
    assert all(1 <= len(target) <= 16 for target in targets)
    untrained = drafter_for(verifier, **SIZES)
    trained = train_drafter(copy.deepcopy(untrained), sources, targets, steps=150, batch_size=32, lr=3e-3, warmup=10,
                            log=lambda line: None)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)

    def tokens_per_pass(drafter, rows):
        out = verifier.generate(input_ids=ids[rows], attention_mask=mask[rows], **kwargs, decoding="gad",
                                drafter=drafter, block_size=4, return_dict_in_generate=True)
        return out.sequences, sum(int(r.sum()) for r in out.tokens_per_iteration) / int(out.iterations.sum())

    with torch.inference_mode():
        expected = verifier.generate(input_ids=ids, attention_mask=mask, **kwargs)
        for rows in ([0], [1], list(range(len(PROMPTS)))):
            got, _ = tokens_per_pass(trained, rows)
            assert torch.equal(got, expected[rows][:, :got.shape[1]]) and not expected[rows][:, got.shape[1]:].ne(
                0).any()
        _, before = tokens_per_pass(untrained, list(range(len(PROMPTS))))
        _, after = tokens_per_pass(trained, list(range(len(PROMPTS))))
    assert after > before, (before, after)
    trained.save_pretrained(tmp_path)
    loaded = NARDrafter.from_pretrained(tmp_path)
    assert loaded.config == trained.config
    sessions = [d.start(sources[:4], max_length=64, prompt_width=0) for d in (trained.half().float(), loaded)]
    outputs = [target[:2] for target in targets[:4]]
    assert sessions[0].draft([0, 1, 2, 3], outputs, [4] * 4) == sessions[1].draft([0, 1, 2, 3], outputs, [4] * 4)


def test_embeddings_of_another_width_start_from_their_principal_directions():
    verifier = build("gpt2", seed=2)  # 32 wide, its head tied to its embeddings
    table = verifier.get_input_embeddings().weight.detach()
    drafter = drafter_for(verifier, **SIZES)
    projected = drafter.tokens.weight[:VOCAB].detach()
    # Inner products (centred) are the best rank-16 approximation of the verifier's, up to one scale.
    centred = table - table.mean(0)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    best = (u[:, :16] * s[:16]) @ (u[:, :16] * s[:16]).T
    got = (projected - projected.mean(0)) @ (projected - projected.mean(0)).T
    scale = (got * best).sum() / (best * best).sum()
    assert torch.allclose(got, scale * best, atol=1e-4 * float(best.abs().max()) * float(scale))
    assert torch.isclose(projected.std(), table.std(), rtol=1e-4)
    assert torch.equal(drafter.head.weight[:VOCAB].detach(), projected)
    wider = NARDrafter(dataclasses.replace(drafter.config, d_model=64))
    before = wider.tokens.weight.detach().clone()
    start_from_embeddings(wider, table)  # narrower than the drafter: left as initialised
    assert torch.equal(wider.tokens.weight, before)


def _word_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>")
    tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} <eos> {% endfor %}"
                               "{% if add_generation_prompt %}w4 {% endif %}")
    return tokenizer


def test_train_drafter_command_distils_for_a_decoder_only_verifier(tmp_path):
    """``lightgen train-drafter --chat`` on a decoder-only HF folder: lines as chat prompts, the saved drafter
    sized by ``--size`` and drafting for GAD with greedy's tokens."""
    from lightgen.cli import main

    verifier = build("gpt2", seed=4)
    tokenizer = _word_tokenizer()
    verifier.save_pretrained(tmp_path / "verifier")
    tokenizer.save_pretrained(tmp_path / "verifier")
    gen = torch.Generator().manual_seed(6)
    lines = [" ".join(f"w{int(t)}" for t in torch.randint(5, VOCAB, (6,), generator=gen)) for _ in range(12)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    main(["train-drafter", "--verifier", str(tmp_path / "verifier"), "--text", str(tmp_path / "lines.txt"),
          "--chat", "--max-new-tokens", "8", "--steps", "3", "--batch-size", "4", "--out", str(tmp_path / "drafter"),
          "--targets", str(tmp_path / "targets.json"), "--size", json.dumps(SIZES)])
    drafter = NARDrafter.from_pretrained(tmp_path / "drafter")
    assert dataclasses.asdict(drafter.config) == {**dataclasses.asdict(drafter.config), **SIZES}
    cached = json.loads((tmp_path / "targets.json").read_text())
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": lines[0]}], add_generation_prompt=True,
                                           tokenize=False)
    assert cached["sources"][0] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert cached["sources"][0][-1] == 4 and 2 in cached["sources"][0]  # the template's eos is a prompt token
    accelerated = lightgen.accelerate_model(verifier)
    ids = torch.tensor(cached["sources"][:1])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():
        expected = accelerated.generate(**kwargs)
        assert torch.equal(accelerated.generate(**kwargs, decoding="gad", drafter=drafter), expected)
    assert cached["targets"][0] == expected[0, ids.shape[1]:].tolist()[:len(cached["targets"][0])]
