"""The paper's non-autoregressive drafter (``NARDrafter``), its kernel-backed drafting layers and its
drafting session: one generate call's sources encoded once, each draft filling ``block`` mask tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightgen import ops
from lightgen.generation.tokens import pad_rows, padding_mask
from lightgen.memory import WeightArena

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "drafter.safetensors"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int  # the verifier's; one more embedding row is the mask token
    pad_token_id: int
    d_model: int = 256
    heads: int = 4
    ffn_dim: int = 768
    encoder_layers: int = 0  # 0: read the verifier's own encoder output (encoder-decoder verifiers)
    decoder_layers: int = 2
    max_positions: int = 256
    max_block_size: int = 16  # the most mask tokens it was trained to fill at once
    # True: output tokens attend only to earlier output tokens (mask tokens still attend to everything), so
    # drafting keeps their keys and values and each draft runs only the new tokens and the masks.
    causal_prefix: bool = False


class NARDrafter(nn.Module):
    """A small Transformer (pre-LN) whose decoder attends in both directions: it fills mask tokens.

    With ``encoder_layers=0`` it has no encoder of its own and cross-attends to the verifier's
    encoder output, which generation computes anyway: no second encoding pass per call (the paper
    measured 16% of GAD++'s time in sequential encoding), and a representation already trained.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        # Weights drafting reads (see ``drafting_layers``): int8 keeps the demo drafter's acceptance (3.05
        # tokens per pass either way) at a quarter of the bytes, which the verifier then finds still cached.
        self.drafting_precision: str | None = "int8"
        self.mask_token_id = config.vocab_size
        self.tokens = nn.Embedding(config.vocab_size + 1, config.d_model, padding_idx=config.pad_token_id)
        self.target_positions = nn.Embedding(config.max_positions, config.d_model)

        def layer(kind):
            return kind(config.d_model, config.heads, config.ffn_dim, dropout=0.0, activation="gelu",
                        batch_first=True, norm_first=True)

        self.source_positions = self.encoder = None
        if config.encoder_layers:
            self.source_positions = nn.Embedding(config.max_positions, config.d_model)
            self.encoder = nn.TransformerEncoder(layer(nn.TransformerEncoderLayer), config.encoder_layers,
                                                 norm=nn.LayerNorm(config.d_model), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(layer(nn.TransformerDecoderLayer), config.decoder_layers,
                                             norm=nn.LayerNorm(config.d_model))
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # nn.Embedding's N(0, 1) would drown the tokens in position noise; BART's init instead.
        for table in (self.tokens, self.source_positions, self.target_positions):
            if table is not None:
                nn.init.normal_(table.weight, std=0.02)

    def encode(self, source: torch.Tensor, source_pad: torch.Tensor, verifier_encoder=None) -> torch.Tensor:
        """source [B, S] ids, source_pad [B, S] True at padding -> [B, S, E]; without an encoder of
        its own, ``verifier_encoder`` (the verifier's ``get_encoder()``) computes it, without gradients."""
        if self.encoder is None:
            if verifier_encoder is None:
                raise ValueError("this drafter reads the verifier's encoder output: pass verifier_encoder")
            with torch.no_grad():
                return verifier_encoder(input_ids=source, attention_mask=(~source_pad).long())[0].float()
        positions = torch.arange(source.shape[1], device=source.device)
        return self.encoder(self.tokens(source) + self.source_positions(positions), src_key_padding_mask=source_pad)

    def decode(self, memory, source_pad, target: torch.Tensor, target_pad: torch.Tensor) -> torch.Tensor:
        """target [B, T] (output so far, then mask tokens) -> logits [M, V] of its M mask tokens, row by
        row; no causal mask (``causal_prefix``: over the output so far only)."""
        positions = torch.arange(target.shape[1], device=target.device)
        blocked = None
        if self.config.causal_prefix:
            is_mask = target == self.mask_token_id
            blocked = _prefix_blocked(is_mask.int().argmax(1), target.shape[1]).repeat_interleave(
                self.config.heads, dim=0)
        hidden = self.decoder(self.tokens(target) + self.target_positions(positions), memory, tgt_mask=blocked,
                              tgt_key_padding_mask=target_pad, memory_key_padding_mask=source_pad)
        return self.head(hidden[target == self.mask_token_id])

    def drafting_layers(self) -> "_DraftingLayers | None":
        """The decoder as drafting runs it on lightgen's kernels (float32 CPU weights; linear layers in
        ``drafting_precision``: "int8", "bf16" or None for float32), made again when a Parameter changed since
        (training, ``load_state_dict``); None where the kernels do not apply. The drafter only proposes
        tokens, so its precision never changes greedy's output (GAD++'s may differ: it keeps near-best drafts)."""
        parameters = list(self.parameters())
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in parameters):
            return None
        signature = (self.drafting_precision, *((p._version, p.data_ptr()) for p in parameters))
        layers = self.__dict__.get("_drafting_layers")
        if layers is None or layers.signature != signature:
            layers = _DraftingLayers(self, signature)
            self.__dict__["_drafting_layers"] = layers
        return layers

    def start(self, sources: list[list[int]], encoder_hidden=None, encoder_mask=None,
              max_length: int | None = None, prompt_width: int = 0) -> "_NARSession":
        """Bind to one call's inputs; ``encoder_hidden`` [N, S, E] (+ ``encoder_mask``) is the verifier's
        encoder output, which a drafter without its own encoder reads instead of ``sources``;
        ``max_length``: the longest output (sizes the ``causal_prefix`` cache); ``prompt_width``: a
        decoder-only verifier's outputs start with its padded prompt, this wide, which the drafter's
        encoder reads (as ``sources``) and its decoder does not: it sees the continuation only, as
        ``greedy_targets`` trains it, whatever the batch's padding."""
        return _NARSession(self, sources, encoder_hidden, encoder_mask, max_length, prompt_width)

    def save_pretrained(self, directory) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(dataclasses.asdict(self.config), indent=2) + "\n")
        save_file({name: tensor.detach().half().contiguous() for name, tensor in self.state_dict().items()},
                  directory / WEIGHTS_NAME)

    @classmethod
    def from_pretrained(cls, directory, dtype=torch.float32) -> "NARDrafter":
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}: not a lightgen drafter folder")
        drafter = cls(DrafterConfig(**json.loads((directory / CONFIG_NAME).read_text())))
        state = {name: tensor.to(dtype) for name, tensor in load_file(directory / WEIGHTS_NAME).items()}
        drafter.load_state_dict(state)
        return drafter.to(dtype).eval()


