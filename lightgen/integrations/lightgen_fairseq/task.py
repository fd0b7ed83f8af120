"""``translation_lightgen``: fairseq's translation task whose generator runs on lightgen.

No ``from __future__ import annotations``: fairseq reads the config dataclass's field types at run time.
"""


import copy
import warnings
from dataclasses import dataclass, field
from typing import Optional

from fairseq import search
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

import lightgen
from lightgen import ops
from lightgen.adapters.fairseq import allow_fairseq_checkpoints, check_supported
from lightgen.generation.fairseq_greedy import aggressive_generator

# fairseq-generate / -interactive load checkpoints after importing --user-dir.
allow_fairseq_checkpoints()

DECODINGS = ChoiceEnum(["beam", "greedy", "sampling", "iad", "gad"])
AGGRESSIVE = ("iad", "gad")


@dataclass
class TranslationLightgenConfig(TranslationConfig):
    lightgen_decoding: DECODINGS = field(default="beam", metadata={
        "help": "beam: fairseq's generation flags decide (--beam, --sampling, --diverse-beam-groups, ...); "
                "greedy: beam size 1; sampling: as --sampling (with --sampling-topk/topp, --temperature); "
                "iad: greedy's hypotheses by input-guided aggressive decoding (drafts copied from the source); "
                "gad: greedy's hypotheses with drafts from --lightgen-drafter"})
    lightgen_block_size: int = field(default=16, metadata={
        "help": "iad/gad: the most draft tokens one decoder pass verifies"})
    lightgen_drafter: Optional[str] = field(default=None, metadata={
        "help": "gad: folder of a lightgen NARDrafter trained for this model (NARDrafter.save_pretrained)"})
    lightgen_beta: int = field(default=1, metadata={
        "help": "gad: keep a draft token among the model's top-beta (1: greedy's output exactly; >1: GAD++)"})
    lightgen_tau: float = field(default=0.0, metadata={
        "help": "gad with beta > 1: ... and at most tau below the best log-probability"})


class BeamTopkSearch(search.BeamSearch):
    """fairseq's ``BeamSearch.step`` with its add + ``torch.topk`` done by lightgen's ``beam_topk`` op:
    the same candidates in the same order (ties to the smaller index)."""

    def step(self, step, lprobs, scores, prev_output_tokens=None, original_batch_idxs=None, candidate_multiple=2):
        bsz, beam_size, vocab_size = lprobs.size()
        if step == 0:  # every hypothesis is the same: only the first beam's candidates count
            beams, beam_scores = 1, None
            lprobs = lprobs[:, :1]
        else:
            beams, beam_scores = beam_size, scores[:, :, step - 1].reshape(-1)
        k = min(candidate_multiple * beam_size, beams * vocab_size - 1)  # -1: pad is never selected
        values, flat, _ = ops.beam_topk(lprobs.reshape(-1, vocab_size).contiguous(), beam_scores, beams, k,
                                        log_softmax=False)
        return values, flat % vocab_size, flat // vocab_size


def _unsupported(args) -> str | None:
    if getattr(args, "print_alignment", None):
        return "--print-alignment needs attention weights, which lightgen's decoder does not compute"
    return None


@register_task("translation_lightgen", dataclass=TranslationLightgenConfig)
class TranslationLightgenTask(TranslationTask):
    """``translation`` whose ``build_generator`` accelerates the models (in place) and uses lightgen's
    beam selection, or IAD / GAD for greedy decoding; flags lightgen does not cover keep fairseq's own
    generator (or, for IAD / GAD, plain greedy decoding), with a warning."""

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        args = self._decoding_args(args)
        reason = _unsupported(args)
        if reason is None:
            try:  # all or none: an ensemble runs entirely on one generator
                for model in models:
                    check_supported(model)
            except lightgen.UnsupportedModelError as error:
                reason = str(error)
            else:
                for model in models:
                    lightgen.accelerate_model(model)
        if reason is not None:
            warnings.warn(f"lightgen: {reason}; running fairseq's own generator", RuntimeWarning, stacklevel=2)
        generator = super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                            extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        if reason is None and self.cfg.lightgen_decoding in AGGRESSIVE:
            cfg = self.cfg
            return aggressive_generator(generator, self.source_dictionary, cfg.lightgen_decoding,
                                        cfg.lightgen_block_size, cfg.lightgen_drafter, cfg.lightgen_beta,
                                        cfg.lightgen_tau)
        if reason is None and type(getattr(generator, "search", None)) is search.BeamSearch:
            generator.search = BeamTopkSearch(self.target_dictionary)
        return generator

    def _decoding_args(self, args):
        decoding = self.cfg.lightgen_decoding
        if decoding == "beam":
            return args
        if getattr(args, "sampling", False) and decoding != "sampling":
            raise ValueError(f"--lightgen-decoding {decoding} contradicts --sampling")
        args = copy.deepcopy(args)
        if decoding in ("greedy", *AGGRESSIVE):
            if getattr(args, "nbest", 1) > 1:
                raise ValueError(f"--lightgen-decoding {decoding} returns one hypothesis; got --nbest {args.nbest}")
            args.beam = 1
        else:
            args.sampling = True
        return args
