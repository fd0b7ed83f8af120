import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Tolerances per dtype, stated once: fp32 kernels agree with references to rounding.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=2e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def linear_operand(weight, precision, layout):
    """(weight, scale) for ``ops.linear`` from a float [N, K] weight: "fp32" / "bf16" / "int8" (the op's
    per-output-channel int8; accelerate_model quantizes group-wise, ``ops.linear_grouped``), laid out as
    "rows" ([N, K]), "k_major" (viewed from [K, N]) or "packed" panels."""
    from lightgen.ops.linear import pack_panels

    if layout == "k_major":
        return weight.t().contiguous().t(), None
    scale = None
    if precision == "int8":
        scale = weight.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        weight = torch.round(weight / scale[:, None]).to(torch.int8)
    elif precision == "bf16":
        weight = weight.to(torch.bfloat16)
    return (pack_panels(weight) if layout == "packed" else weight), scale


def pytest_configure(config):
    # Build (or load from cache) before tests start timing, and fail loudly if the build broke.
    from lightgen import _build

    status = _build.load()
    if os.environ.get("LIGHTGEN_DISABLE_EXT") != "1":
        if not status.compiled:
            raise pytest.UsageError(f"lightgen kernels did not build: {status.reason}")
        if status.cuda is not None and not status.cuda.compiled:
            raise pytest.UsageError(f"lightgen CUDA kernels did not build: {status.cuda.reason}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture
def step_counter(monkeypatch):
    """Records each call of lightgen's decoder step, to show that lightgen's loop ran."""
    from lightgen.modules.decoder import Decoder

    calls = []
    original = Decoder.step
    monkeypatch.setattr(Decoder, "step", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    return calls


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture
def flat_pass_cost(monkeypatch):
    """Every pass costs the same and every call starts from the fixed prior (``LIGHTGEN_FIXED_DRAFTS=1``):
    aggressive decoding keeps each draft whole (as fixed-length drafting did) whatever earlier calls on the model
    saw, for tests that count passes; the adaptive policy itself is tested in generation/test_draft_policy.py."""
    monkeypatch.setenv("LIGHTGEN_FIXED_DRAFTS", "1")
