"""Distillation: a drafter for a given verifier, trained on the verifier's own greedy outputs."""

from __future__ import annotations

import math
import random
import time

import torch
from torch import nn

from lightgen.generation.drafting.nar import DrafterConfig, NARDrafter
from lightgen.generation.tokens import pad_rows, padding_mask

IGNORE_INDEX = -100


def greedy_targets(verifier, sources: list[list[int]], pad_token_id: int, batch_size: int = 64,
                   **generate_kwargs) -> list[list[int]]:
    """The verifier's greedy outputs for ``sources``, by IAD (same tokens): what a drafting session shows the
    drafter's decoder. Encoder-decoder verifiers: the decoder sequence, start token to EOS. Decoder-only ones
    (``sources`` are prompts): the continuation after the prompt, up to its first EOS included."""
    decoder_only = not verifier.config.is_encoder_decoder
    eos = _eos_ids(verifier) if decoder_only else set()
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    targets: list[list[int] | None] = [None] * len(sources)
    for begin in range(0, len(order), batch_size):
        chunk = order[begin:begin + batch_size]
        rows = [sources[i] for i in chunk]
        if decoder_only:  # prompts padded on the left, masked by length: their pad id may be a real token
            width = max(map(len, rows))
            input_ids = pad_rows([row[::-1] for row in rows], pad_token_id).flip(1)
            attention_mask = (~padding_mask(rows).flip(1)).long()
        else:
            input_ids = pad_rows(rows, pad_token_id)
            attention_mask = input_ids.ne(pad_token_id)
        with torch.inference_mode():
            out = verifier.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                    num_beams=1, pad_token_id=pad_token_id, decoding="iad", **generate_kwargs)
        for i, row in zip(chunk, out.tolist(), strict=True):
            if decoder_only:
                row = row[width:]
                ends = [place for place, token in enumerate(row) if token in eos]
                row = row[:ends[0] + 1] if ends else row
            else:
                while len(row) > 1 and row[-1] == pad_token_id:
                    row.pop()
            targets[i] = row
    return targets


def _eos_ids(verifier) -> set[int]:
    eos = verifier.generation_config.eos_token_id
    eos = verifier.config.eos_token_id if eos is None else eos
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _training_batch(sources, targets, indices, block, mask_token_id, pad_token_id):
    """Each target cut at a random point: its prefix, then ``block`` masks; labels [rows, block]: what follows."""
    decoder_rows, label_rows = [], []
    for i in indices:
        target = targets[i]
        cut = random.randint(1, len(target) - 1)
        following = target[cut:cut + block]
        decoder_rows.append(target[:cut] + [mask_token_id] * block)
        label_rows.append(following + [IGNORE_INDEX] * (block - len(following)))
    source_rows = [sources[i] for i in indices]
    return (pad_rows(source_rows, pad_token_id), padding_mask(source_rows), pad_rows(decoder_rows, pad_token_id),
            padding_mask(decoder_rows), torch.tensor(label_rows))


def train_drafter(drafter: NARDrafter, sources: list[list[int]], targets: list[list[int]], *, steps: int = 1500,
                  batch_size: int = 64, lr: float = 1e-3, warmup: int = 100, seed: int = 0, log_every: int = 100,
                  verifier_encoder=None, log=print) -> NARDrafter:
    """Teach ``drafter`` to fill 1..max_block_size masks after a random prefix of ``targets``
    (``verifier_encoder``: see ``NARDrafter.encode``)."""
    config = drafter.config
    pairs = [i for i, target in enumerate(targets) if 2 <= len(target) < config.max_positions - config.max_block_size]
    if not pairs:
        raise ValueError("train_drafter: no target has 2 or more tokens")
    random.seed(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(step / max(steps, 1), 1.0)))))
    drafter.train()
    started, running = time.time(), None
    for step in range(1, steps + 1):
        block = random.randint(1, config.max_block_size)
        source, source_pad, target, target_pad, labels = _training_batch(
            sources, targets, random.sample(pairs, min(batch_size, len(pairs))), block, drafter.mask_token_id,
            config.pad_token_id)
        memory = drafter.encode(source, source_pad, verifier_encoder)
        logits = drafter.decode(memory, source_pad, target, target_pad)
        loss = nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % log_every == 0:
            log(f"drafter step {step} loss {running:.3f} {time.time() - started:.0f}s")
    return drafter.eval()


def drafter_for(verifier, **sizes) -> NARDrafter:
    """An untrained drafter shaped for ``verifier``, starting from its token embeddings (see
    ``start_from_embeddings``); for an encoder-decoder verifier it reads the verifier's encoder output unless
    ``encoder_layers`` > 0; a decoder-only verifier's drafter encodes the prompt itself."""
    config = verifier.config
    if config.is_encoder_decoder:
        sizes.setdefault("d_model", config.d_model)
    else:
        sizes.setdefault("encoder_layers", 2)
    pad = config.pad_token_id
    if pad is None:  # decoder-only models often have none; the drafter masks padding by length anyway
        pad = next(iter(sorted(_eos_ids(verifier))), 0)
    drafter = NARDrafter(DrafterConfig(vocab_size=config.vocab_size, pad_token_id=pad, **sizes))
    start_from_embeddings(drafter, verifier.get_input_embeddings().weight,
                          head=not config.is_encoder_decoder and bool(getattr(config, "tie_word_embeddings", False)))
    return drafter


def start_from_embeddings(drafter: NARDrafter, embedding: torch.Tensor, head: bool = False) -> None:
    """The verifier's token embeddings as the drafter's: as they are where the widths match, else projected
    onto their ``d_model`` principal directions (at the same per-element scale). ``head``: the drafter's
    output layer too (for verifiers whose output layer is their embedding)."""
    width = drafter.config.d_model
    table = embedding.detach().float()
    if table.shape[1] != width:
        if table.shape[1] < width:
            return
        _, _, directions = torch.linalg.svd(table - table.mean(0), full_matrices=False)
        projected = table @ directions[:width].T
        table = projected * (table.std() / projected.std())
    with torch.no_grad():
        drafter.tokens.weight[:table.shape[0]] = table
        if head:
            drafter.head.weight[:table.shape[0]] = table
