"""How many draft tokens each row verifies per pass, so that aggressive decoding never loses to greedy.

A verification pass over ``rows x (1 + K)`` positions adds to each row its verifier token plus the
accepted prefix of its draft, and costs what a pass of that many positions costs. Where drafts keep
being rejected (chat prompts under IAD: ~1.05 tokens per pass) and positions are not free (batch 8 is
compute-bound), the wide pass is pure loss: issue 25 measured IAD at 0.49x lightgen greedy there.

``DraftPolicy`` keeps, per row, an estimate ``p`` of the chance that its next draft token is accepted
(a Beta prior, the evidence decayed so that rows entering or leaving a copied span adapt); the prior's mean
is what this decoder's drafts of this kind kept in earlier calls (``AcceptanceHistory``), so a model that
copies its input drafts long from a row's first pass and a chat model drafts short; a row
drafts at most the tokens whose expected acceptance ``p^i`` is worth a place, and the pass width is the
``K`` that maximises expected tokens per second, ``sum_rows(1 + a sum_{i<=K} p^i) / (cost(rows x (1+K)) + o_K)``,
with ``a`` the row's chance that its drafter finds a draft at all (a copy drafter needs an anchor), the ``p^i``
scaled by the share of such expectations that earlier passes kept (``AcceptanceHistory.calibration``),
with ``cost`` the decoder's own time, a line through positions, and ``o_K`` what an iteration costs around it:
drafting and a drafting pass's bookkeeping for ``K > 0``, a plain greedy step's for ``K = 0`` (``PassCost``, measured
on this decoder with drafters of this kind); a drafter that steps once a token (an assistant model, a self-drafter)
adds ``K`` of its steps instead of a drafting price per pass. GAD's drafter on the demo model costs about as much as
a pass, a price no draft width spreads thin, and ``K = 0`` saves it. When ``K = 0`` wins the loop runs plain greedy
steps; a one-token probe after enough of them to keep probing within ``PROBE_SHARE`` of their time (the count kept
across calls) lets rows whose drafts start to pay draft again. The tokens are greedy's whatever the policy decides: it
only changes how many are verified per pass.
"""

from __future__ import annotations

import collections
import math

import numpy as np

# Pseudo-counts of accepted / rejected draft tokens before a row has drafted: p = 2/3 on a decoder's first call,
# then the same weight at the mean acceptance its earlier calls saw (AcceptanceHistory).
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0
# ... and of asks that found a draft / came back empty: a drafter is taken to find drafts until it misses.
PRIOR_FOUND, PRIOR_MISSED = 1.0, 0.0
# Evidence kept per ask: misses come in runs (a chat answer's copy lookups) or alone (the demo model's, right after
# a correction, and the next ask finds again), so the chance to find follows the last few asks (floor: 1/3).
AVAILABILITY_DECAY = 0.5
# A history's mean stays within these: p = 1 would make every draft worthwhile, p = 0 would never draft again.
PRIOR_RANGE = (0.1, 0.98)
# Per call, the weight earlier calls keep in the history: it follows a decoder whose workload changes.
HISTORY_DECAY = 0.5
# Evidence kept per observation; also bounds how low p sinks under rejections (~0.21: one-token drafts).
DECAY = 0.85
# Draft tokens whose expected acceptance is below this are not worth their place (and their LM-head row).
WORTHWHILE = 0.05
# The share of the draft tokens the per-row estimate expects that passes keep, p^1 + .. + p^K a row, is learned per
# decoder and kind of drafter (``AcceptanceHistory.calibration``), the evidence decayed per drafting pass, and
# scales the tokens a draft is expected to add, within this range, once this many tokens were expected. The geometric
# p^i is right for a copy drafter (IAD keeps more: capped at 1) and too hopeful for one whose drafts are kept whole
# or hardly at all: the demo's shipped GAD drafter kept 3-4 of the 5.5-7.5 its rows' p promised (block 8), each pass
# cost ~6 greedy steps, and GAD ran at 0.90x greedy at batch 1.
CALIBRATION_RANGE = (0.25, 1.0)
CALIBRATION_EVIDENCE = 4.0
CALIBRATION_DECAY = 0.9
# Probes (one-token drafts while greedy steps win) may cost this share of the greedy steps' time between them ...
PROBE_SHARE = 0.03
PROBE = "probe"  # the kind of iteration a probe's time is kept under (``PassCost.around``)
# ... but come after this many greedy steps at least and at most.
FIRST_PROBE_WAIT, LONGEST_PROBE_WAIT = 2, 1024
RATE_TOLERANCE = 0.05


