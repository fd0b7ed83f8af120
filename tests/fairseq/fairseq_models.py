"""Tiny fairseq Transformer models built in code, and fairseq's own generator to compare with."""

from __future__ import annotations

import argparse
import types

import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.sequence_generator import SequenceGenerator

WORDS = 40  # symbols besides fairseq's four specials (bos, pad, eos, unk)


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


def generator(model, vocab: Dictionary, **settings) -> SequenceGenerator:
    return SequenceGenerator([model], vocab, **settings)
