"""fairseq's Transformer (``TransformerModel`` and its hub interface) on lightgen's decoder step.

fairseq's ``SequenceGenerator`` drives decoding through two decoder methods: ``forward(tokens,
encoder_out, incremental_state)`` for one step and ``reorder_incremental_state_scripting`` after
each beam selection. Patching exactly those two on the model instance puts lightgen's static-cache
``Decoder`` under every fairseq search (beam, greedy, sampling, diverse beams, prefixes, constraints,
ensembles) while fairseq's own code still makes every decision, so hypotheses and scores are
fairseq's. The decoding state lives in the ``incremental_state`` dict fairseq creates per
``generate`` call, so concurrent calls and ensemble members never share one. The encoder keeps
fairseq's forward (prefill gains nothing from the decode kernels).

Greedy decoding can also run as aggressive decoding (``AggressiveGenerator``; the plugin's
``--lightgen-decoding iad|gad``, or ``hub.translate(..., beam=1, lightgen_decoding="iad")``): there
lightgen runs the loop (``generation.aggressive.aggressive_greedy``) with drafts copied from the source
(IAD) or proposed by a ``NARDrafter`` (GAD), and applies greedy's rules to every verified position, so
hypotheses and scores are still fairseq's (GAD++, ``beta > 1``, relaxes greedy's choice by design).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightgen._compat import check_fairseq_version
from lightgen.adapters.base import UnsupportedModelError
from lightgen.generation.aggressive import GREEDY, Acceptance, CopyFromInput, aggressive_greedy
from lightgen.memory import cached_cpu_memory
from lightgen.modules.block import BlockSpec
from lightgen.modules.decoder import AttentionWeights, DecodeState, Decoder, DecoderLayerWeights, DecoderSpec

check_fairseq_version()

from fairseq import search  # noqa: E402
from fairseq.hub_utils import GeneratorHubInterface  # noqa: E402
from fairseq.models.transformer import TransformerDecoderBase  # noqa: E402
from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding  # noqa: E402
from fairseq.modules import gelu as fairseq_gelu  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

logger = logging.getLogger(__name__)

STATE_KEY = "lightgen"  # our entry in fairseq's per-call incremental_state dict
FIRST_CACHE_LEN = 64  # positions; the cache doubles when an output grows past it

# fairseq activation functions -> lightgen's fused bias+activation; others run fairseq's function.
_ACTIVATIONS = {F.relu: "relu", fairseq_gelu: "gelu"}


def allow_fairseq_checkpoints() -> None:
    """fairseq checkpoints pickle ``argparse.Namespace``; torch >= 2.6 loads with ``weights_only=True``.
    Allow exactly that class, not unsafe loading."""
    torch.serialization.add_safe_globals([argparse.Namespace])


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise UnsupportedModelError(f"lightgen cannot accelerate this fairseq decoder: {what}")


def _attention(mha) -> AttentionWeights:
    _require(mha.bias_k is None and mha.bias_v is None and not mha.add_zero_attn,
             "attention with bias_kv or add_zero_attn")
    return AttentionWeights(mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj, mha.num_heads, mha.num_heads,
                            mha.head_dim, mha.scaling)


def _check_norm(module) -> None:
    # Subclasses (Fp32LayerNorm, FusedLayerNorm) compute differently from nn.LayerNorm.
    _require(module is None or type(module) is nn.LayerNorm, f"norm of type {type(module).__name__}")


def _check_layer(layer, pre_norm: bool) -> None:
    _require(layer.encoder_attn is not None, "a decoder layer without encoder attention")
    _require(not layer.cross_self_attention, "cross_self_attention")
    for extra in ("attn_ln", "c_attn", "ffn_layernorm", "w_resid"):
        _require(getattr(layer, extra, None) is None, f"decoder layers with '{extra}' (scale_attn/heads/fc/resids)")
    _require(layer.normalize_before == pre_norm, "layers that mix pre- and post-norm")
    _require(type(layer.fc1) is nn.Linear and type(layer.fc2) is nn.Linear, "quantized or replaced fc1/fc2")
    for norm in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm):
        _check_norm(norm)


def check_decoder(decoder) -> None:
    """Raise ``UnsupportedModelError`` naming the first feature the decoder step does not implement."""
    _require(isinstance(decoder, TransformerDecoderBase), f"decoder of type {type(decoder).__name__}")
    _require(decoder.adaptive_softmax is None, "adaptive softmax")
    _require(decoder.project_in_dim is None and decoder.project_out_dim is None, "decoder input/output projections")
    _require(decoder.quant_noise is None, "quant-noise embeddings")
    _require(not decoder.cross_self_attention, "cross_self_attention")
    _require(decoder.output_projection.bias is None, "an output projection with a bias")
    positions = decoder.embed_positions
    _require(positions is None or type(positions) in (SinusoidalPositionalEmbedding, LearnedPositionalEmbedding),
             f"positions of type {type(positions).__name__}")
    _require(len(decoder.layers) > 0, "no decoder layers")
    _check_norm(decoder.layernorm_embedding)
    _check_norm(decoder.layer_norm)
    for layer in decoder.layers:
        _check_layer(layer, decoder.layers[0].normalize_before)
        _attention(layer.self_attn)
        _attention(layer.encoder_attn)


def build_decoder(decoder) -> Decoder:
    """The decoder's own modules and tensors mapped onto lightgen's spec (no copies).

    Built per ``generate`` call: the sinusoidal table is a buffer, which ``.to()`` replaces."""
    first = decoder.layers[0]
    block = BlockSpec(pre_norm=first.normalize_before, act=_ACTIVATIONS.get(first.activation_fn), ffn_in=("fc1",),
                      ffn_out="fc2", act_module="activation_fn")
    layers = tuple(
        DecoderLayerWeights(self_attn=_attention(layer.self_attn), self_norm=layer.self_attn_layer_norm,
                            ffn_owner=layer, ffn_norm=layer.final_layer_norm,
                            cross_attn=_attention(layer.encoder_attn), cross_norm=layer.encoder_attn_layer_norm)
        for layer in decoder.layers
    )
    positions = decoder.embed_positions
    table = None
    if isinstance(positions, SinusoidalPositionalEmbedding):
        table = positions.weights
    elif positions is not None:
        table = positions.weight
    return Decoder(DecoderSpec(
        block=block, layers=layers, token_embedding=decoder.embed_tokens.weight,
        lm_head=decoder.output_projection, embed_scale=float(decoder.embed_scale), position_table=table,
        # fairseq numbers the token at index t padding_idx + 1 + t.
        position_offset=decoder.padding_idx + 1,
        embedding_norm=decoder.layernorm_embedding, final_norm=decoder.layer_norm,
    ))


class _StateHolder:
    """Owns one call's ``DecodeState``; fairseq drops the incremental_state dict when ``generate``
    returns, and the pooled buffers go back with it."""

    def __init__(self, decoder: Decoder, state) -> None:
        self.decoder = decoder
        self.state = state

    def __del__(self) -> None:
        self.state.release()


def start_decoding(decoder_module, rows: int, encoder_out, max_len: int | None = None,
                   spare_positions: int = 0) -> tuple[Decoder, DecodeState]:
    """lightgen's decoder for a fairseq decoder, and a state for ``rows`` rows (one per sentence) over
    fairseq's encoder output; ``max_len`` positions, or without it a first cache that grows by doubling."""
    _require(encoder_out is not None and len(encoder_out["encoder_out"]) > 0, "decoding without encoder output")
    encoder_hidden = encoder_out["encoder_out"][0].transpose(0, 1)  # fairseq keeps [S, N, E]
    padding = encoder_out["encoder_padding_mask"]
    keep = ~padding[0] if len(padding) > 0 else None
    decoder = build_decoder(decoder_module)
    weight = decoder.spec.token_embedding
    state = decoder.start(rows=rows, max_len=max_len or min(FIRST_CACHE_LEN, decoder.spec.position_limit),
                          dtype=weight.dtype, device=weight.device, encoder_hidden=encoder_hidden,
                          encoder_mask=keep, spare_positions=spare_positions)
    return decoder, state