class PassCost:
    """Seconds per decoder pass against the positions it feeds (rows x width), measured on one decoder, and the
    seconds around a pass: an iteration that drafts and one that is a plain greedy step.

    Per position count timed twice or more, the mean of the faster half of its last few times, then a least-squares
    line ``a + b * positions`` through them; with none seen, every pass costs the same (the policy then drafts in
    full, as fixed-length drafting did, and so sees more widths). Why the faster
    half: load only adds time, and dropping the slower half drops its spikes; but the counts are seen
    unequally often (the policy soon stops drafting wide: a wide count keeps one or two times while the
    greedy width keeps a full window), and the minimum of many loaded times is lower than that of two,
    which steepens the line (simulated under persistent load: wide passes up to 1.4x too dear by the minimum,
    0.9-1.0x by the faster half; tests/generation/test_draft_policy.py). With one count seen, a pass over fewer
    positions costs proportionally less and one over more the same: each unseen side looks cheap enough to be
    tried once, which gives the line its second point."""

    def __init__(self, window: int = 8, counts: int = 64) -> None:
        self._times: collections.OrderedDict[int, collections.deque] = collections.OrderedDict()
        self._fresh_means: dict[int, float] = {}  # ``_means`` as of the last read
        self._changed: set[int] = set()  # the counts timed since
        self._window, self._counts = window, counts
        self._line: tuple[float, float] | None = None
        # Seconds between one pass's end and the next one's start (drafting iterations, greedy steps) against the
        # rows decoding: a drafter's time grows with them (the demo drafter: ~2 ms at 1 row, ~5 at 8).
        self._around: dict[bool, PassCost] = {}
        # Seconds a step of a drafter that steps once a drafted token (an assistant model, a self-drafter) takes,
        # against the rows decoding: its drafting is priced per token asked (``drafting_step``), not per pass.
        self._steps: PassCost | None = None

    def observe(self, positions: int, seconds: float) -> None:
        times = self._times.pop(positions, None) or collections.deque(maxlen=self._window)
        times.append(seconds)
        self._times[positions] = times  # most recently seen last; the oldest count goes first
        if len(self._times) > self._counts:
            oldest = self._times.popitem(last=False)[0]
            self._fresh_means.pop(oldest, None)
            self._changed.discard(oldest)
            self._line = None
        # Means are taken when the line is read (a plan), not per pass: greedy steps time every step.
        self._changed.add(positions)

    @property
    def _means(self) -> dict[int, float]:
        """Per count timed twice or more, the faster-half mean of its times. A count enters the line with its second
        time (the faster of the two): its first is often its shape's first run in the process (the demo model's first
        8-position pass: 2.2 ms, later ones ~0.7), or a spike, and a count that looks dear is rarely timed again: IAD
        then stayed greedy for the rest of the process."""
        if self._changed:
            for positions in self._changed:
                times = self._times.get(positions)
                if times is not None and len(times) >= 2:
                    self._fresh_means[positions] = _faster_half_mean(times)
            self._changed.clear()
            self._line = None
        return self._fresh_means

    def observe_around(self, drafting: bool | str, rows: int, seconds: float) -> None:
        self._around.setdefault(drafting, PassCost(self._window, self._counts)).observe(rows, seconds)

    def around(self, drafting: bool | str, rows: int) -> float:
        """Seconds an iteration over ``rows`` costs outside the decoder's pass: one that drafts (True), a probe
        (PROBE) or a plain greedy step (False); 0 before any was seen. Probes and drafting iterations are priced
        apart, each by the other's times until its own were seen: a probe is mostly the first draft of its call,
        where a drafter sets up (the demo's GAD drafter: 0.8 ms against 0.5 for the next drafts at batch 1), and
        priced as the drafts after it, probes came more often than PROBE_SHARE allows."""
        line = self._around.get(drafting)
        if drafting is not False and (line is None or not line.seen()):
            line = self._around.get(True if drafting == PROBE else PROBE)
        return float(line(rows)) if line is not None and line.seen() else 0.0

    def observe_drafting(self, rows: int, steps: int, seconds: float) -> None:
        self._steps = self._steps or PassCost(self._window, self._counts)
        self._steps.observe(rows, seconds / steps)

    def drafting_step(self, rows: int) -> float:
        """Seconds a drafter that steps once a token takes per token asked over ``rows`` (0: none seen)."""
        return float(self._steps(rows)) if self._steps is not None and self._steps.seen() else 0.0

    def seen(self) -> bool:
        """Whether the line prices passes: some count is in it (timed twice), or it is given."""
        return bool(self._means)

    def knows(self, positions: int) -> bool:
        """Whether ``positions`` is one of the counts in the line."""
        return positions in self._means

    def fitted(self) -> bool:
        """Whether the line rests on two position counts or more."""
        return len(self._means) >= 2

    def line(self) -> tuple[float, float]:
        """(a, b): seconds of a pass over n positions ~ a + b n, with a > 0 and b >= 0."""
        if self._changed or self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        if len(self._means) < 2:
            return 1.0, 0.0
        # Plain floats: a pass refits over a dozen or so points, where NumPy's per-call cost is most of the work.
        points = len(self._means)
        mean_n = sum(self._means) / points
        mean_t = sum(self._means.values()) / points
        spread = sum((n - mean_n) ** 2 for n in self._means)
        slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in self._means.items()) / spread)
        return max(mean_t - slope * mean_n, 0.1 * min(self._means.values())), slope

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if len(self._means) == 1:
            (seen, seconds), = self._means.items()
            return seconds * np.minimum(1.0, np.asarray(positions) / seen)
        a, b = self.line()
        return a + b * positions


