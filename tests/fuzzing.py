"""What the fuzzes share (tests/generation/test_fuzz.py, tests/with_fairseq): cases from seeds for a time budget, and
when two scores are a tie to fp32 rounding."""

from __future__ import annotations

import collections
import math
import os
import time

import pytest

# Returned hypotheses of one sentence whose scores (the unpatched model's: HF's, fairseq's) are this close (relative)
# are a tie to fp32 rounding: a sum of 8-64 log-probabilities, each a few ulps off the reference's, decides their
# order (seen: two beam-6 hypotheses of Marian 3.8e-6 apart, lightgen's scores 3e-6 from HF's).
NEAR_TIE = 1e-5

# lightgen's scores may be this many times further from the reference's than its fp32 ones are from its fp64 ones.
ROUNDING_FACTOR = 4.0


def ties_in(score, hf_score, hf_sentence_scores) -> bool:
    """lightgen's hypothesis in place of HF's at a rank: its score ties HF's there, or it is at least as good and
    ties another hypothesis HF returned for the sentence (a tied sibling HF lost at a beam cut: seen on BART, three
    hypotheses of the same tokens in other orders within 4e-7, HF keeping two)."""
    return tie(score, hf_score) or (float(score) >= float(hf_score)
                                     and any(tie(score, other) for other in hf_sentence_scores))


def tie(score, other) -> bool:
    """Within ``NEAR_TIE``, or equal: two infinite scores tie exactly (a processor's +inf, seen: every beam's EOS at
    +inf from an exponential length penalty past the largest float, whose order torch.topk sets by the other
    values), an infinite and a finite one never."""
    score, other = float(score), float(other)
    return score == other or (math.isfinite(score) and math.isfinite(other)
                              and abs(score - other) <= NEAR_TIE * max(1.0, abs(other)))


def first_shared_tie(theirs, mine, tied, close) -> int | None:
    """The first step whose candidates (per step, the reference's ``theirs`` and lightgen's ``mine``) hold a tie
    (``tied``) in both runs, with lightgen's candidates the reference's (``close``) at every step up to it (None: no
    such step): from there, which candidate runs on is fp32 rounding's."""
    for step, (their_step, my_step) in enumerate(zip(theirs, mine)):
        if not close(my_step, their_step):
            return None  # the candidates parted before any tie
        if tied(their_step) and tied(my_step):
            return step
    return None


def _budget_seconds() -> float:
    if os.environ.get("LIGHTGEN_FUZZ_MINUTES"):
        return 60 * float(os.environ["LIGHTGEN_FUZZ_MINUTES"])
    return float(os.environ.get("LIGHTGEN_FUZZ_SECONDS", "90"))


def fuzz(run, described_by: int, share: float = 1.0) -> None:
    """``run`` cases for ``share`` of the budget (``LIGHTGEN_FUZZ_CASE``: that one alone); a case's description's
    first ``described_by`` words count its kind."""
    if os.environ.get("LIGHTGEN_FUZZ_CASE"):
        print(run(int(os.environ["LIGHTGEN_FUZZ_CASE"])))
        return
    base = int(os.environ.get("LIGHTGEN_FUZZ_SEED", time.time_ns() % 10**9))
    deadline = time.monotonic() + share * _budget_seconds()
    cases, failures, kinds = 0, [], collections.Counter()
    while time.monotonic() < deadline:
        seed = base * 100000 + cases
        try:
            kinds[" ".join(run(seed).split()[:described_by])] += 1
        except AssertionError as error:
            failures.append(f"LIGHTGEN_FUZZ_CASE={seed}: {error}")
        cases += 1
    print(f"fuzz: {cases} cases from base seed {base}, {len(failures)} differ from the unpatched model; by kind: "
          f"{dict(sorted(kinds.items()))}")
    if failures:
        pytest.fail(f"{len(failures)} of {cases} fuzz cases (base seed {base}) differ from the unpatched model; rerun "
                    f"one with the variable shown:\n" + "\n\n".join(failures))
