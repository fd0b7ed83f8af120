"""lightgen for ``fairseq-interactive`` / ``fairseq-generate``: add two flags,
``--user-dir "$(lightgen fairseq-plugin-dir)" --task translation_lightgen``, and the same models
translate on lightgen's decoder, with fairseq's own search deciding every token.

The folder is not called ``fairseq``: fairseq refuses a ``--user-dir`` whose name is already an
importable module.
"""

# Absolute: fairseq imports this folder as the top-level module ``lightgen_fairseq``, Python code as
# ``lightgen.integrations.lightgen_fairseq``; either way the task module is one, and registers once.
from lightgen.integrations.lightgen_fairseq import task  # noqa: F401  (registers translation_lightgen)
