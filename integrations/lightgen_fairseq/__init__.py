"""lightgen for ``fairseq-interactive`` / ``fairseq-generate``: add two flags,
``--user-dir integrations/lightgen_fairseq --task translation_lightgen``, and the same models
translate on lightgen's decoder, with fairseq's own search deciding every token.

The folder is not called ``fairseq``: fairseq refuses a ``--user-dir`` whose name is already an
importable module.
"""

from . import task  # noqa: F401  (registers translation_lightgen)
