"""Train the demo grammar-correction model: ``python -m lightgen.demo.train``.

A small BART learns to undo synthetic errors (``lightgen.demo.noise``) in real English sentences taken
from text every machine here has: the package's shipped corpus ``data/sentences.txt.gz`` (built by
``--build-corpus`` from license texts, Debian package docs and Python docstrings). The BPE tokenizer is
trained on that corpus and saved beside the weights (fp16 safetensors, loaded as fp32).
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import math
import random
import re
import string
import sysconfig
import time
from pathlib import Path

import torch

from lightgen.demo import CORPUS, MODEL_DIR, correct, held_out_pairs, split
from lightgen.demo.noise import Noiser, join, number_pairs, score, words
from lightgen.generation.tokens import pad_rows

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_ALLOWED = re.compile(r"[A-Za-z ,.;'\-]+")


def _texts():
    """Plain English available offline: license texts, Debian package docs, Python docstrings."""
    paths = glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/**/*", recursive=True)
    for path in sorted(paths):
        name = Path(path).name
        if "changelog" in name or not (name == "copyright" or re.search(r"README|NEWS|FAQ|\.txt", name)
                                       or path.startswith("/usr/share/common-licenses")):
            continue
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt", errors="ignore") as file:
                yield file.read()
        except (OSError, EOFError):
            continue
    paths = sysconfig.get_paths()
    for root in (paths["stdlib"], paths["purelib"]):
        for path in sorted(glob.glob(root + "/**/*.py", recursive=True)):
            if "/test" in path:
                continue
            try:
                tree = ast.parse(Path(path).read_text(errors="ignore"))
            except (SyntaxError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield doc


def build_corpus(limit: int, seed: int = 0) -> list[str]:
    """Distinct prose sentences of 6-28 words, letters and simple punctuation only."""
    found = set()
    for text in _texts():
        for sentence in _SENTENCE_END.split(re.sub(r"\s+", " ", text)):
            sentence = sentence.strip()
            if (_ALLOWED.fullmatch(sentence) and 6 <= len(sentence.split()) <= 28 and sentence[0].isupper()
                    and re.search(r"[a-z]{2}\.$", sentence) and ".." not in sentence
                    and join(words(sentence)) == sentence):
                found.add(sentence)
    sentences = sorted(found)
    random.Random(seed).shuffle(sentences)
    return sorted(sentences[:limit])


def train_tokenizer(sentences: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation)))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                             special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=128)


def build_model(arch: str, vocab_size: int, d_model: int, ffn: int, layers: int, heads: int, dropout: float):
    """A BART (post-LN) or mBART (pre-LN: trains stably at a high learning rate with a short warm-up)."""
    import transformers as tf

    config_class, model_class = {"bart": (tf.BartConfig, tf.BartForConditionalGeneration),
                                 "mbart": (tf.MBartConfig, tf.MBartForConditionalGeneration)}[arch]
    # Generation starts from <s>, which the source also starts with: IAD's first draft is the whole source.
    config = config_class(vocab_size=vocab_size, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                           decoder_ffn_dim=ffn, max_position_embeddings=128, dropout=dropout,
                           attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, decoder_start_token_id=0, forced_bos_token_id=None,
                           forced_eos_token_id=None)
    return model_class(config)


def _batches(tokenizer, sources, targets, max_tokens, rng):
    """Length-bucketed batches of about ``max_tokens`` source+target tokens; labels drop the leading <s>."""
    src = tokenizer(sources)["input_ids"]
    tgt = [ids[1:] for ids in tokenizer(targets)["input_ids"]]
    order = sorted(range(len(src)), key=lambda i: (len(src[i]) + len(tgt[i]), rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        longest = max(longest, len(src[i]), len(tgt[i]))
        if current and 2 * longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], max(len(src[i]), len(tgt[i]))
        current.append(i)
    batches.append(current)
    rng.shuffle(batches)
    for batch in batches:
        yield (pad_rows([src[i] for i in batch], 1), pad_rows([tgt[i] for i in batch], -100))


def _decoder_inputs(labels, start_id):
    """Labels shifted right behind the start token (mBART's own shift would start from the last token)."""
    inputs = torch.cat([torch.full_like(labels[:, :1], start_id), labels[:, :-1]], dim=1)
    return inputs.masked_fill(inputs == -100, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightgen.demo.train", description=__doc__)
    parser.add_argument("--build-corpus", action="store_true", help="rebuild data/sentences.txt.gz from this "
                        "machine's texts first (the result depends on the packages installed)")
    parser.add_argument("--corpus-size", type=int, default=40000)
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    parser.add_argument("--init", type=Path, help="continue training the model and tokenizer saved in this folder")
    parser.add_argument("--arch", choices=("bart", "mbart"), default="mbart")
    parser.add_argument("--vocab", type=int, default=3000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=2500, help="source+target tokens per batch")
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (faster on CPUs with AVX512-BF16)")
    parser.add_argument("--eval-sentences", type=int, default=400)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    if args.build_corpus:
        sentences = build_corpus(args.corpus_size, args.seed)
        CORPUS.parent.mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(CORPUS, "wb", compresslevel=9, mtime=0) as file:  # mtime=0: same bytes every build
            file.write(("\n".join(sentences) + "\n").encode())
        print(f"corpus: {len(sentences)} sentences -> {CORPUS}")
    train_sentences, _ = split()
    noiser = Noiser(number_pairs(train_sentences))
    if args.init:
        from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init)
        model = AutoModelForSeq2SeqLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        tokenizer = train_tokenizer(train_sentences, args.vocab)
        model = build_model(args.arch, len(tokenizer), args.d_model, args.ffn, args.layers, args.heads, args.dropout)
    print(f"{len(train_sentences)} training sentences, vocab {len(tokenizer)}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / args.warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(step / args.steps, 1.0)))))
    model.train()
    step, epoch, started, running = 0, 0, time.time(), None
    while step < args.steps:
        sources = [noiser(s, rng) for s in train_sentences]
        for input_ids, labels in _batches(tokenizer, sources, train_sentences, args.max_tokens, rng):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(input_ids=input_ids, attention_mask=input_ids.ne(1), labels=labels,
                             decoder_input_ids=_decoder_inputs(labels, model.config.decoder_start_token_id)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
            step += 1
            if step % 100 == 0:
                print(f"step {step} epoch {epoch} loss {running:.3f} {time.time() - started:.0f}s", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    model.eval()
    sources, references = held_out_pairs(args.eval_sentences)
    print("held-out:", score(sources, correct(model, tokenizer, sources), references))
    model.generation_config.max_length = 128
    args.out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out} after {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