def _fast_path(decoder_module, incremental_state, flags) -> bool:
    if incremental_state is None or any(flags):
        return False
    holder = incremental_state.get(STATE_KEY)
    inference = not decoder_module.training and not torch.is_grad_enabled()
    if holder is not None and not inference:
        raise RuntimeError("lightgen: a fairseq decoding started in inference mode continued with autograd or "
                           "training enabled")
    # An incremental_state fairseq's own layers already fill stays theirs.
    return inference and (holder is not None or not incremental_state)


def decoder_forward(decoder_module, prev_output_tokens, encoder_out=None, incremental_state=None,
                    features_only=False, full_context_alignment=False, alignment_layer=None, alignment_heads=None,
                    src_lengths=None, return_all_hiddens=False):
    """fairseq ``TransformerDecoder.forward``; one incremental inference step runs on lightgen."""
    flags = (features_only, full_context_alignment, alignment_layer is not None, alignment_heads is not None,
             return_all_hiddens)
    if not _fast_path(decoder_module, incremental_state, flags):
        return decoder_module._lightgen_forward(
            prev_output_tokens, encoder_out=encoder_out, incremental_state=incremental_state,
            features_only=features_only, full_context_alignment=full_context_alignment,
            alignment_layer=alignment_layer, alignment_heads=alignment_heads, src_lengths=src_lengths,
            return_all_hiddens=return_all_hiddens)
    holder = incremental_state.get(STATE_KEY)
    if holder is None:
        holder = incremental_state[STATE_KEY] = _StateHolder(
            *start_decoding(decoder_module, prev_output_tokens.shape[0], encoder_out))
    decoder, state = holder.decoder, holder.state
    rows, length = prev_output_tokens.shape
    if state.cache.length != length - 1 or state.cache.rows != rows:
        raise RuntimeError(f"lightgen: fairseq decoder step got {rows} x {length} tokens but its incremental state "
                           f"holds {state.cache.rows} rows x {state.cache.length} positions")
    if state.cache.length == state.cache.max_len:
        state.cache.grow(min(2 * state.cache.max_len, decoder.spec.position_limit))
    # Like fairseq's incremental step, only the newest token is fed; earlier ones are in the cache.
    logits = decoder.step(state, prev_output_tokens[:, -1:])
    return logits[:, None, :], {"attn": [None], "inner_states": None}


