"""Versions of the libraries lightgen patches, as tested."""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

# Adapters follow the layer APIs of these releases; outside them a patched model could compute
# something else, so importing lightgen refuses instead.
TRANSFORMERS_RANGE = ("5.24.0", "5.25.0")  # [min, max)


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