class _DraftingLayers:
    """``NARDrafter.decode`` for drafting, without autograd or nn.TransformerDecoder's per-call work:
    every linear layer on packed weights (``ops.linear``, GELU fused), residual adds fused into the
    LayerNorms, attention by SDPA, and the cross-attention K/V of a call's encoder output computed
    once per call (``cross_keys_values``) instead of once per draft."""

    def __init__(self, drafter: NARDrafter, signature) -> None:
        from lightgen.modules.linear import packed_weights

        arena = WeightArena()

        def packed(weight, bias):
            weights = packed_weights(weight, drafter.drafting_precision, arena=arena)
            return weights, None if bias is None else bias.detach()

        self.signature = signature
        self.heads = drafter.config.heads
        self.tokens = drafter.tokens.weight.detach()
        self.positions = drafter.target_positions.weight.detach()
        self.layers = []
        for layer in drafter.decoder.layers:
            width = layer.multihead_attn.embed_dim
            cross_weight, cross_bias = layer.multihead_attn.in_proj_weight, layer.multihead_attn.in_proj_bias
            self.layers.append(dict(
                norms=[(norm.weight.detach(), norm.bias.detach(), norm.eps)
                       for norm in (layer.norm1, layer.norm2, layer.norm3)],
                self_in=packed(layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias),
                self_out=packed(layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias),
                cross_q=packed(cross_weight[:width], cross_bias[:width]),
                cross_kv=(cross_weight[width:].detach(), cross_bias[width:].detach()),
                cross_out=packed(layer.multihead_attn.out_proj.weight, layer.multihead_attn.out_proj.bias),
                up=packed(layer.linear1.weight, layer.linear1.bias),
                down=packed(layer.linear2.weight, layer.linear2.bias),
            ))
        final = drafter.decoder.norm
        self.final_norm = (final.weight.detach(), final.bias.detach(), final.eps)
        self.head = packed(drafter.head.weight, drafter.head.bias)
        self.mask_token_id = drafter.mask_token_id

    def _split_heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        rows, width = x.shape[0], x.shape[1]
        return x.view(rows, width, parts, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def cross_keys_values(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """memory [N, S, E] -> per layer (K, V) [N, H, S, E/H]."""
        return [self._split_heads(F.linear(memory, *layer["cross_kv"]), 2) for layer in self.layers]

    def decode(self, cross, source_keep: torch.Tensor, target: torch.Tensor, target_pad: torch.Tensor):
        """As ``NARDrafter.decode`` for a drafter without ``causal_prefix``; ``cross`` from
        ``cross_keys_values``, ``source_keep`` [B, S] True at real source tokens."""
        self_mask = ~target_pad[:, None, None, :]

        def attend(_, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask)

        return self._layers(target, torch.arange(target.shape[1]), cross, source_keep, attend)

    def decode_cached(self, cache: "_PrefixCache", index: torch.Tensor, new_counts: torch.Tensor, cross,
                      source_keep: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A ``causal_prefix`` drafter's decode from a cache of the output so far: ``target`` [R, W] is each
        row's output tokens not yet cached (``new_counts`` [R] of them) then its mask tokens, padded;
        ``index`` [R]: the rows' cache rows. The new output tokens' keys and values join the cache."""
        filled = cache.filled[index]
        width = target.shape[1]
        positions = (filled[:, None] + torch.arange(width)).clamp(max=self.positions.shape[0] - 1)  # padding too
        cached_width = int(filled.max())
        real = torch.arange(width) < (new_counts + (target == self.mask_token_id).sum(1))[:, None]
        new_allowed = ~_prefix_blocked(new_counts, width) & real[:, None, :]
        allowed = torch.cat([(torch.arange(cached_width) < filled[:, None])[:, None, :].expand(-1, width, -1),
                             new_allowed], dim=2)[:, None]
        rows, slots = (torch.arange(width) < new_counts[:, None]).nonzero(as_tuple=True)

        def attend(layer, q, k, v):
            keys, values = cache.keys[layer], cache.values[layer]
            # Read the cached part before writing this call's new tokens into it.
            all_keys = torch.cat([keys[index, :, :cached_width], k], dim=2)
            all_values = torch.cat([values[index, :, :cached_width], v], dim=2)
            keys[index[rows], :, filled[rows] + slots] = k[rows, :, slots]
            values[index[rows], :, filled[rows] + slots] = v[rows, :, slots]
            return F.scaled_dot_product_attention(q, all_keys, all_values, attn_mask=allowed)

        logits = self._layers(target, positions, cross, source_keep, attend)
        cache.filled[index] += new_counts
        return logits

    def _layers(self, target, positions, cross, source_keep, attend) -> torch.Tensor:
        """Mask-token logits of ``target``; ``attend(layer, q, k, v)`` is the self-attention."""
        x = F.embedding(target, self.tokens) + F.embedding(positions, self.positions)
        cross_mask = source_keep[:, None, None, :]
        h = ops.layer_norm(x, *self.layers[0]["norms"][0])
        for index, (layer, (keys, values)) in enumerate(zip(self.layers, cross, strict=True)):
            q, k, v = self._split_heads(_run(layer["self_in"], h), 3)
            attended = attend(index, q, k, v)
            x, h = ops.add_layer_norm(_run(layer["self_out"], _merge_heads(attended)), x, *layer["norms"][1])
            q, = self._split_heads(_run(layer["cross_q"], h), 1)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=cross_mask)
            x, h = ops.add_layer_norm(_run(layer["cross_out"], _merge_heads(attended)), x, *layer["norms"][2])
            # The next layer's first LayerNorm (the final one after the last layer) takes the residual add.
            following = self.layers[index + 1]["norms"][0] if index + 1 < len(self.layers) else self.final_norm
            x, h = ops.add_layer_norm(_run(layer["down"], _run(layer["up"], h, "gelu")), x, *following)
        return _run(self.head, h[target == self.mask_token_id])


class _PrefixCache:
    """Per layer, the keys and values of each row's output tokens drafted from so far (``causal_prefix``
    drafters: they never change, and the verifier only ever appends to the output)."""

    def __init__(self, layers: int, rows: int, heads: int, length: int, head_dim: int) -> None:
        self.keys = [torch.zeros(rows, heads, length, head_dim) for _ in range(layers)]
        self.values = [torch.zeros(rows, heads, length, head_dim) for _ in range(layers)]
        self.filled = torch.zeros(rows, dtype=torch.long)
        self.length = length


def _prefix_blocked(prefix_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, width] True where a query may not attend, for rows laid out as output tokens (the first
    ``prefix_lengths``) then mask tokens: an output token sees only itself and earlier output tokens."""
    position = torch.arange(width, device=prefix_lengths.device)
    query_in_prefix = position[None, :, None] < prefix_lengths[:, None, None]
    key_in_prefix = position[None, None, :] < prefix_lengths[:, None, None]
    key_later = position[None, None, :] > position[None, :, None]
    return query_in_prefix & (~key_in_prefix | key_later)


def _run(weights, x: torch.Tensor, act: str = "none") -> torch.Tensor:
    packed, bias = weights
    return packed.run(x, bias, act)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H * D]."""
    return x.transpose(1, 2).flatten(2)




class _NARSession:
    """One generate call: sources encoded once; each draft reruns the small decoder over the output (a
    ``causal_prefix`` drafter on lightgen's kernels: over the tokens added since its last draft only)."""

    def __init__(self, drafter: NARDrafter, sources: list[list[int]], encoder_hidden, encoder_mask,
                 max_length: int | None, prompt_width: int = 0) -> None:
        config = drafter.config
        device = drafter.head.weight.device
        self.drafter, self.prompt_width = drafter, prompt_width
        if drafter.encoder is None:
            if encoder_hidden is None or encoder_hidden.shape[-1] != config.d_model:
                raise ValueError(f"this drafter reads the verifier's encoder output (width {config.d_model}): it "
                                 f"drafts for encoder-decoder verifiers of that width only")
            self._memory = encoder_hidden.to(drafter.head.weight.dtype)
            self.source_pad = (torch.zeros(encoder_hidden.shape[:2], dtype=torch.bool, device=device)
                               if encoder_mask is None else ~encoder_mask.bool())
        else:
            sources = [row[:config.max_positions] or [config.pad_token_id] for row in sources]
            self._source = pad_rows(sources, config.pad_token_id, device)
            self.source_pad = padding_mask(sources, device)
            self._memory = None
        self._max_length = max_length
        # What drafting needs beyond the call's inputs is made at the first draft (``_prepare``): a call whose
        # policy never drafts (drafts that do not pay) skips it (demo model, batch 8, interleaved with greedy: the
        # cross K/V, GAD 0.90 -> 1.00x greedy's speed; the kernels' layers, a walk over the drafter's parameters: a
        # session started in 80 instead of 9 us).
        self.layers: _DraftingLayers | None = None
        self.cache: _PrefixCache | None = None
        self._prepared = False
        self._selected_rows: list[int] | None = None
        self._cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def memory(self) -> torch.Tensor:
        """The encoder side the drafter attends to: the verifier's encoder output or the drafter's own encoding."""
        if self._memory is None:
            with torch.inference_mode():
                self._memory = self.drafter.encode(self._source, self.source_pad)
        return self._memory

    def _prepare(self) -> None:
        """The drafter's decoder on the kernels (``layers``), the cross-attention K/V of the call's encoder side and,
        for a ``causal_prefix`` drafter, its cache."""
        if self._prepared:
            return
        self._prepared = True
        config = self.drafter.config
        self.layers = self.drafter.drafting_layers()
        if self.layers is None:
            return
        with torch.inference_mode():
            self._cross = self.layers.cross_keys_values(self.memory)
        if config.causal_prefix:
            length = min(config.max_positions, self._max_length or config.max_positions)
            self.cache = _PrefixCache(config.decoder_layers, self.source_pad.shape[0], config.heads, length,
                                      config.d_model // config.heads)

    def draft(self, rows, outputs, sizes):
        config, drafter = self.drafter.config, self.drafter
        block = min(max(sizes), config.max_block_size)
        if block <= 0:
            return [[] for _ in rows]
        if self.prompt_width:
            outputs = [output[self.prompt_width:] for output in outputs]
        self._prepare()
        if self.cache is not None:
            return self._draft_cached(rows, outputs, block)
        context = config.max_positions - block  # longer outputs draft from their most recent tokens
        targets = [output[-context:] + [drafter.mask_token_id] * block for output in outputs]
        target = pad_rows(targets, config.pad_token_id, self.source_pad.device)
        target_pad = padding_mask(targets, self.source_pad.device)
        with torch.inference_mode():
            index, memory, source_keep = self._rows(rows)
            if self.layers is None:
                logits = drafter.decode(memory, ~source_keep, target, target_pad)
            else:
                logits = self.layers.decode(memory, source_keep, target, target_pad)
        return ops.greedy_tokens(logits).view(len(rows), block).tolist()

    def _rows(self, rows: list[int]):
        """(index, encoder side, source_keep) of ``rows``: the encoder output (module path) or the
        cross-attention K/V (kernels), selected again only when the rows change (rows finish) rather than
        on every pass."""
        if rows != self._selected_rows:
            index = torch.tensor(rows, device=self.source_pad.device)
            memory = (self.memory.index_select(0, index) if self.layers is None else
                      [(keys.index_select(0, index), values.index_select(0, index)) for keys, values in self._cross])
            self._selected_rows, self._selected = list(rows), (index, memory, ~self.source_pad.index_select(0, index))
        return self._selected

    def _draft_cached(self, rows, outputs, block):
        """Rows whose output would outgrow the cache stop drafting (the verifier goes on alone)."""
        filled = self.cache.filled.tolist()
        fits = [slot for slot, (row, output) in enumerate(zip(rows, outputs, strict=True))
                if len(output) + block <= self.cache.length]
        drafts = [[] for _ in rows]
        if not fits:
            return drafts
        new = [outputs[slot][filled[rows[slot]]:] for slot in fits]
        target = pad_rows([tokens + [self.drafter.mask_token_id] * block for tokens in new],
                          self.drafter.config.pad_token_id)
        with torch.inference_mode():
            index, cross, source_keep = self._rows([rows[slot] for slot in fits])
            logits = self.layers.decode_cached(self.cache, index, torch.tensor(list(map(len, new))), cross,
                                               source_keep, target)
        for slot, draft in zip(fits, ops.greedy_tokens(logits).view(len(fits), block).tolist(), strict=True):
            drafts[slot] = draft
        return drafts

    def close(self) -> None:
        pass


