"""A fairseq translation checkpoint behind the serving core: its hub interface, accelerated by lightgen,
answering the core's ``generate`` calls (HF argument names) with fairseq's own generator and settings,
and its tokenizer/BPE as the core's tokenizer."""

from __future__ import annotations

import types
from pathlib import Path

import torch


def load_fairseq_checkpoint(checkpoint: Path, data_dir: Path | None = None, accelerate: bool = True):
    """``checkpoint`` (a fairseq ``.pt`` file) and its dictionaries (``dict.<lang>.txt`` in ``data_dir``,
    default: the checkpoint's folder) -> (model, tokenizer) for ``serving.core.Generator``."""
    from fairseq.models.transformer import TransformerModel

    import lightgen
    from lightgen.adapters.fairseq import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    data_dir = Path(data_dir) if data_dir is not None else checkpoint.parent
    if not any(data_dir.glob("dict.*.txt")):
        raise FileNotFoundError(f"no fairseq dictionaries (dict.*.txt) in {data_dir}: give the data folder the "
                                f"checkpoint was trained on (--fairseq-data)")
    hub = TransformerModel.from_pretrained(str(checkpoint.parent), checkpoint_file=checkpoint.name,
                                           data_name_or_path=str(data_dir.resolve()))
    hub.eval()
    if accelerate:
        lightgen.accelerate_model(hub)
    return FairseqSeq2Seq(hub), FairseqTokenizer(hub)


class FairseqSeq2Seq:
    """What the serving core reads from a HF model (``config``, ``generation_config``, ``generate``), for a
    fairseq hub interface. ``generate`` returns HF's layout: [rows, 1 + longest], the start token (EOS, as
    fairseq starts decoding) then each row's best hypothesis, padded."""

    def __init__(self, hub) -> None:
        self.hub = hub
        model = hub.models[0]
        tgt_dict = hub.task.target_dictionary
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.config = types.SimpleNamespace(
            model_type="fairseq-transformer", is_encoder_decoder=True, vocab_size=len(hub.task.source_dictionary),
            max_position_embeddings=min(model.max_positions()), pad_token_id=self.pad)
        self.generation_config = types.SimpleNamespace(pad_token_id=self.pad, eos_token_id=self.eos, max_length=None)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, num_beams: int = 1,
                 do_sample: bool = False, top_k: int | None = None, top_p: float | None = None,
                 temperature: float | None = None, decoding: str = "auto", max_draft: int | None = None, drafter=None,
                 block_size: int = 8, beta: int = 1, tau: float = 0.0) -> torch.Tensor:
        # fairseq's limit excludes the final EOS; HF's max_new_tokens counts it.
        settings = dict(beam=num_beams, max_len_a=0, max_len_b=max_new_tokens - 1, sampling=do_sample,
                        sampling_topk=top_k or -1, sampling_topp=top_p or -1.0, temperature=temperature or 1.0)
        if decoding == "iad":
            settings.update(lightgen_decoding="iad")
            if max_draft is not None:  # else the plugin's default block size
                settings.update(lightgen_block_size=max_draft)
        elif decoding == "gad":
            settings.update(lightgen_decoding="gad", lightgen_drafter=str(drafter), lightgen_block_size=block_size,
                            lightgen_beta=beta, lightgen_tau=tau)
        sources = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask, strict=True)]
        hypotheses = self.hub.generate(sources, **settings)
        outputs = [hypos[0]["tokens"].cpu() for hypos in hypotheses]
        out = torch.full((len(outputs), 1 + max(map(len, outputs))), self.pad, dtype=torch.long)
        out[:, 0] = self.eos
        for row, tokens in enumerate(outputs):
            out[row, 1:1 + len(tokens)] = tokens
        return out


class FairseqTokenizer:
    """The hub's tokenizer + BPE + source dictionary, called as the core calls a HF tokenizer."""

    def __init__(self, hub) -> None:
        self.hub = hub

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.hub.encode(text).tolist()}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tgt_dict = self.hub.task.target_dictionary
        if skip_special_tokens:
            ids = [i for i in ids if i not in (tgt_dict.eos(), tgt_dict.pad(), tgt_dict.bos())]
        return self.hub.decode(torch.tensor(ids, dtype=torch.long))
