from lightgen.adapters.base import ADAPTERS, UnsupportedModelError, accelerate_model, restore_model

__all__ = ["ADAPTERS", "UnsupportedModelError", "accelerate_model", "restore_model"]
