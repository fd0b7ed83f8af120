"""GAD where the verifier is much larger than its drafter: SmolLM2-135M-Instruct (30 layers) with a distilled drafter
and with self-drafters (the verifier's own int4 / int4-dynamic copy, ``lightgen.drafting.self_drafter``).

    python benchmarks/gad_llm.py --distil [--drafter /tmp/smollm2-drafter]   # build the drafter (about 45 min)
    python benchmarks/gad_llm.py [--quick] [--drafter DIR] [--out benchmarks/results]

``--distil``: chat questions and rewrite-this-text requests made from the demo corpus's training sentences
(real English from the machine's own files: license texts, Debian docs, Python docstrings) and a list of
everyday topics, in SmolLM2's chat template; the verifier's own greedy continuations (by IAD, batched) as
targets, cached as JSON beside the drafter; then ``train_drafter`` on a small ``NARDrafter`` (its own encoder
over the prompt, embeddings projected from SmolLM2's). The benchmark: on the held-out chat and rewrite
prompts of ``benchmarks/generate.py`` (none of them in the training prompts), lightgen greedy, IAD, GAD
(beta=1) with each self-drafter, and, where the ``--drafter`` folder holds the distilled drafter, GAD and GAD++ with
it, batch 1 and 8, side by side in one run: ms per call, the ratio to lightgen greedy, tokens per decoder pass,
and the share of rows identical to greedy (lightgen greedy, IAD and every GAD must match the unpatched model's
greedy: the run stops otherwise). Writes <out>/gad_llm.json and (with matplotlib) <out>/gad_llm.png.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import time
import warnings
from pathlib import Path

import torch

import lightgen
from lightgen.adapters.self_drafter import self_drafter
from lightgen.generation.drafting import NARDrafter, drafter_for, greedy_targets, train_drafter
from lightgen.machine import busy

from _common import (ContentionMeter, Sampling, format_speedup, hardware_title, machine_lines, measure, start_run,
                     write_results)
from generate import CHAT_QUESTIONS, REWRITE_TEXTS, load_smollm2, smollm2_missing

DEFAULT_DRAFTER = Path("/tmp/smollm2-drafter")
NEW_TOKENS = 64  # as generate.py's IAD cases
BLOCK_SIZE = 8
GAD_PP = dict(beta=3, tau=1.5)
# Drafter: d 256 (SmolLM2's 576-wide embeddings projected onto their principal directions), one encoder layer
# over the prompt (once per call), two bidirectional decoder layers; int8 drafting. Its LM head (49k x 256, a
# quarter of the bytes in int8) is the largest part of a draft, about 2% of a verifier step's weights.
DRAFTER_SIZES = dict(d_model=256, heads=4, ffn_dim=768, encoder_layers=1, decoder_layers=2, max_block_size=12)
EVERYDAY_TOPICS = (
    "the ocean", "coffee", "regular exercise", "the moon", "rain forests", "volcanoes", "honey bees", "the internet",
    "electric cars", "recycling", "chess", "the Roman empire", "photosynthesis", "gravity", "the human heart",
    "vaccines", "clouds", "earthquakes", "friendship", "learning to cook", "saving money", "public libraries",
    "the piano", "football", "solar panels", "deserts", "penguins", "the printing press", "bread", "tea",
    "computers", "smartphones", "airplanes", "trains", "bicycles", "the brain", "sleep", "dreams", "music",
    "painting", "poetry", "the stars", "Mars", "dinosaurs", "whales", "forests", "rivers", "mountains", "snow",
    "summer holidays", "gardening", "cats", "dogs", "birds", "time management", "writing an essay",
    "public speaking", "learning a language", "the water cycle", "electricity", "magnets", "rainbows", "tides",
    "the seasons", "healthy eating", "meditation", "running a marathon", "camping", "cheese", "chocolate",
    "the Olympic games", "ancient Egypt", "the pyramids", "democracy", "taxes", "banks", "cities", "farming",
    "climate change", "plastic pollution", "the immune system", "bones", "teeth", "the eye", "light", "sound",
)
CHAT_FORMS = ("What is {}?", "Explain {} in two sentences.", "Give me three tips about {}.", "Write a haiku about {}.",
              "Why is {} important?", "How does {} work?", "Write a short story about {}.",
              "Describe {} to a child.", "Tell me an interesting fact about {}.", "Write a short poem about {}.")
REWRITE_FORMS = ("Rewrite this text with its grammar corrected, and nothing else:\n\n{}",
                 "Rewrite this text in simpler words:\n\n{}", "Summarize this text in one sentence:\n\n{}",
                 "Explain this text: {}")
HELD_OUT = {text.lower().rstrip("?.") for text in CHAT_QUESTIONS}


def distillation_requests(count: int, seed: int = 0) -> list[str]:
    """``count`` user messages: half chat questions (everyday topics and words of the corpus), half rewrite
    requests over training sentences (the grammar-correction ones with the demo's synthetic errors)."""
    from lightgen.demo import split
    from lightgen.demo.noise import Noiser, number_pairs

    rng = random.Random(seed)
    train, _ = split()
    noiser = Noiser(number_pairs(train))
    chat = [form.format(topic) for form in CHAT_FORMS for topic in EVERYDAY_TOPICS]
    chat = [text for text in chat if text.lower().rstrip("?.") not in HELD_OUT]
    sentences = [s for s in train if 40 <= len(s) <= 240]
    requests = rng.sample(chat, min(len(chat), count // 2))
    for _ in range(count - len(requests)):
        form, sentence = rng.choice(REWRITE_FORMS), rng.choice(sentences)
        requests.append(form.format(noiser(sentence, rng) if form == REWRITE_FORMS[0] else sentence))
    rng.shuffle(requests)
    return requests


def chat_prompt_ids(tokenizer, requests: list[str]) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False) for text in requests]
    return tokenizer(chats, add_special_tokens=False)["input_ids"]


def distil(out: Path, prompts: int, steps: int, batch_size: int, lr: float) -> None:
    """Targets by batched IAD (cached in ``out/targets.json``), then the drafter, saved to ``out``."""
    model, tokenizer = load_smollm2()
    verifier = lightgen.accelerate_model(model.eval())
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "targets.json"
    started = time.time()
    if cache.is_file():
        cached = json.loads(cache.read_text())
        sources, targets = cached["sources"], cached["targets"]
    else:
        sources = chat_prompt_ids(tokenizer, distillation_requests(prompts))
        targets = greedy_targets(verifier, sources, tokenizer.pad_token_id, batch_size=32,
                                 max_new_tokens=NEW_TOKENS)
        cache.write_text(json.dumps(dict(sources=sources, targets=targets)))
    print(f"{len(sources)} targets ({sum(map(len, targets))} tokens) in {time.time() - started:.0f}s", flush=True)
    drafter = (NARDrafter.from_pretrained(out) if (out / "drafter_config.json").is_file()
               else drafter_for(verifier, **DRAFTER_SIZES))
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters", flush=True)
    train_drafter(drafter, sources, targets, steps=steps, batch_size=batch_size, lr=lr, warmup=50, log_every=50,
                  log=lambda line: print(line, flush=True))
    drafter.save_pretrained(out)
    print(f"saved to {out} after {time.time() - started:.0f}s", flush=True)


@dataclasses.dataclass(frozen=True)
class Settings(Sampling):
    batch_sizes: tuple[int, ...]


# One call answers every prompt of a kind (seconds), so a sample is a single call.
# The outputs are checked first (untimed): that call is the warm-up.
FULL = Settings(samples=3, min_sample_s=0.0, max_measure_s=60.0, min_samples=3, warmup_calls=0, batch_sizes=(1, 8))
QUICK = Settings(samples=2, min_sample_s=0.0, max_measure_s=10.0, min_samples=2, warmup_calls=0, batch_sizes=(1, 8))
GREEDY, IAD, GAD, GAD_PLUS = "lightgen greedy", "lightgen IAD", "lightgen GAD", "lightgen GAD++"
# The verifier's own compact copies as drafters, drafting on its cache.
SELF_DRAFTERS = ("int4", "int4-dynamic")
SELF_GAD = {precision: f"lightgen GAD, {precision} self-drafter" for precision in SELF_DRAFTERS}
GREEDY_EXACT = (IAD, GAD, *SELF_GAD.values())  # these must return greedy's tokens; GAD++ reports how often it does


def held_out_requests() -> dict[str, list[str]]:
    return {"chat": list(CHAT_QUESTIONS),
            "rewrite": [f"Rewrite this text with its grammar corrected, and nothing else:\n\n{text}"
                        for text in REWRITE_TEXTS]}


def provider_kwargs(drafter: NARDrafter | None, self_drafters: dict) -> dict[str, dict]:
    chosen = {GREEDY: {}, IAD: dict(decoding="iad")}
    chosen.update({SELF_GAD[precision]: dict(decoding="gad", drafter=model, block_size=BLOCK_SIZE)
                   for precision, model in self_drafters.items()})
    if drafter is not None:
        chosen.update({GAD: dict(decoding="gad", drafter=drafter, block_size=BLOCK_SIZE),
                       GAD_PLUS: dict(decoding="gad", drafter=drafter, block_size=BLOCK_SIZE, **GAD_PP)})
    return chosen


def answer(model, tokenizer, requests: list[str], batch: int, **kwargs) -> tuple[list[list[int]], float]:
    """Each request's new tokens (up to its first EOS) and the tokens per decoder pass over all rows."""
    rows, tokens, passes = [], 0, 0
    ids = chat_prompt_ids(tokenizer, requests)
    for begin in range(0, len(ids), batch):
        chunk = ids[begin:begin + batch]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in chunk])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 do_sample=False, num_beams=1, pad_token_id=tokenizer.pad_token_id,
                                 return_dict_in_generate=True, **kwargs)
        for row in out.sequences[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token == tokenizer.eos_token_id]
            rows.append(row[:ends[0] + 1] if ends else row)
        if "decoding" in kwargs:
            tokens += sum(int(row.sum()) for row in out.tokens_per_iteration)
            passes += int(out.iterations.sum())
    return rows, (tokens / passes if passes else None)


