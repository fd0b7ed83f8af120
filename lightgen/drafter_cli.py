"""``lightgen train-drafter``: distil a GAD drafter for a Hugging Face or fairseq verifier.

An application module (like ``cli``): it may use the demo's defaults and serving's checkpoint loader;
the library (``lightgen.generation.drafting``) never imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from lightgen.generation.drafting import DrafterConfig, NARDrafter, drafter_for, greedy_targets, train_drafter
from lightgen.generation.drafting.training import start_from_embeddings


class _HFVerifier:
    """A Hugging Face model folder as ``train-drafter`` distils from it: seq2seq (sources: the lines) or
    decoder-only (sources: the lines as prompts, in the chat template with ``chat``; targets: the continuations)."""

    def __init__(self, folder: Path, gguf_file: str | None = None, chat: bool = False,
                 max_new_tokens: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

        from lightgen import accelerate_model

        load = dict(gguf_file=gguf_file) if gguf_file else {}
        self.tokenizer = AutoTokenizer.from_pretrained(folder, **load)
        decoder_only = not AutoConfig.from_pretrained(folder, **load).is_encoder_decoder
        if chat and not decoder_only:
            raise ValueError("--chat: the verifier is a seq2seq model; its sources are the lines as they are")
        family = AutoModelForCausalLM if decoder_only else AutoModelForSeq2SeqLM
        self.model = accelerate_model(family.from_pretrained(folder, dtype=torch.float32, **load).eval())
        self.encoder = None if decoder_only else self.model.get_encoder()
        self.chat, self.generate_kwargs = chat, {} if max_new_tokens is None else dict(max_new_tokens=max_new_tokens)
        self.pad_token_id = self.model.config.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def greedy(self, lines: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        if self.chat:
            lines = [self.tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                                        tokenize=False) for line in lines]
            sources = self.tokenizer(lines, add_special_tokens=False)["input_ids"]
        else:
            sources = self.tokenizer(lines)["input_ids"]
        return sources, greedy_targets(self.model, sources, self.pad_token_id, **self.generate_kwargs)

    def new_drafter(self, **sizes) -> NARDrafter:
        return drafter_for(self.model, **sizes)


class _FairseqVerifier:
    """A fairseq translation checkpoint (and its dictionaries) as ``train-drafter`` distils from it."""

    def __init__(self, checkpoint: Path, data_dir: Path | None) -> None:
        from lightgen.generation.fairseq_greedy import encoder_for_drafting
        from lightgen.serving.fairseq_model import load_fairseq_checkpoint

        model, _ = load_fairseq_checkpoint(checkpoint, data_dir)
        self.hub = model.hub
        self.encoder = encoder_for_drafting(self.hub.models[0])
        source, target = self.hub.task.source_dictionary, self.hub.task.target_dictionary
        if source.pad() != target.pad():
            raise ValueError(f"the drafter pads sources and outputs alike: the dictionaries' pad ids differ "
                             f"({source.pad()} and {target.pad()})")

    def greedy(self, lines: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Source ids and [EOS] + the model's greedy hypothesis (by IAD: the same tokens)."""
        sources = [self.hub.encode(line) for line in lines]
        eos = self.hub.task.target_dictionary.eos()
        hypotheses = self.hub.generate(sources, beam=1, lightgen_decoding="iad")
        return [source.tolist() for source in sources], [[eos] + hypos[0]["tokens"].tolist() for hypos in hypotheses]

    def new_drafter(self, **sizes) -> NARDrafter:
        target = self.hub.task.target_dictionary
        sizes.setdefault("d_model", self.hub.models[0].encoder.embed_tokens.embedding_dim)
        drafter = NARDrafter(DrafterConfig(vocab_size=len(target), pad_token_id=target.pad(), **sizes))
        start_from_embeddings(drafter, self.hub.models[0].decoder.embed_tokens.weight)
        return drafter


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightgen train-drafter",
        description="Distil a GAD drafter for a verifier from the verifier's own greedy outputs.")
    parser.add_argument("--verifier", type=Path, help="HF model folder, seq2seq or decoder-only (default: the "
                        "shipped demo model); a decoder-only verifier's drafter encodes the prompt itself")
    parser.add_argument("--gguf-file", help="load the verifier from this GGUF file in --verifier")
    parser.add_argument("--chat", action="store_true", help="decoder-only verifiers: each line is a user message, "
                        "prompted in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, help="decoder-only verifiers: the longest continuation")
    parser.add_argument("--size", type=json.loads, default={}, help="a new drafter's DrafterConfig fields as JSON, "
                        "e.g. '{\"d_model\": 256, \"encoder_layers\": 1}'")
    parser.add_argument("--fairseq-checkpoint", type=Path, help="a fairseq translation checkpoint (.pt) as the "
                        "verifier instead (needs --text and --out; the drafter serves --lightgen-decoding gad)")
    parser.add_argument("--fairseq-data", type=Path, help="its dictionaries (dict.*.txt; default: its folder)")
    parser.add_argument("--text", type=Path, help="source sentences, one per line (default: the demo corpus's "
                        "training sentences with synthetic errors)")
    parser.add_argument("--out", type=Path, help="where to save (default: the demo drafter's folder)")
    parser.add_argument("--init", type=Path, help="continue training the drafter saved in this folder")
    parser.add_argument("--causal-prefix", action="store_true", help="output tokens attend only to earlier ones, so "
                        "drafting caches them (DrafterConfig.causal_prefix); with --init, retrains that drafter so")
    parser.add_argument("--sentences", type=int, default=20000)
    parser.add_argument("--targets", type=Path, help="cache of the source ids and the verifier's greedy outputs "
                        "(JSON): used instead of --text/--sentences if it exists, else written")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.fairseq_checkpoint and args.gguf_file:
        parser.error("--gguf-file loads a Hugging Face verifier, not a fairseq checkpoint")
    if args.fairseq_checkpoint and not (args.text and args.out):
        parser.error("--fairseq-checkpoint needs --text (its source sentences) and --out")
    torch.set_num_threads(args.threads)
    from lightgen.demo import DRAFTER_DIR, MODEL_DIR, split
    from lightgen.demo.noise import Noiser, number_pairs

    verifier = (_FairseqVerifier(args.fairseq_checkpoint, args.fairseq_data) if args.fairseq_checkpoint
                else _HFVerifier(args.verifier or MODEL_DIR, args.gguf_file, args.chat, args.max_new_tokens))
    if args.text:
        lines = [line.strip() for line in args.text.read_text().splitlines() if line.strip()]
    else:
        train, _ = split()
        rng = random.Random(args.seed)
        noiser = Noiser(number_pairs(train))
        lines = [noiser(sentence, rng) for sentence in rng.sample(train, min(args.sentences, len(train)))]
    lines = lines[:args.sentences]
    started = time.time()
    if args.targets and args.targets.is_file():
        cached = json.loads(args.targets.read_text())
        sources, targets = cached["sources"], cached["targets"]
    else:
        sources, targets = verifier.greedy(lines)
        if args.targets:
            args.targets.write_text(json.dumps(dict(sources=sources, targets=targets)))
    print(f"{len(sources)} greedy targets from the verifier in {time.time() - started:.0f}s", flush=True)
    drafter = NARDrafter.from_pretrained(args.init) if args.init else verifier.new_drafter(**args.size)
    if args.causal_prefix:
        drafter.config = dataclasses.replace(drafter.config, causal_prefix=True)
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters", flush=True)
    train_drafter(drafter, sources, targets, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                  seed=args.seed, verifier_encoder=verifier.encoder if drafter.encoder is None else None,
                  log=lambda line: print(line, flush=True))
    out = args.out or DRAFTER_DIR
    drafter.save_pretrained(out)
    print(f"saved to {out} after {time.time() - started:.0f}s")
