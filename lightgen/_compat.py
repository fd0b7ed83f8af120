"""Versions of the libraries lightgen patches, as tested."""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.version import Version

# Adapters follow the layer APIs of these releases; outside them a patched model could compute
# something else, so importing lightgen refuses instead. Tested: 5.24.0 (all); 5.21.1, 5.22.2, 5.23.0 (generation,
# parity and family tests; CI runs 5.21.1 in a venv of its own, `.ci/run`). 5.24 renamed `past_key_values` to `cache`
# (generate's argument, model_kwargs, outputs: `generation/hf_cache.py`; attention modules: `adapters/_blocks.py`).
TRANSFORMERS_RANGE = ("5.21.0", "5.25.0")  # [min, max)
TRANSFORMERS_OLDEST_TESTED = "5.21.1"

# fairseq 0.12.2 does not import on Python 3.11; this PyPI fork does. Installed without its
# dependencies (its torchaudio pin breaks torch 2.13): `lightgen install-fairseq`.
FAIRSEQ_DISTRIBUTION = "fairseq-fixed"
FAIRSEQ_RANGE = ("0.12.3.1", "0.12.4")  # [min, max), fairseq.__version__


def check_transformers_version(installed: str | None = None) -> None:
    if installed is None:
        try:
            installed = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            raise ImportError("lightgen needs transformers; install it with `pip install lightgen`") from None
    low, high = TRANSFORMERS_RANGE
    if not Version(low) <= Version(installed) < Version(high):
        raise ImportError(
            f"lightgen supports transformers >={low},<{high} (tested); found {installed}. "
            f"Install a tested version: pip install 'transformers>={low},<{high}'"
        )


@functools.cache
def sdpa_packs_gqa() -> bool:
    """Whether HF's sdpa attention hands a masked single query's grouped heads to sdpa as queries of their K/V head
    (transformers 5.23+), which rounds fp16 / bf16 otherwise than one query with ``enable_gqa``."""
    from transformers.integrations import sdpa_attention

    return hasattr(sdpa_attention, "pack_gqa")


def check_fairseq_version(installed: str | None = None) -> None:
    """fairseq's decoder internals, which the fairseq adapter reads, as in the tested release."""
    if installed is None:
        import fairseq

        installed = fairseq.__version__
    low, high = FAIRSEQ_RANGE
    if not Version(low) <= Version(installed) < Version(high):
        raise ImportError(
            f"lightgen's fairseq adapter supports fairseq >={low},<{high} (tested: {FAIRSEQ_DISTRIBUTION}=={low}); "
            f"found {installed}. Install the tested version with `lightgen install-fairseq`"
        )
