"""Thin glue between lightgen and other tools, installed with the package (one folder each)."""

from pathlib import Path

# fairseq's ``--user-dir`` imports a folder by its name as a top-level module; this one is named
# ``lightgen_fairseq``, never ``fairseq`` (fairseq refuses a name that is already importable).
FAIRSEQ_PLUGIN_DIR = Path(__file__).resolve().parent / "lightgen_fairseq"
