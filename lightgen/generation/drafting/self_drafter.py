"""Drafting with the verifier itself on compact linear weights (self-speculative decoding): the session that binds
such a drafter (``lightgen.adapters.self_drafter.self_drafter`` makes it) to the verifier's own KV cache.

The drafter reads a fraction of the verifier's bytes a token (SmolLM2-135M: 112 MB at int4 against 538 MB) and
agrees with it on most tokens, so a verifier pass checks several of its tokens at once; on the verifier's cache it
needs no prompt pass and no catch-up feeds of its own.
"""

from __future__ import annotations

import copy

import torch

from lightgen import ops
from lightgen.modules.decoder import DECODER_ATTR

# On a self-drafter: a weak reference to the model whose cache it drafts on.
VERIFIER_ATTR = "_lightgen_drafts_for"


def drafts_for(drafter, model) -> bool:
    """``drafter`` is ``self_drafter(model)``: it can draft on ``model``'s cache."""
    verifier = getattr(drafter, VERIFIER_ATTR, None)
    return verifier is not None and verifier() is model


class SharedCacheSession:
    """A self-drafter bound to one generate call: each draft steps its decoder on the verifier's decode state.

    Between passes the verifier's cache holds every token of a row's output but the last (the aggressive loop
    feeds it with the next draft), so a draft feeds that token and then its own guesses, one step each, and rolls
    the positions back: the verifier's next pass writes its own keys and values over every position the drafter
    wrote before it reads them. Its attention reads the verifier's keys and values for the earlier positions
    (and cross-attention the verifier's encoder K/V), so it drafts with no prompt pass of its own.
    """

    def __init__(self, drafter, state) -> None:
        self.decoder = getattr(drafter, DECODER_ATTR)
        self.state = state
        # The draft policy's cost line and acceptance history are this drafter's own (draft_policy._kind).
        self.kind = ("self-drafter", id(self.decoder))
        self.steps_per_token = True  # a draft of K tokens is K decoder steps: the policy prices it per token
        # The drafter's view of the state: the verifier's tensors (re-read each draft: rows that finish leave the
        # verifier's state in new tensors), the drafter's own native plan and step graph.
        self.view = copy.copy(state)
        self.view.native_plan = self.view.step_graph = None

    def draft(self, rows, outputs, sizes):
        block = max(sizes)
        if block <= 0:
            return [[] for _ in rows]
        view = self.view
        view.__dict__.update(self.state.__dict__, native_plan=view.native_plan, step_graph=view.step_graph)
        fed = [len(output) - 1 for output in outputs]
        if view.lengths.tolist() != fed:
            raise RuntimeError(f"self-drafter: the verifier's cache holds {view.lengths.tolist()} positions where "
                               f"the outputs so far need {fed}")
        device = view.lengths.device
        # Drafts of rows near max_length may run into the spare positions past the table: rolled back anyway.
        limit = self.decoder.spec.position_limit - 1
        guess = torch.tensor([output[-1] for output in outputs], device=device)
        drafted = []
        with torch.inference_mode():
            for _ in range(block):
                positions = view.next_position[:, None].clamp(max=limit)
                guess = ops.greedy_tokens(self.decoder.step(view, guess[:, None], positions))
                drafted.append(guess)
            view.roll_back(torch.full_like(view.lengths, block))
        return torch.stack(drafted, 1).tolist()

    def close(self) -> None:
        pass
