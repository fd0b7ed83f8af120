"""Pegasus: BART's layers, pre-LN with final layer norms, sinusoidal positions, scaled embeddings."""

from __future__ import annotations

from lightgen.adapters.bart import register_bart_style

register_bart_style("pegasus", "Pegasus", pre_norm=True)
