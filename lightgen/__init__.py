"""lightgen: make an existing Hugging Face model generate the same tokens, faster.

    model = lightgen.accelerate_model(model)   # patches the instance in place
    lightgen.restore_model(model)              # undoes every change
"""

from lightgen._compat import check_transformers_version

__version__ = "0.1.0"

check_transformers_version()

from lightgen.adapters import ADAPTERS, UnsupportedModelError, accelerate_model, restore_model  # noqa: E402

__all__ = ["ADAPTERS", "UnsupportedModelError", "accelerate_model", "restore_model", "__version__"]
