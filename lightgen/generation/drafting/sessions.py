"""Drafting sessions: a drafter (NAR, a small AR model, or a callable) bound to one generate call."""

from __future__ import annotations

import torch

from lightgen import ops
from lightgen.generation.drafting.nar import NARDrafter
from lightgen.generation.drafting.self_drafter import SharedCacheSession, drafts_for
from lightgen.generation.tokens import pad_rows
from lightgen.modules.decoder import DECODER_ATTR


class _CallableSession:
    def __init__(self, function, sources: list[list[int]]) -> None:
        self.function, self.sources = function, sources

    def draft(self, rows, outputs, sizes):
        drafts = self.function([self.sources[row] for row in rows], [list(output) for output in outputs], max(sizes))
        return [list(draft) for draft in drafts]

    def close(self) -> None:
        pass


class _AssistantSession:
    """A small AR model drafting ``k`` greedy tokens per row on its own static cache.

    Each draft first feeds the tokens the verifier accepted since the last one (padded across rows,
    padding rolled back), then steps greedily; the drafted tokens are rolled back afterwards, since
    the verifier may reject them.
    """

    def __init__(self, assistant, source_ids, source_mask, max_length: int, max_draft: int) -> None:
        self.decoder = getattr(assistant, DECODER_ATTR)
        self.steps_per_token = True  # a draft of K tokens is about K decoder steps: the policy prices it per token
        embedding = self.decoder.spec.token_embedding
        rows = source_ids.shape[0]
        # Room for the output, the widest catch-up feed (a whole accepted block) and the draft itself.
        start = dict(rows=rows, max_len=max_length, dtype=embedding.dtype, device=embedding.device,
                     spare_positions=2 * max_draft + 2)
        self.live = list(range(rows))
        if assistant.config.is_encoder_decoder:
            with torch.inference_mode():
                hidden = assistant.get_encoder()(input_ids=source_ids, attention_mask=source_mask)[0]
            self.state = self.decoder.start(**start, encoder_hidden=hidden, encoder_mask=source_mask)
            self.fed = [0] * rows
        else:  # the source is the prompt, which the verifier's output starts with
            self.state = self.decoder.start(**start, prompt_mask=source_mask)
            positions = None if source_mask is None else (source_mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                self.decoder.step(self.state, source_ids, positions)
            self.fed = [source_ids.shape[1]] * rows

    def _positions(self, width: int) -> torch.Tensor:
        offsets = torch.arange(width, device=self.state.next_position.device)
        return (self.state.next_position[:, None] + offsets).clamp(max=self.decoder.spec.position_limit - 1)

    def draft(self, rows, outputs, sizes):
        state, decoder = self.state, self.decoder
        if rows != self.live:
            state.keep_rows(torch.tensor([self.live.index(row) for row in rows], device=state.lengths.device))
            self.live = list(rows)
        unseen = [output[self.fed[row]:] for row, output in zip(rows, outputs, strict=True)]
        width, block = max(map(len, unseen)), max(sizes)
        if block <= 0:
            return [[] for _ in rows]
        tokens = pad_rows(unseen, 0, state.lengths.device)
        lengths = torch.tensor([len(row) for row in unseen], device=state.lengths.device)
        with torch.inference_mode():
            logits = decoder.step(state, tokens, self._positions(width), all_positions=True)
            state.roll_back(width - lengths)
            guess = ops.greedy_tokens(logits[torch.arange(len(rows)), lengths - 1])
            drafted = [guess]
            for _ in range(block - 1):
                guess = ops.greedy_tokens(decoder.step(state, guess[:, None], self._positions(1)))
                drafted.append(guess)
            state.roll_back(torch.full_like(lengths, block - 1))
        for row, output in zip(rows, outputs, strict=True):
            self.fed[row] = len(output)
        return torch.stack(drafted, 1).tolist()

    def close(self) -> None:
        self.state.release()


def start_session(drafter, *, sources: list[list[int]], source_ids, source_mask, max_length: int, max_draft: int,
                  encoder_hidden=None, accelerate=None, decoder_only: bool = False, verifier=None, state=None):
    """Bind ``drafter`` (see the module docstring) to one generate call's inputs: ``source_ids`` [N, S] and
    ``source_mask`` are the encoder's input (or, ``decoder_only``, the model's left-padded prompt, which each
    output then starts with), ``sources`` the same without padding, ``encoder_hidden`` the verifier's
    encoder output (encoder-decoder models). A ``self_drafter`` of ``verifier`` drafts on its decode ``state``."""
    from transformers import PreTrainedModel

    if state is not None and drafts_for(drafter, verifier):
        return SharedCacheSession(drafter, state)

    if isinstance(drafter, NARDrafter):
        return drafter.start(sources, encoder_hidden, source_mask if encoder_hidden is not None else None, max_length,
                             prompt_width=source_ids.shape[1] if decoder_only else 0)
    if isinstance(drafter, PreTrainedModel):
        if not hasattr(drafter, DECODER_ATTR):
            if accelerate is None:
                raise ValueError("lightgen generate: the drafter model is not accelerated; call "
                                 "lightgen.accelerate_model on it first")
            accelerate(drafter)
        return _AssistantSession(drafter, source_ids, source_mask, max_length, max_draft)
    if callable(drafter):
        return _CallableSession(drafter, sources)
    raise TypeError(f"lightgen generate: drafter must be a lightgen.drafting.NARDrafter, a Hugging Face model or a "
                    f"callable, got {type(drafter).__name__}")