def decoder_reorder(decoder_module, incremental_state, new_order):
    """fairseq ``reorder_incremental_state_scripting``: beam reordering and finished sentences leaving.

    Cross-attention K/V are selected only when rows leave: beams of one sentence share them,
    the same shortcut fairseq's MultiheadAttention takes."""
    holder = incremental_state.get(STATE_KEY) if incremental_state is not None else None
    if holder is None:
        return decoder_module._lightgen_reorder(incremental_state, new_order)
    state = holder.state
    if new_order.numel() == state.cache.rows:
        state.reorder(new_order)
    else:
        state.keep_rows(new_order)
    return incremental_state


def models_of(obj) -> list[nn.Module]:
    """The fairseq models behind ``obj``: a hub interface's ensemble, or the model itself."""
    if isinstance(obj, GeneratorHubInterface):
        return list(obj.models)
    _require(isinstance(getattr(obj, "decoder", None), nn.Module),
             f"{type(obj).__name__} has no decoder (expected a TransformerModel or its hub interface)")
    return [obj]


def check_supported(obj) -> list[nn.Module]:
    """The fairseq models behind ``obj``, each checked; raises ``UnsupportedModelError`` otherwise."""
    models = models_of(obj)
    for model in models:
        check_decoder(model.decoder)
    return models


