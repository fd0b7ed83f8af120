"""fairseq greedy decoding by aggressive decoding (``AggressiveGenerator``): IAD, or GAD with a drafter.

The plugin's ``--lightgen-decoding iad|gad`` and ``hub.translate(..., beam=1, lightgen_decoding="iad")``
run it: lightgen runs the loop (``generation.aggressive.aggressive_greedy``) with drafts copied from the
source (IAD) or proposed by a ``NARDrafter`` (GAD), and applies fairseq's greedy rules to every verified
position, so hypotheses and scores are fairseq's (GAD++, ``beta > 1``, relaxes greedy's choice by design).
It runs on a model that ``lightgen.accelerate_model`` patched: the fairseq adapter attaches to each
decoder the function that starts lightgen's decoding over it (``START_DECODING_ATTR``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from lightgen._compat import check_fairseq_version
from lightgen.generation.aggressive import GREEDY, Acceptance, CopyFromInput, aggressive_greedy
from lightgen.generation.drafting import WEIGHTS_NAME, NARDrafter
from lightgen.memory import cached_cpu_memory
from lightgen.modules.decoder import Decoder, DecodeState

check_fairseq_version()

from fairseq import search  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

logger = logging.getLogger(__name__)

# Set by the fairseq adapter on each decoder it accelerates: (rows, encoder_out, max_len, spare) -> (Decoder, state).
START_DECODING_ATTR = "_lightgen_start_decoding"

AGGRESSIVE_SETTINGS = dict(lightgen_block_size=16, lightgen_drafter=None, lightgen_beta=1, lightgen_tau=0.0)

def encoder_for_drafting(model):
    """``model``'s encoder as ``lightgen.generation.drafting.train_drafter`` calls a verifier's (``verifier_encoder``):
    right-padded ids [B, S] and their mask -> ([B, S, E],), so a drafter learns from this model's encoder
    output, which GAD gives it at generation time."""
    def encode(input_ids, attention_mask):
        out = model.encoder(input_ids, src_lengths=attention_mask.sum(-1))
        return (out["encoder_out"][0].transpose(0, 1),)
    return encode


def _load_drafter(folder):
    """A drafter folder, loaded once while its weights file is unchanged: fairseq builds a generator for
    every ``hub.translate`` call, and a config (omegaconf) can only name the drafter by its folder."""
    weights = Path(folder).resolve() / WEIGHTS_NAME
    return _load_drafter_version(str(weights.parent), weights.stat().st_mtime_ns if weights.is_file() else None)


@functools.lru_cache(maxsize=4)
def _load_drafter_version(folder: str, _version):
    return NARDrafter.from_pretrained(folder)


def aggressive_generator(generator, src_dict, decoding: str, lightgen_block_size: int = 16,
                         lightgen_drafter=None, lightgen_beta: int = 1, lightgen_tau: float = 0.0):
    """``generator`` (fairseq greedy) as IAD or GAD when they can reproduce it, else ``generator`` itself
    with a warning saying why. GAD needs ``lightgen_drafter``: a ``NARDrafter`` or its folder."""
    drafter = None
    if decoding == "gad":
        if lightgen_drafter is None:
            raise ValueError("lightgen: GAD needs a drafter (--lightgen-drafter DIR, a NARDrafter folder saved by "
                             "save_pretrained)")
        drafter = lightgen_drafter if isinstance(lightgen_drafter, NARDrafter) else _load_drafter(lightgen_drafter)
    reason = iad_unsupported(generator)
    if reason is None:
        return AggressiveGenerator(generator, src_dict, lightgen_block_size, drafter=drafter,
                                   acceptance=Acceptance(lightgen_beta, lightgen_tau))
    warnings.warn(f"lightgen: {reason}; running plain greedy decoding", RuntimeWarning, stacklevel=3)
    return generator


# ---------------------------------------------------------------------------------------------
# Greedy decoding by input-guided aggressive decoding (IAD), with fairseq's hypotheses


def iad_unsupported(generator) -> str | None:
    """Why IAD cannot reproduce this ``SequenceGenerator``'s output, or None when it can."""
    if type(generator) is not SequenceGenerator:
        return f"IAD replaces fairseq's SequenceGenerator, not {type(generator).__name__}"
    if type(generator.search) is not search.BeamSearch or generator.beam_size != 1:
        return "IAD is greedy decoding: beam size 1, no sampling or constrained/diverse search"
    if generator.model.models_size != 1:
        return "IAD runs one model, not an ensemble"
    for setting, name in ((generator.repeat_ngram_blocker, "--no-repeat-ngram-size"),
                          (generator.lm_model, "a language model (--lm-path)"),
                          (generator.token_indices_to_suppress, "suppressed tokens")):
        if setting is not None:
            return f"IAD does not implement {name}"
    if generator.match_source_len:
        return "IAD does not implement --match-source-len"
    if not hasattr(generator.model.single_model.decoder, START_DECODING_ATTR):
        return "the model is not accelerated: call lightgen.accelerate_model(model) first"
    return None


