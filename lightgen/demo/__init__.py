"""The demo grammar-correction model shipped with lightgen, its corpus and its held-out set.

``load_demo_model()`` returns a small BART (trained by ``python -m lightgen.demo.train``) and its
tokenizer, from files inside the package: nothing is downloaded.
"""

from __future__ import annotations

import functools
import gzip
import random
import zlib
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
DRAFTER_DIR = Path(__file__).resolve().parent / "drafter"  # its GAD drafter: lightgen train-drafter
CORPUS = Path(__file__).resolve().parent / "data" / "sentences.txt.gz"
HELD_OUT_EVERY = 40  # one sentence in 40 (by a hash of its text) never reaches training

# Real sentences with real mistakes, for the demo's first lines.
EXAMPLES = [
    "This function return the number of element in the the list.",
    "The file is closed when a object is deleted.",
    "Raise an exception if the the value is not valid.",
    "Return true if the path exist and is a directory.",
    "The default value are used when no argument is given.",
    "This method is called by the server for each request.",
]


@functools.lru_cache(maxsize=1)
def split() -> tuple[list[str], list[str]]:
    """The shipped corpus as (training sentences, held-out sentences)."""
    with gzip.open(CORPUS, "rt") as file:
        sentences = file.read().splitlines()
    # Held-out order by hash too, so that any prefix of it is a sample, not one letter of the alphabet.
    held = sorted((s for s in sentences if zlib.crc32(s.encode()) % HELD_OUT_EVERY == 0),
                  key=lambda s: zlib.crc32(s[::-1].encode()))
    train = [s for s in sentences if zlib.crc32(s.encode()) % HELD_OUT_EVERY != 0]
    return train, held


def held_out_pairs(count: int | None = None, seed: int = 1) -> tuple[list[str], list[str]]:
    """(corrupted sources, clean references) for the first ``count`` held-out sentences, reproducibly."""
    from lightgen.demo.noise import Noiser, number_pairs

    train, held = split()
    noiser, rng = Noiser(number_pairs(train)), random.Random(seed)
    references = held[:count]
    return [noiser(s, rng) for s in references], references


def generate_ids(model, tokenizer, sentences: list[str], batch_size: int = 32, **generate_kwargs) -> list[list[int]]:
    """Generated token ids per sentence (greedy unless ``generate_kwargs`` say otherwise), special tokens
    dropped, in input order; batches group sentences of similar length to keep padding low."""
    import torch

    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    special = set(tokenizer.all_special_ids)  # a property that rebuilds its list on every access
    out = [None] * len(sentences)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        enc = tokenizer([sentences[i] for i in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=False, max_length=128, **generate_kwargs)
        for i, row in zip(chunk, ids.tolist(), strict=True):
            out[i] = [token for token in row if token not in special]
    return out


def correct(model, tokenizer, sentences: list[str], batch_size: int = 32, **generate_kwargs) -> list[str]:
    """The model's corrections of ``sentences`` as text."""
    return [tokenizer.decode(ids).strip() for ids in generate_ids(model, tokenizer, sentences, batch_size,
                                                                  **generate_kwargs)]


def load_demo_model(dtype=None):
    """The shipped demo model (a BART-family seq2seq model, eval mode, fp32 unless ``dtype``) and its tokenizer."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

    if not (MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"lightgen demo model not found in {MODEL_DIR}; train it with "
                                "`python -m lightgen.demo.train`")
    # The weights are stored in fp16 to keep the package small; compute in fp32 by default.
    model = AutoModelForSeq2SeqLM.from_pretrained(MODEL_DIR, dtype=dtype or torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(MODEL_DIR)
    return model, tokenizer


def load_demo_drafter():
    """The shipped demo model's GAD drafter (a ``NARDrafter``, fp32, eval mode)."""
    from lightgen.generation.drafting import NARDrafter

    return NARDrafter.from_pretrained(DRAFTER_DIR)