def patch_fairseq(obj, patcher) -> None:
    """Check every model first (nothing is patched when one is unsupported), then patch them."""
    for model in check_supported(obj):
        decoder = model.decoder
        patcher.set(decoder, "_lightgen_forward", decoder.forward)
        patcher.set(decoder, "_lightgen_reorder", decoder.reorder_incremental_state_scripting)
        patcher.set(decoder, "forward", decoder_forward.__get__(decoder))
        patcher.set(decoder, "reorder_incremental_state_scripting", decoder_reorder.__get__(decoder))
        patcher.patched.append(f"{type(model).__name__}.decoder: incremental steps on lightgen's static-cache decoder")
    if isinstance(obj, GeneratorHubInterface):
        task = obj.task
        patcher.set(task, "_lightgen_build_generator", task.build_generator)
        patcher.set(task, "build_generator", _hub_build_generator.__get__(task))
        patcher.patched.append(f"{type(task).__name__}.build_generator: lightgen_decoding='iad'|'gad' runs aggressive "
                               f"decoding")


AGGRESSIVE_SETTINGS = dict(lightgen_block_size=16, lightgen_drafter=None, lightgen_beta=1, lightgen_tau=0.0)


def _hub_build_generator(task, models, args, **kwargs):
    """The hub task's ``build_generator``; ``hub.translate(..., lightgen_decoding="iad"|"gad")`` (with
    ``lightgen_block_size``, ``lightgen_drafter``, ``lightgen_beta``, ``lightgen_tau`` as the plugin's
    flags) returns an ``AggressiveGenerator`` over it."""
    generator = task._lightgen_build_generator(models, args, **kwargs)
    decoding = getattr(args, "lightgen_decoding", None) or "beam"
    if decoding == "beam":
        return generator
    if decoding not in ("iad", "gad"):
        raise ValueError(f"lightgen_decoding must be 'beam', 'iad' or 'gad' here, got {decoding!r}")
    if getattr(args, "beam", None) != 1:
        raise ValueError(f"lightgen_decoding={decoding!r} is greedy decoding: pass beam=1")
    settings = {name: getattr(args, name, default) for name, default in AGGRESSIVE_SETTINGS.items()}
    return aggressive_generator(generator, task.source_dictionary, decoding, **settings)


def encoder_for_drafting(model):
    """``model``'s encoder as ``lightgen.drafting.train_drafter`` calls a verifier's (``verifier_encoder``):
    right-padded ids [B, S] and their mask -> ([B, S, E],), so a drafter learns from this model's encoder
    output, which GAD gives it at generation time."""
    def encode(input_ids, attention_mask):
        out = model.encoder(input_ids, src_lengths=attention_mask.sum(-1))
        return (out["encoder_out"][0].transpose(0, 1),)
    return encode


def _load_drafter(folder):
    """A drafter folder, loaded once while its weights file is unchanged: fairseq builds a generator for
    every ``hub.translate`` call, and a config (omegaconf) can only name the drafter by its folder."""
    from lightgen.drafting import WEIGHTS_NAME

    weights = Path(folder).resolve() / WEIGHTS_NAME
    return _load_drafter_version(str(weights.parent), weights.stat().st_mtime_ns if weights.is_file() else None)


@functools.lru_cache(maxsize=4)
def _load_drafter_version(folder: str, _version):
    from lightgen.drafting import NARDrafter

    return NARDrafter.from_pretrained(folder)


def aggressive_generator(generator, src_dict, decoding: str, lightgen_block_size: int = 16,
                         lightgen_drafter=None, lightgen_beta: int = 1, lightgen_tau: float = 0.0):
    """``generator`` (fairseq greedy) as IAD or GAD when they can reproduce it, else ``generator`` itself
    with a warning saying why. GAD needs ``lightgen_drafter``: a ``NARDrafter`` or its folder."""
    from lightgen.drafting import NARDrafter

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
    try:
        check_decoder(generator.model.single_model.decoder)
    except UnsupportedModelError as error:
        return str(error)
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
    ``drafter`` (a ``lightgen.drafting.NARDrafter`` for this model's target vocabulary, reading its encoder
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
        if gen.min_len > max_len:
            raise ValueError("min_len cannot be larger than max_len, please adjust these!")
        encoder_out = gen.model.forward_encoder(net_input)[0]
        # Fed tokens: BOS and up to max_len outputs (the last EOS is never fed); drafts pad up to block_size.
        decoder, state = start_decoding(gen.model.single_model.decoder, rows, encoder_out, max_len + 1,
                                        self.block_size)
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