class _FairseqGreedyScores:
    """lightgen's decoder as fairseq's greedy search sees it: ``step`` returns, for every position, the
    log-probabilities ``SequenceGenerator`` compares (temperature, pad never chosen, unk penalty, EOS
    blocked before ``min_len`` and forced at ``max_len``), so their argmax is fairseq's choice. Each pass's
    best score per row and position is kept: it is the positional score of the token greedy picks there."""

    def __init__(self, decoder: Decoder, generator, max_len: int) -> None:
        self.decoder = decoder
        self.spec = decoder.spec
        self.generator = generator
        self.max_len = max_len
        # Per pass, [rows decoding in that pass, positions fed]: the best score at each position, and the
        # token fed next (the draft's; -1 after the last) with its score: the score of an accepted draft token
        # that is not the best (GAD++).
        self.passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def step(self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor | None = None,
             all_positions: bool = False) -> torch.Tensor:
        if positions is None:
            positions = state.next_position[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        logits = self.decoder.step(state, tokens, positions, all_positions)
        if not all_positions:
            logits, positions = logits[:, None], positions[:, -1:]
        gen = self.generator
        # The position of the token fed is fairseq's `step` for the token predicted after it.
        lprobs = torch.log_softmax(logits / gen.temperature, dim=-1)
        lprobs.masked_fill_(lprobs.isnan(), -math.inf)
        lprobs[..., gen.pad] = -math.inf
        lprobs[..., gen.unk] -= gen.unk_penalty
        eos = lprobs[..., gen.eos].clone()
        lprobs.masked_fill_((positions >= self.max_len)[..., None], -math.inf)
        lprobs[..., gen.eos] = eos.masked_fill(positions < gen.min_len, -math.inf)
        following = F.pad(tokens[:, 1:], (0, 1), value=-1) if all_positions else torch.full_like(tokens[:, -1:], -1)
        drafted = lprobs.gather(-1, following.clamp(min=0)[..., None])[..., 0]
        self.passes.append((lprobs.max(-1).values, following, drafted))
        return lprobs if all_positions else lprobs[:, 0]


@dataclasses.dataclass
class AggressiveStats:
    """Running totals of an ``AggressiveGenerator``: decoder passes (the prompt pass included) and the
    tokens they produced (EOS included; plain greedy needs one pass per token)."""

    sentences: int = 0
    passes: int = 0
    tokens: int = 0

    def add(self, gained: list[list[int]]) -> None:
        self.sentences += len(gained)
        self.passes += sum(len(row) for row in gained)
        self.tokens += sum(sum(row) for row in gained)

    def __str__(self) -> str:
        return (f"{self.sentences} sentences, {self.passes / max(self.sentences, 1):.2f} decoder passes per sentence, "
                f"{self.tokens / max(self.passes, 1):.2f} tokens per pass")


class AggressiveGenerator:
    """fairseq greedy decoding by aggressive decoding on lightgen's decoder: IAD, or GAD with a drafter.

    Wraps a beam-1 ``SequenceGenerator`` (see ``iad_unsupported``) and returns the hypotheses it would:
    each row drafts up to ``block_size`` tokens, copied from its source sentence (IAD) or proposed by
    ``drafter`` (a ``NARDrafter`` for this model's target vocabulary, reading its encoder
    output: GAD); one decoder pass verifies them against fairseq's greedy choice (``_FairseqGreedyScores``),
    and the row keeps the agreeing prefix plus the verifier's own token (``acceptance``: GAD++ with
    ``beta > 1`` also keeps near-best draft tokens). Scores come from the verifying passes. Each hypothesis
    also carries ``iterations`` (its sentence's decoder passes) and ``tokens_per_iteration``; ``stats``
    keeps running totals, which are logged after each batch. Prefix tokens and constraints run the
    wrapped generator.

    ``src_dict``: the source dictionary, when it is not the target's; IAD's drafts are source words looked
    up in the target dictionary.
    """

    def __init__(self, generator: SequenceGenerator, src_dict=None, block_size: int = 16, drafter=None,
                 acceptance: Acceptance = GREEDY) -> None:
        reason = iad_unsupported(generator)
        if reason is not None:
            raise ValueError(f"lightgen: {reason}")
        if block_size < 1:
            raise ValueError(f"lightgen: the draft block size must be >= 1, got {block_size}")
        if drafter is not None:
            width = generator.model.single_model.encoder.embed_tokens.embedding_dim
            config = drafter.config
            if config.vocab_size != len(generator.tgt_dict) or (not config.encoder_layers and config.d_model != width):
                raise ValueError(f"lightgen: the drafter (vocabulary {config.vocab_size}, width {config.d_model}) was "
                                 f"not made for this model (target vocabulary {len(generator.tgt_dict)}, encoder "
                                 f"width {width})")
        self.generator = generator
        self.block_size = block_size
        self.drafter = drafter
        self.acceptance = acceptance
        self.method = "IAD" if drafter is None else "GAD" if acceptance.beta == 1 else "GAD++"
        self.tgt_dict = generator.tgt_dict
        self.eos = generator.eos
        self.symbols_to_strip_from_output = generator.symbols_to_strip_from_output
        self.source_pad = (src_dict if src_dict is not None else self.tgt_dict).pad()
        self.source_to_target = None  # [source vocabulary] target ids, when the dictionaries differ
        if src_dict is not None and src_dict.symbols != self.tgt_dict.symbols:
            self.source_to_target = torch.tensor([self.tgt_dict.index(word) for word in src_dict.symbols])
        self.stats = AggressiveStats()
        self._warned = False

    @torch.no_grad()
    @cached_cpu_memory()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None):
        """``SequenceGenerator.generate``: per sentence, a list with its one hypothesis."""
        if prefix_tokens is not None or constraints is not None:
            if not self._warned:
                warnings.warn(f"lightgen: {self.method} does not implement prefix tokens or constraints; running "
                              f"fairseq greedy", RuntimeWarning, stacklevel=2)
                self._warned = True
            return self.generator.generate(models, sample, prefix_tokens=prefix_tokens, constraints=constraints,
                                           bos_token=bos_token)
        gen = self.generator
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        rows, src_len = src_tokens.shape[:2]
        max_len = min(int(gen.max_len_a * src_len + gen.max_len_b), gen.max_len - 1)
        if gen.min_len > max_len:  # fairseq's own check, word for word, and its type: SequenceGenerator asserts it
            raise AssertionError("min_len cannot be larger than max_len, please adjust these!")
        encoder_out = gen.model.forward_encoder(net_input)[0]
        # Fed tokens: BOS and up to max_len outputs (the last EOS is never fed); drafts pad up to block_size.
        start_decoding = getattr(gen.model.single_model.decoder, START_DECODING_ATTR)
        decoder, state = start_decoding(rows, encoder_out, max_len + 1, self.block_size)
        scoring = _FairseqGreedyScores(decoder, gen, max_len)
        prompt = torch.full((rows, 1), self.eos if bos_token is None else bos_token, dtype=torch.long,
                            device=src_tokens.device)
        drafting = self._start_drafting(src_tokens, encoder_out, max_len + 2)
        try:
            sequences, gained = aggressive_greedy(scoring, state, prompt, None, drafting, {self.eos}, gen.pad,
                                                  max_len + 2, self.block_size, self.acceptance)
        finally:
            drafting.close()
            state.release()
        batch = AggressiveStats()
        batch.add(gained)
        self.stats.add(gained)
        logger.info("lightgen %s: %s (all so far: %s)", self.method, batch, self.stats)
        return self._hypotheses(sequences, gained, scoring.passes)

    def _start_drafting(self, src_tokens, encoder_out, max_length: int):
        sources = self.draft_sources(src_tokens)
        if self.drafter is None:
            return CopyFromInput(sources)
        padding = encoder_out["encoder_padding_mask"]
        return self.drafter.start(sources, encoder_out["encoder_out"][0].transpose(0, 1),
                                  ~padding[0] if padding else None, max_length)

    def draft_sources(self, src_tokens: torch.Tensor) -> list[list[int]]:
        """What each row copies its drafts from: its source sentence (EOS included), in target ids."""
        src_tokens = src_tokens.cpu()
        tokens = src_tokens if self.source_to_target is None else self.source_to_target[src_tokens]
        return [row[keep].tolist() for row, keep in zip(tokens, src_tokens.ne(self.source_pad), strict=True)]

    def _hypotheses(self, sequences, gained, passes) -> list[list[dict]]:
        """fairseq's hypothesis dicts. Pass ``i`` decoded, in row order, the rows that had an ``i``-th pass
        (finished rows leave ``aggressive_greedy``'s batch); each row's tokens from a pass are its first
        positions: an accepted draft token, scored as drafted, or the verifier's own (the best score)."""
        if len(passes) != max(len(row) for row in gained):
            raise RuntimeError(f"lightgen: {len(passes)} decoder passes for {max(map(len, gained))} iterations")
        positional = [[] for _ in gained]
        done = [0] * len(gained)
        for index, (best, following, drafted) in enumerate(passes):
            live = [row for row, row_passes in enumerate(gained) if len(row_passes) > index]
            for slot, row in enumerate(live):
                count = gained[row][index]
                chosen = sequences[row, 1 + done[row]: 1 + done[row] + count]
                positional[row].append(torch.where(chosen == following[slot, :count], drafted[slot, :count],
                                                   best[slot, :count]))
                done[row] += count
        gen, hypotheses = self.generator, []
        for row, row_passes in enumerate(gained):
            length = sum(row_passes)
            scores = torch.cat(positional[row])
            score = scores.sum()
            if gen.normalize_scores:
                score = score / length ** gen.len_penalty
            hypotheses.append([{
                "tokens": sequences[row, 1: 1 + length], "score": score, "attention": torch.empty(0),
                "alignment": torch.empty(0), "positional_scores": scores, "iterations": len(row_passes),
                "tokens_per_iteration": torch.tensor(row_passes),
            }])
        return hypotheses
