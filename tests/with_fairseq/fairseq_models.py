"""Tiny fairseq Transformer models built in code, and fairseq's own generator to compare with."""

from __future__ import annotations

import argparse
import types

import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.sequence_generator import SequenceGenerator

# Symbols besides fairseq's four specials (bos, pad, eos, unk); with few, random models end hypotheses
# early (EOS is 1 of 12).
WORDS = 8


def dictionary() -> Dictionary:
    vocab = Dictionary()
    for index in range(WORDS):
        vocab.add_symbol(f"w{index}")
    return vocab


def build(seed: int = 0, **overrides) -> TransformerModel:
    """A 2+2-layer d64 Transformer with every parameter perturbed (LayerNorms are not identity)."""
    args = argparse.Namespace()
    settings = dict(encoder_layers=2, decoder_layers=2, encoder_embed_dim=64, decoder_embed_dim=64,
                    encoder_ffn_embed_dim=96, decoder_ffn_embed_dim=96, encoder_attention_heads=4,
                    decoder_attention_heads=4, max_source_positions=128, max_target_positions=128)
    settings.update(overrides)
    for name, value in settings.items():
        setattr(args, name, value)
    base_architecture(args)
    vocab = dictionary()
    task = types.SimpleNamespace(source_dictionary=vocab, target_dictionary=vocab)
    torch.manual_seed(seed)
    model = TransformerModel.build_model(args, task).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def source_batch(vocab: Dictionary, batch: int, length: int, seed: int) -> dict:
    """Left-padded sources ending in EOS, as fairseq's translation task collates them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [length] + [int(torch.randint(2, length + 1, (1,), generator=gen)) for _ in range(batch - 1)]
    tokens = torch.full((batch, length), vocab.pad())
    for row, size in enumerate(lengths):
        tokens[row, length - size:-1] = torch.randint(vocab.nspecial, len(vocab), (size - 1,), generator=gen)
        tokens[row, -1] = vocab.eos()
    return {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor(lengths)}}


def generator(models: list, vocab: Dictionary, **settings) -> SequenceGenerator:
    return SequenceGenerator(models, vocab, **settings)


def _reverse(words: list[int]) -> list[int]:
    return words[::-1]


def _edit(words: list[int]) -> list[int]:
    """Copy-heavy, like grammar correction: w1 is doubled (outputs longer than the input), w2 dropped
    (shorter), the rest copied."""
    w1, w2 = dictionary().index("w1"), dictionary().index("w2")
    return [kept for word in words if word != w2 for kept in ([word, word] if word == w1 else [word])]


TASKS = {"reverse": _reverse, "edit": _edit}
COPY_STEPS = 300  # "edit": most short sentences come out right


def train(model, task: str = "reverse", steps: int = 80, seed: int = 0):
    """A few Adam steps on a task over random sentences of 1-8 words (``TASKS``), so that outputs end
    with EOS at varied lengths (random weights rarely emit EOS). Seconds on a 2+2-layer d64 model."""
    vocab, target_of = dictionary(), TASKS[task]
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small run faster on one thread, and much faster on a busy machine
    try:
        for _ in range(steps):
            _train_step(model, optimizer, vocab, target_of, gen)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _train_step(model, optimizer, vocab, target_of, gen) -> None:
    sources = [torch.randint(vocab.nspecial, len(vocab), (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 9, (32,), generator=gen)]
    targets = [target_of(words) + [vocab.eos()] for words in sources]
    src = torch.full((32, max(map(len, sources)) + 1), vocab.pad())
    tgt = torch.full((32, max(map(len, targets))), vocab.pad())
    prev = tgt.clone()
    for row, (words, target) in enumerate(zip(sources, targets, strict=True)):
        src[row, src.shape[1] - len(words) - 1:] = torch.tensor(words + [vocab.eos()])  # left-padded
        tgt[row, : len(target)] = torch.tensor(target)
        prev[row, : len(target)] = torch.tensor([vocab.eos()] + target[:-1])
    logits = model(src, (src != vocab.pad()).sum(1), prev)[0]
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1),
                                             ignore_index=vocab.pad())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
