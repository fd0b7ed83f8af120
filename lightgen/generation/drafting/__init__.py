"""Drafters for generalized aggressive decoding (GAD; Ge et al. 2022, arXiv 2205.10350).

``model.generate(..., decoding="gad", drafter=D, block_size=k)`` takes any of:

- ``NARDrafter``: the paper's non-autoregressive drafter. Its encoder reads the input once per call;
  each iteration its decoder reads the output so far followed by ``k`` mask tokens, bidirectionally,
  and proposes the argmax of every masked slot. ``train_drafter`` distils one from a verifier's own
  greedy outputs (``lightgen train-drafter``);
- a small autoregressive model with the verifier's vocabulary (HF ``assistant_model`` semantics, but
  batched): it decodes ``k`` greedy tokens on lightgen's static cache, rolled back after each draft;
- ``lightgen.drafting.self_drafter(model, quantize="int4")``: the verifier itself with compact linear
  weights, drafting on the verifier's own cache (self-speculative decoding: no second model, no training);
- any callable ``drafter(sources, outputs, block_size) -> list of token lists``, where ``sources``
  and ``outputs`` are the input and the decoder sequence so far of each row still decoding.

The drafter only proposes: the verifier decides, so with ``beta=1`` the output is greedy's whatever
the drafter says.

Layout: ``nar`` (the NAR drafter and its drafting session), ``self_drafter`` (the quantized self-drafter's
shared-cache session; the drafter itself is made in ``lightgen.adapters.self_drafter``), ``sessions``
(binding any drafter to a call), ``training`` (the distillation recipe; its command line is
``lightgen.drafter_cli``).
"""

from lightgen.generation.drafting.nar import CONFIG_NAME, WEIGHTS_NAME, DrafterConfig, NARDrafter
from lightgen.generation.drafting.sessions import start_session
from lightgen.generation.drafting.training import drafter_for, greedy_targets, train_drafter

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "DrafterConfig", "NARDrafter", "drafter_for", "greedy_targets",
           "start_session", "train_drafter"]
