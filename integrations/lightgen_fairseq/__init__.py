"""The source tree's path to the fairseq plugin, ``--user-dir integrations/lightgen_fairseq``, kept working:
the plugin itself is installed with the package, ``lightgen/integrations/lightgen_fairseq``
(``lightgen fairseq-plugin-dir`` prints its folder)."""

from lightgen.integrations.lightgen_fairseq import task  # noqa: F401  (registers translation_lightgen)