def draft_ms(drafter, tokenizer, requests: list[str], batch: int, settings: Settings) -> float:
    """One draft of BLOCK_SIZE tokens for ``batch`` rows, 32 tokens into their answers (the session started once)."""
    sources = chat_prompt_ids(tokenizer, requests[:batch])
    session = drafter.start(sources, max_length=256)
    outputs = [list(range(100, 132)) for _ in sources]
    timing = measure({"draft": lambda: session.draft(list(range(len(sources))), outputs, [BLOCK_SIZE] * len(sources))},
                     dataclasses.replace(settings, min_sample_s=0.2, warmup_calls=3, samples=5, min_samples=5))
    return timing["draft"].median_us / 1e3


def draw(plt, payload):
    fig, ax = plt.subplots(figsize=(8, 4))
    cases = list(payload["cases"])
    names = list(payload["cases"][cases[0]]["vs_greedy"])
    width = 0.8 / len(names)
    for offset, name in enumerate(names):
        xs = [i + (offset - (len(names) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, [payload["cases"][case]["vs_greedy"][name] for case in cases], width, label=name)
    ax.set_xticks(range(len(cases)), cases)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speed vs lightgen greedy (×, wall time)")
    ax.set_title(f"SmolLM2-135M-Instruct, GAD block {BLOCK_SIZE}"
                 + ("" if payload["quiet"] else " (machine under load)"), fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(hardware_title(payload["environment"]), fontsize=9)
    return fig


def options(parser) -> None:
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER,
                        help="the distilled drafter's folder (without one: the self-drafters only)")
    parser.add_argument("--distil", action="store_true", help="distil the drafter into --drafter instead")
    parser.add_argument("--prompts", type=int, default=1536, help="--distil: training prompts")
    parser.add_argument("--steps", type=int, default=1000, help="--distil: training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="--distil: rows per training step")
    parser.add_argument("--lr", type=float, default=2e-3, help="--distil: peak learning rate")


def main(argv: list[str] | None = None) -> None:
    args, env = start_run(__doc__, "gad_llm", "fewer samples", argv, options)
    missing = smollm2_missing()
    if missing:
        sys.exit(f"SmolLM2 is not available: {missing}")
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.distil:
        distil(args.drafter, args.prompts, args.steps, args.batch_size, args.lr)
        return
    settings = QUICK if args.quick else FULL
    model, tokenizer = load_smollm2()
    accelerated = lightgen.accelerate_model(copy.deepcopy(model).eval())
    self_drafters = {precision: self_drafter(accelerated, precision) for precision in SELF_DRAFTERS}
    drafter = NARDrafter.from_pretrained(args.drafter) if (args.drafter / "drafter_config.json").is_file() else None
    if drafter is None:
        print(f"no distilled drafter in {args.drafter}: GAD with the self-drafters only", file=sys.stderr)
    meter = ContentionMeter()
    cases = {}
    for kind, requests in held_out_requests().items():
        for batch in settings.batch_sizes:
            label = f"{kind} batch {batch}"
            print(f"{label}...", file=sys.stderr, flush=True)
            chosen = provider_kwargs(drafter, self_drafters)
            results = {name: answer(accelerated, tokenizer, requests, batch, **kw) for name, kw in chosen.items()}
            greedy = results[GREEDY][0]
            hf_greedy = answer(model, tokenizer, requests, batch)[0]  # the unpatched model, untimed
            mismatched = [name for name in (GREEDY, *GREEDY_EXACT) if name in results and results[name][0] != hf_greedy]
            if mismatched:
                sys.exit(f"{label}: {mismatched} differ from HF greedy; not timing wrong outputs")
            timings = measure({name: lambda kw=kw, b=batch, r=requests: answer(accelerated, tokenizer, r, b, **kw)
                               for name, kw in chosen.items()}, settings)
            cases[label] = dict(
                median_ms={name: t.median_us / 1e3 for name, t in timings.items()},
                vs_greedy={name: timings[GREEDY].median_us / t.median_us for name, t in timings.items()},
                noisy={name: t.noisy for name, t in timings.items()},
                tokens_per_pass={name: results[name][1] for name in chosen if results[name][1] is not None},
                identical_to_greedy={name: sum(a == b for a, b in zip(results[name][0], greedy, strict=True))
                                     / len(greedy) for name in chosen},
                new_tokens=sum(map(len, greedy)),
                draft_ms=draft_ms(drafter, tokenizer, requests, batch, settings) if drafter is not None else None)
    meter.record(env)
    share = env.get("others_cpu_share")
    quiet = share is not None and not busy(share)
    payload = dict(environment=env, quiet=quiet, drafter=str(args.drafter) if drafter is not None else None,
                   drafter_config=dataclasses.asdict(drafter.config) if drafter is not None else None,
                   self_drafters=list(SELF_DRAFTERS), block_size=BLOCK_SIZE, gad_plus_plus=GAD_PP,
                   new_tokens=NEW_TOKENS, cases=cases)
    print("# GAD on SmolLM2-135M-Instruct with self-drafters"
          + (" and its distilled drafter\n" if drafter is not None else "\n"))
    print("\n".join(machine_lines(env)) + "\n")
    print(f"GAD: block {BLOCK_SIZE}; GAD++: beta={GAD_PP['beta']}, tau={GAD_PP['tau']}; up to {NEW_TOKENS} new "
          f"tokens; 8 held-out prompts per kind.{'' if quiet else ' Timings taken under load.'}\n")
    print("| prompts | batch | provider | ms per call | vs lightgen greedy | tokens/pass | identical to greedy |")
    print("|---|---|---|---|---|---|---|")
    for label, row in cases.items():
        kind, _, batch = label.split()
        for name, ms in row["median_ms"].items():
            per_pass = row["tokens_per_pass"].get(name)
            print(f"| {kind} | {batch} | {name} | {ms:.0f}{' (noisy)' if row['noisy'][name] else ''} "
                  f"| {format_speedup(row['vs_greedy'][name])} | {'' if per_pass is None else f'{per_pass:.2f}'} "
                  f"| {100 * row['identical_to_greedy'][name]:.0f}% |")
    print("\nms per greedy decoder step (about: lightgen greedy's ms per call x rows / new tokens)"
          + (f" and per distilled draft ({BLOCK_SIZE} tokens after 32):" if drafter is not None else ":"))
    for label, row in cases.items():
        step = row["median_ms"][GREEDY] * int(label.split()[-1]) / row["new_tokens"]
        print(f"- {label}: step {step:.1f} ms" + (f", draft {row['draft_ms']:.2f} ms" if drafter is not None else ""))
    write_results(args.out, "gad_llm", payload, lambda plt: draw(plt, payload))


if __name__ == "__main__":
    main()
