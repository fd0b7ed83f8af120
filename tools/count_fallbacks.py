"""pytest plugin: which generate() calls of the test suite ran on lightgen's engine and which fell back to HF's
loop, per model family (``config.model_type``), for issue notes on what still falls back.

    LIGHTGEN_COUNT_OUT=counts.json OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tools \\
        python -m pytest -q -p count_fallbacks tests/generation tests/adapters tests/test_memory.py tests/demo

A call falls back when lightgen's engine hands it to HF's loop (the ``lightgen generate:`` RuntimeWarning, or
its LIGHTGEN_STRICT=1 error); falling back from IAD/GAD to lightgen's own loop does not count. ``counts.json``
holds, per family, the tests that generated with it only on the engine and those with at least one fallback,
the outermost calls by outcome (``engine``, ``fallback``, ``error``: raised without a fallback), and each
test's calls.
"""

import collections
import json
import os

HF_LOOP = "Hugging Face's own generate loop"
_open_calls = []  # [family, fell_back] of the generate calls under way (accelerated_generate calls
# unaccelerated_generate to fall back: one call, counted once, as the outermost)
_test_calls = []  # (family, outcome) of the running test's calls
_per_test = {}


def pytest_configure(config):
    from lightgen.generation import engine

    original_fall_back = engine._fall_back

    def fall_back(reason, instead=HF_LOOP):
        if instead == HF_LOOP:
            for call in _open_calls:
                call[1] = True
        return original_fall_back(reason, instead)

    engine._fall_back = fall_back
    # Adapters bind these into each accelerated model's ``generate`` when they patch it (after this runs).
    for name in ("accelerated_generate", "unaccelerated_generate"):
        setattr(engine, name, _counted(getattr(engine, name)))


def _counted(generate):
    def counted(model, *args, **kwargs):
        _open_calls.append([model.config.model_type, False])
        outcome = "error"
        try:
            result = generate(model, *args, **kwargs)
            outcome = "engine"
            return result
        finally:
            family, fell_back = _open_calls.pop()
            if not _open_calls:
                _test_calls.append((family, "fallback" if fell_back else outcome))

    return counted


def pytest_runtest_setup(item):
    _test_calls.clear()


def pytest_runtest_teardown(item):
    _per_test[item.nodeid] = list(_test_calls)


def pytest_sessionfinish(session):
    calls = collections.Counter(call for rows in _per_test.values() for call in rows)
    tests = collections.defaultdict(collections.Counter)
    for rows in _per_test.values():
        for family in {family for family, _ in rows}:
            fell_back = any(f == family and outcome == "fallback" for f, outcome in rows)
            tests[family]["with_fallback" if fell_back else "engine_only"] += 1
    with open(os.environ.get("LIGHTGEN_COUNT_OUT", "counts.json"), "w") as out:
        json.dump({"tests": {family: dict(counts) for family, counts in sorted(tests.items())},
                   "calls": {f"{family}:{outcome}": n for (family, outcome), n in sorted(calls.items())},
                   "per_test": _per_test}, out, indent=1)