def _faster_half_mean(times) -> float:
    fastest = sorted(times)[:max(1, len(times) // 2)]
    return sum(fastest) / len(fastest)


class FixedPassCost(PassCost):
    """A cost line given, not measured (tests, or a machine profiled beforehand); ``slope=0`` makes
    every width cost the same, which keeps every draft in full. ``drafting``: seconds an iteration that drafts
    costs around its pass (a greedy step's: none)."""

    def __init__(self, intercept: float = 1.0, slope: float = 0.0, drafting: float = 0.0) -> None:
        super().__init__()
        self._line, self._drafting = (intercept, slope), drafting

    def observe(self, positions: int, seconds: float) -> None:
        pass

    def observe_around(self, drafting: bool, rows: int, seconds: float) -> None:
        pass

    def observe_drafting(self, rows: int, steps: int, seconds: float) -> None:
        pass

    def around(self, drafting: bool | str, rows: int) -> float:
        return self._drafting if drafting else 0.0

    def seen(self) -> bool:
        return True

    def fitted(self) -> bool:
        return True


def measured_cost(decoder, drafter) -> PassCost:
    """The pass cost of ``decoder`` with drafters of ``drafter``'s type, kept on it across ``generate`` calls (on
    the decoder that fairseq's per-call scoring wrapper wraps): the drafter is part of an iteration's cost."""
    return _kept_on(decoder).setdefault(("pass_cost", _kind(drafter)), PassCost())


def _kind(drafter) -> object:
    """Which drafters share a cost line and an acceptance history: a session's ``kind`` where it has one (a
    self-drafter's: its own precision drafts at its own cost), else its type."""
    return getattr(drafter, "kind", type(drafter).__qualname__)


def _kept_on(decoder) -> dict:
    """What the draft policy keeps on ``decoder`` across calls (on the decoder fairseq's scoring wrapper wraps)."""
    owner = getattr(decoder, "decoder", decoder)
    return owner.__dict__.setdefault("_lightgen_draft_policy", {})


class AcceptanceHistory:
    """Draft tokens accepted and rejections seen on one decoder with one kind of drafter, over earlier calls.

    The demo model (copies most of its input) keeps ~93% of IAD's draft tokens, SmolLM2 answering chat prompts
    a few: from the fixed 2/3 every row's first draft was cut at 7 tokens (6.15 tokens a pass at batch 1 on the
    demo, where whole first drafts gave 7.58) and chat rows spent their first wide passes on rejected drafts."""

    def __init__(self) -> None:
        self.accepted = self.rejected = self.found = self.missed = 0.0
        self.greedy_steps = 0  # greedy steps since the last probe or drafting pass, across calls
        self.expected = self.kept = 0.0  # draft tokens the per-row estimates expected passes to keep, and kept

    def calibration(self) -> float:
        """The share of the draft tokens expected that passes kept (see CALIBRATION_RANGE)."""
        if self.expected < CALIBRATION_EVIDENCE:
            return 1.0
        return min(max(self.kept / self.expected, CALIBRATION_RANGE[0]), CALIBRATION_RANGE[1])

    def kept_of_expected(self, expected: float, kept: float) -> None:
        """One drafting pass: its rows' estimates expected ``expected`` of its draft tokens kept, it kept ``kept``."""
        self.expected = self.expected * CALIBRATION_DECAY + expected
        self.kept = self.kept * CALIBRATION_DECAY + kept

    def prior(self) -> tuple[float, float]:
        """(accepted, rejected) pseudo-counts for a new row."""
        return _prior(self.accepted, self.rejected, PRIOR_ACCEPTED, PRIOR_REJECTED)

    def availability_prior(self) -> tuple[float, float]:
        """(found, missed) pseudo-counts for a new row's asks."""
        return _prior(self.found, self.missed, PRIOR_FOUND, PRIOR_MISSED)

    def add(self, accepted: float, rejected: float, found: float = 0.0, missed: float = 0.0) -> None:
        """One call's totals (not decayed)."""
        self.accepted = self.accepted * HISTORY_DECAY + accepted
        self.rejected = self.rejected * HISTORY_DECAY + rejected
        self.found = self.found * HISTORY_DECAY + found
        self.missed = self.missed * HISTORY_DECAY + missed


def _prior(hits: float, misses: float, prior_hits: float, prior_misses: float) -> tuple[float, float]:
    """Pseudo-counts of the fixed prior's weight at the history's mean (within PRIOR_RANGE), or the fixed prior."""
    if hits + misses == 0:
        return prior_hits, prior_misses
    strength = prior_hits + prior_misses
    mean = min(max(hits / (hits + misses), PRIOR_RANGE[0]), PRIOR_RANGE[1])
    return strength * mean, strength * (1 - mean)


def measured_history(decoder, drafter) -> AcceptanceHistory:
    """The acceptance history of ``decoder`` with drafters of ``drafter``'s type, kept on it across calls."""
    return _kept_on(decoder).setdefault(("acceptance", _kind(drafter)), AcceptanceHistory())


class DraftPolicy:
    """Draft lengths and pass widths for one aggressive-decoding call; rows are the ones still decoding.

    Its arithmetic is on a few dozen numbers a pass, in NumPy: as torch ops on tensors that small, planning,
    choosing the width and observing cost 846 us a pass on 8 rows, in NumPy 272 us (same run, a loaded machine),
    against a demo-model pass of about 1 ms."""

    def __init__(self, rows: int, cost: PassCost, history: AcceptanceHistory | None = None) -> None:
        self.cost, self.history = cost, history if history is not None else AcceptanceHistory()
        self.prior_accepted, self.prior_rejected = self.history.prior()
        self.prior_found, self.prior_missed = self.history.availability_prior()
        self.accepted = np.zeros(rows)  # decayed counts of accepted draft tokens
        self.rejected = np.zeros(rows)  # ... and of rejections
        self.found = np.zeros(rows)  # decayed counts of asks that found a draft
        self.missed = np.zeros(rows)  # ... and of asks that came back empty
        self.totals = [0.0, 0.0, 0.0, 0.0]  # this call's accepted, rejected, found and missed, for the history
        self._probing, self._planned = False, 0
        self._greedy_left = 0  # greedy steps still to run before planning again
        self._sizes = np.zeros(rows, dtype=np.int64)  # the worthwhile draft lengths of the last plan
        self._asked = np.zeros(rows, dtype=np.int64)  # the draft lengths the last plan asked for
        self._found = np.zeros(rows, dtype=bool)  # the rows whose asks found a draft (set by ``width``)
        self._wakers: np.ndarray | None = None  # during greedy steps, the rows whose finding a draft ends them
        self._last_end: float | None = None  # when the last timed pass ended
        self._drafting_seconds = 0.0  # the last draft's time where it is priced per token (``drafted``)

    def acceptance(self) -> np.ndarray:
        """[rows] float64: the estimated chance that a row's next draft token is accepted."""
        prior = self.prior_accepted + self.prior_rejected
        return (self.accepted + self.prior_accepted) / (self.accepted + self.rejected + prior)

    def availability(self) -> np.ndarray:
        """[rows] float64: the estimated chance that asking a row's drafter finds a draft at all. Apart from
        acceptance: a copy drafter without an anchor says nothing of how long its next found draft runs (counted as
        rejections, misses cut the demo model's IAD from 7.3 to 4.6 tokens a pass at batch 1), but an ask that finds
        nothing costs a drafting iteration (SmolLM2 on chat prompts, batch 1: most lookups find no anchor, and an
        iteration costs 2.1 ms around its 36 ms pass against a greedy step's 0.13)."""
        prior = self.prior_found + self.prior_missed
        return (self.found + self.prior_found) / (self.found + self.missed + prior)

    def plan(self, limits, found=None) -> np.ndarray:
        """``limits`` [rows] int64 (the most each row may draft) -> how many tokens to ask the drafter for:
        the worthwhile ones, up to the pass width they would pay for (or a one-token probe). All zeros (and
        ``drafting`` False): plain greedy steps, ``greedy_steps()`` of them; until they have run (or ``wake``),
        plans (after rows finish) stay greedy without weighing widths again.

        ``found`` [rows] bool, where the drafter can tell without drafting (a copy drafter's anchor lookup): which
        rows it has a draft for now. It takes the estimated availability's place, and greedy steps then end as soon
        as a row whose draft would pay finds one (``waiting``, ``wake``): the demo model's corrections are
        followed by a miss or two, then copying again, and without this its IAD ran the rest of a sentence in greedy
        steps after one (3.36 instead of 2.4 passes a sentence, warm)."""
        self._probing = False
        if self._greedy_left > 0:
            self._planned = 0
            return np.zeros(len(limits), dtype=np.int64)
        worthwhile = np.floor(math.log(WORTHWHILE) / np.log(self.acceptance())).clip(min=0)  # p^i >= WORTHWHILE
        self._sizes = sizes = np.minimum(np.asarray(limits), worthwhile.astype(np.int64))
        found = None if found is None else np.asarray(found, dtype=bool)
        availability = self.availability() if found is None else found.astype(np.float64)
        self._planned = self._best_width(sizes, drafted=False, availability=availability)
        self._wakers = None
        if self._planned == 0 and found is not None:
            waiting = (sizes > 0) & ~found
            if waiting.any() and self._best_width(sizes, drafted=False, availability=availability + waiting) > 0:
                self._wakers = waiting
        if self._planned > 0:
            self.history.greedy_steps = 0
        elif bool((sizes > 0).any()) and self.history.greedy_steps >= self._probe_wait():
            self.history.greedy_steps, self._probing, self._planned = 0, True, 1
        self._asked = sizes.clip(max=self._planned)
        return self._asked

    @property
    def waiting(self) -> np.ndarray | None:
        """During greedy steps: [rows] bool, the rows whose drafter has no draft now and whose finding one would end
        them (``wake``); None: no row's would."""
        return self._wakers

    def wake(self) -> None:
        """A waiting row's drafter has a draft: the greedy steps end, and the next plan weighs widths again."""
        self._greedy_left, self._wakers = 0, None

    @property
    def drafting(self) -> bool:
        """Whether the last plan asks the drafter for anything."""
        return self._planned > 0

    def greedy_steps(self) -> int:
        """After a plan without drafts: the plain greedy steps to take before planning again (until the next
        probe is due; one while the cost line is unfitted and these steps give it a count it lacks). Where the line
        holds the greedy steps' own count alone (drafts never found, so no wider pass ran: random text, chat), one
        step a plan cost a drafting iteration's bookkeeping per token and probes every other step: IAD 0.65x greedy
        on a random Llama at batch 1."""
        if self._greedy_left == 0:
            if not self.cost.fitted() and not self.cost.knows(self._sizes.shape[0]):
                self._greedy_left = 1
            elif not bool((self._sizes > 0).any()):
                self._greedy_left = LONGEST_PROBE_WAIT  # nothing worth drafting is left to probe
            else:
                self._greedy_left = max(1, self._probe_wait() - self.history.greedy_steps)
        return self._greedy_left

    def _probe_wait(self) -> int:
        """Greedy steps between probes: enough that a probe's extra cost is PROBE_SHARE of theirs."""
        rows = self._sizes.shape[0]
        greedy = float(self.cost(rows)) + self.cost.around(False, rows)
        probe = float(self.cost(2 * rows)) + self.cost.around(PROBE, rows) + self.cost.drafting_step(rows)
        if not self.cost.seen() or greedy <= 0:  # no pass timed yet
            return FIRST_PROBE_WAIT
        return int(min(max(math.ceil((probe - greedy) / (PROBE_SHARE * greedy)), FIRST_PROBE_WAIT),
                       LONGEST_PROBE_WAIT))

    def width(self, lengths) -> int:
        """``lengths`` [rows] int64 (the drafts the drafter gave, at most as planned) -> K, the draft tokens
        per row this pass verifies: drafts shorter than planned may pay for a narrower pass."""
        lengths = np.asarray(lengths)
        self._found = lengths > 0
        if self._probing:
            return min(self._planned, int(lengths.max()) if lengths.size else 0)
        if np.array_equal(lengths, self._asked):  # drafts as long as asked: the width planned for them
            return self._planned
        return min(self._planned, self._best_width(lengths, drafted=True))

    def _best_width(self, lengths: np.ndarray, drafted: bool, availability: np.ndarray | None = None) -> int:
        """The K of the best expected rate; ``drafted``: the drafts are in hand, so K = 0 saves no drafting. Before
        drafting, K is the best width for drafts found, and 0 where the chance of finding them does not pay for
        asking (weighing the widths by that chance would only shorten the drafts it finds)."""
        longest = int(lengths.max()) if lengths.size else 0
        if longest == 0:
            return 0
        rows = lengths.shape[0]
        places = np.arange(1, longest + 1)
        expected = (self.acceptance()[:, None] ** places) * (places <= lengths[:, None]) * self.history.calibration()
        drafting = self.cost.around(True, rows)
        seconds = self.cost(rows * (1 + np.arange(longest + 1))) + drafting
        if not drafted:
            seconds[0] += self.cost.around(False, rows) - drafting
            seconds[1:] += self.cost.drafting_step(rows) * places  # K tokens asked: K steps of such a drafter
        rate = (np.concatenate([[0.0], expected.sum(0).cumsum()]) + rows) / seconds  # K = 0..longest
        # The widest K within RATE_TOLERANCE of the best: flat costs (no evidence yet) keep drafts whole, and where
        # the text is copied, acceptance runs longer than the geometric p^i expects, so near-ties go to the longer.
        width = int(np.flatnonzero(rate >= rate.max() * (1 - RATE_TOLERANCE)).max())
        if drafted or width == 0:
            return width
        availability = self.availability() if availability is None else availability
        found = (availability[:, None] * expected)[:, :width].sum()
        return width if (rows + found) / seconds[width] >= rate[0] else 0

    def observe(self, offered, accepted) -> None:
        """Each row verified ``offered`` [rows] draft tokens and kept the first ``accepted`` [rows]; the rows the last
        plan asked for a draft found one or not (``width`` saw the drafter's lengths)."""
        offered, accepted = np.asarray(offered, dtype=np.float64), np.asarray(accepted, dtype=np.float64)
        drafted, rejected = offered > 0, accepted < offered
        if drafted.any():  # what the estimates expected before this pass's evidence: p + .. + p^offered a row
            p = self.acceptance()[drafted]
            self.history.kept_of_expected(float((p * (1 - p ** offered[drafted]) / (1 - p)).sum()),
                                          float(accepted[drafted].sum()))
        self.accepted = np.where(drafted, self.accepted * DECAY + accepted, self.accepted)
        self.rejected = np.where(drafted, self.rejected * DECAY + rejected, self.rejected)
        asked = (self._asked > 0) if self.drafting else np.zeros(offered.shape, dtype=bool)
        self.found = np.where(asked, self.found * AVAILABILITY_DECAY + self._found, self.found)
        self.missed = np.where(asked, self.missed * AVAILABILITY_DECAY + ~self._found, self.missed)
        self.totals[0] += float(accepted[drafted].sum())
        self.totals[1] += float(rejected[drafted].sum())
        self.totals[2] += float(self._found[asked].sum())
        self.totals[3] += float((~self._found[asked]).sum())

    def finish(self) -> None:
        """The call is over: what its drafts kept goes to the history that later calls start from."""
        self.history.add(*self.totals)

    def keep(self, slots) -> None:
        slots = np.asarray(slots)
        self.accepted, self.rejected, self._sizes = self.accepted[slots], self.rejected[slots], self._sizes[slots]
        self.found, self.missed, self._asked = self.found[slots], self.missed[slots], self._asked[slots]
        if self._wakers is not None:
            self._wakers = self._wakers[slots]

    def drafted(self, steps: int, seconds: float) -> None:
        """A drafter that steps once a token (``steps_per_token``) took ``seconds`` for ``steps`` steps: that time is
        priced per token asked, apart from the time around the pass."""
        if steps > 0:
            self.cost.observe_drafting(self.accepted.shape[0], steps, seconds)
        self._drafting_seconds = seconds

    def timed(self, positions: int, started: float, ended: float) -> None:
        """A decoder pass over ``positions`` ran from ``started`` to ``ended`` (``time.perf_counter``), after the
        last plan: its time goes to the line, the time since the previous pass ended (drafting, acceptance,
        bookkeeping) to the drafting, probing or greedy iterations' cost around a pass. Priced per pass, not per
        position: with the decoder's time alone, a small fast decoder (the demo model's native step: 0.7 ms a
        pass, ~0.3 ms of it Python around it) looked dearer per position than it is, and IAD drafted 4.9-5.2
        tokens a pass instead of 6.15 (slower)."""
        if self._last_end is not None:
            around = started - self._last_end - self._drafting_seconds
            self.cost.observe_around(PROBE if self._probing else self.drafting, self.accepted.shape[0], around)
        self._last_end, self._drafting_seconds = ended, 0.0
        self.cost.observe(positions, ended - started)
        if not self.drafting:
            self.history.greedy_steps += 1
            self._greedy_left = max(0, self._greedy_left - 1)
