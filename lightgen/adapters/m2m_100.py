"""M2M100 and NLLB-200: BART's layers, pre-LN with final layer norms, scaled embeddings, and fairseq's
sinusoidal positions, numbered from the padding id (a padding token takes the zero row)."""

from __future__ import annotations

import functools

from lightgen.adapters.bart import bart_decoder, register_bart_style


def _fairseq_positions(embed_positions) -> dict:
    # Position p of a real token reads row padding_idx + 1 + p of the table (the module's buffer ``weights``).
    pad = embed_positions.padding_idx
    return dict(position_table=embed_positions.weights, position_offset=pad + 1, position_padding_idx=pad)


register_bart_style("m2m_100", "M2M100", pre_norm=True,
                    decoder=functools.partial(bart_decoder, positions=_fairseq_positions))
