"""Old import path of the GAD drafters: they live in ``lightgen.generation.drafting`` (the model, its
sessions, the training recipe), ``lightgen.adapters.self_drafter`` (the verifier's own compact copy as drafter) and
``lightgen.drafter_cli`` (``lightgen train-drafter``)."""

from lightgen.adapters.self_drafter import self_drafter
from lightgen.drafter_cli import main
from lightgen.generation.drafting import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DrafterConfig,
    NARDrafter,
    drafter_for,
    greedy_targets,
    start_session,
    train_drafter,
)
from lightgen.generation.tokens import pad_rows

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "DrafterConfig", "NARDrafter", "drafter_for", "greedy_targets", "main",
           "pad_rows", "self_drafter", "start_session", "train_drafter"]
