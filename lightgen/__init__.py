"""lightgen: make an existing Hugging Face model generate the same tokens, faster.

    model = lightgen.accelerate_model(model)   # patches the instance in place
    lightgen.restore_model(model)              # undoes every change
"""

import importlib

from lightgen._compat import check_transformers_version

__version__ = "0.1.0"

check_transformers_version()

__all__ = ["ADAPTERS", "UnsupportedModelError", "accelerate_model", "restore_model", "__version__"]


def __getattr__(name: str):
    """The API on first use (PEP 562): ``import lightgen`` stays cheap, so ``lightgen --help`` starts
    without torch. A submodule (``lightgen.ops``) is imported the same way."""
    if name in __all__:
        from lightgen import adapters

        value = globals()[name] = getattr(adapters, name)
        return value
    try:
        return importlib.import_module(f"lightgen.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"lightgen.{name}":
            raise
        raise AttributeError(f"module 'lightgen' has no attribute {name!r}") from None
