"""The serving core both backends share: load a model, validate requests, group them by decoding
settings, generate, and answer each request on its own (an error answers only the request that caused it).

A request is a dict: ``{"text": "..."}`` (needs a tokenizer) or ``{"input_ids": [...]}``, plus optional
decoding settings named as in HF's ``generate``: ``max_new_tokens``, ``num_beams``, ``do_sample``, ``top_k``,
``top_p``, ``temperature``, ``seed``; ``decoding="iad"`` with ``max_draft``, or ``decoding="gad"`` (a server
started with a drafter) with ``max_draft`` (the block size), ``beta`` and ``tau``. The answer is
``{"output_ids": [...], "text": "..."}`` (``text`` when the server has a tokenizer) or ``{"error": "..."}``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from pathlib import Path

import torch

TRITON_MODEL_NAME = "lightgen"
SETTINGS = ("max_new_tokens", "num_beams", "do_sample", "top_k", "top_p", "temperature", "seed", "decoding",
            "max_draft", "beta", "tau")
DECODINGS = ("auto", "iad", "gad")
SAMPLING_ONLY = ("top_k", "top_p", "temperature", "seed")


class RequestError(ValueError):
    """A request the server refuses; its message goes back to the client."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """One request's decoding settings; requests with equal settings share a ``generate`` call."""

    max_new_tokens: int
    num_beams: int = 1
    do_sample: bool = False
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    seed: int | None = None
    decoding: str = "auto"
    max_draft: int | None = None  # iad: the longest draft; gad: the block size
    beta: int | None = None  # gad
    tau: float | None = None  # gad

    def generate_kwargs(self, drafter=None) -> dict:
        kwargs = dict(max_new_tokens=self.max_new_tokens, num_beams=self.num_beams, do_sample=self.do_sample)
        # Unset sampling knobs stay HF's defaults (top_k 50 etc. from the generation config), as in generate().
        kwargs.update({name: getattr(self, name) for name in ("top_k", "top_p", "temperature")
                       if getattr(self, name) is not None})
        if self.decoding == "iad":
            kwargs.update(decoding="iad", max_draft=self.max_draft)  # None: the engine's per-batch default
        elif self.decoding == "gad":
            kwargs.update(decoding="gad", drafter=drafter, block_size=self.max_draft or 8, beta=self.beta or 1,
                          tau=self.tau or 0.0)
        return kwargs


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for; each limit has a clear error."""

    max_input_tokens: int
    max_new_tokens: int = 128
    max_beams: int = 8
    max_batch_size: int = 32


def _integer(name, value, low, high):
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be in [{low}, {high}], got {value}")
    return value


def _number(name, value, low, high, low_open=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number, got {type(value).__name__}")
    if not ((low < value) if low_open else (low <= value)) or not value <= high:
        raise RequestError(f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def parse_settings(request: dict, limits: Limits, accelerated: bool, has_drafter: bool = False) -> Settings:
    unknown = sorted(set(request) - set(SETTINGS) - {"text", "input_ids"})
    if unknown:
        raise RequestError(f"unknown setting(s) {unknown}; known: text or input_ids, {', '.join(SETTINGS)}")
    get = request.get
    do_sample = get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise RequestError(f"'do_sample' must be true or false, got {type(do_sample).__name__}")
    for name in SAMPLING_ONLY:
        if get(name) is not None and not do_sample:
            raise RequestError(f"'{name}' needs do_sample=true")
    decoding = get("decoding", "auto")
    if decoding not in DECODINGS:
        raise RequestError(f"'decoding' must be one of {', '.join(map(repr, DECODINGS))}, got {decoding!r}")
    num_beams = _integer("num_beams", get("num_beams", 1), 1, limits.max_beams)
    if decoding != "auto":
        if not accelerated:
            raise RequestError(f"decoding={decoding!r} needs lightgen's engine; this server runs plain HF generate")
        if decoding == "gad" and not has_drafter:
            raise RequestError("decoding='gad' needs a drafter; this server has none (lightgen serve --drafter DIR)")
        if num_beams != 1 or do_sample:
            raise RequestError(f"decoding={decoding!r} is greedy decoding: num_beams=1 and do_sample=false")
    elif get("max_draft") is not None:
        raise RequestError("'max_draft' needs decoding='iad' or 'gad'")
    for name in ("beta", "tau"):
        if get(name) is not None and decoding != "gad":
            raise RequestError(f"'{name}' needs decoding='gad'")
    return Settings(
        max_new_tokens=_integer("max_new_tokens", get("max_new_tokens", limits.max_new_tokens), 1,
                                limits.max_new_tokens),
        num_beams=num_beams, do_sample=do_sample,
        top_k=None if get("top_k") is None else _integer("top_k", get("top_k"), 1, 1 << 20),
        top_p=None if get("top_p") is None else _number("top_p", get("top_p"), 0.0, 1.0),
        temperature=None if get("temperature") is None else _number("temperature", get("temperature"), 0.0, 100.0),
        seed=None if get("seed") is None else _integer("seed", get("seed"), 0, 2**63 - 1),
        decoding=decoding,
        max_draft=None if get("max_draft") is None else _integer("max_draft", get("max_draft"), 1, 64),
        beta=None if get("beta") is None else _integer("beta", get("beta"), 1, 64),
        tau=None if get("tau") is None else _number("tau", get("tau"), 0.0, 100.0, low_open=False))


def check_batch(requests, limits: Limits) -> list:
    """A client's list of requests (one HTTP call): a non-empty list of at most ``max_batch_size``."""
    if not isinstance(requests, list):
        raise RequestError(f"expected a request object or a list of them, got {type(requests).__name__}")
    if not 1 <= len(requests) <= limits.max_batch_size:
        raise RequestError(f"a batch holds 1 to {limits.max_batch_size} requests, got {len(requests)}")
    return requests


class Generator:
    """A model (accelerated by lightgen unless told otherwise) answering lists of requests.

    ``generate(requests)`` validates each request, runs one ``model.generate`` per group of requests with
    the same settings (seeded sampling runs alone, so a seed gives the same sample whatever the batch-mates),
    and returns one answer per request, in order. Thread-safe: calls into the model are serialised.
    """

    def __init__(self, model, tokenizer=None, *, accelerated: bool, limits: Limits | None = None,
                 drafter=None) -> None:
        self.model, self.tokenizer, self.accelerated, self.drafter = model, tokenizer, accelerated, drafter
        config = model.config
        self.encoder_decoder = bool(config.is_encoder_decoder)
        positions = getattr(config, "max_position_embeddings", None) or 1 << 20
        # The decoder holds the start token (encoder-decoder) or the prompt (decoder-only) + the new tokens.
        self.limits = limits or Limits(max_input_tokens=positions, max_new_tokens=min(128, positions - 1))
        self.max_positions = positions
        self.vocab_size = config.vocab_size
        generation_config = model.generation_config
        self.pad_id = next(i for i in (generation_config.pad_token_id, config.pad_token_id, 0) if i is not None)
        eos = generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.lock = threading.Lock()  # one generate at a time
        self.stats_lock = threading.Lock()  # apart, so that reading stats never waits for a batch
        self.batch_sizes = collections.Counter()  # requests per generate() call -> count
        self.group_sizes = collections.Counter()  # rows per model.generate call -> count

    @classmethod
    def load(cls, model_dir: str | Path | None = None, *, accelerate: bool = True, threads: int | None = None,
             drafter_dir: str | Path | None = None, fairseq_data: str | Path | None = None, **limits) -> Generator:
        """A saved HF model folder (``save_pretrained``; its tokenizer too, if saved there), a fairseq
        checkpoint file (``.pt``; its dictionaries in ``fairseq_data``, default its folder), or the shipped
        demo model when ``model_dir`` is None; ``drafter_dir``: a ``NARDrafter`` folder for GAD requests
        (the demo model's shipped drafter by default)."""
        if threads:
            torch.set_num_threads(threads)
        if model_dir is not None and Path(model_dir).suffix == ".pt":
            from lightgen.serving.fairseq_model import load_fairseq_checkpoint

            model, tokenizer = load_fairseq_checkpoint(Path(model_dir), fairseq_data, accelerate)
            generator = cls(model, tokenizer, accelerated=accelerate, drafter=drafter_dir and str(drafter_dir))
        else:
            generator = cls._load_hf(model_dir, accelerate, drafter_dir)
        if limits:
            generator.limits = dataclasses.replace(generator.limits, **limits)
        return generator

    @classmethod
    def _load_hf(cls, model_dir, accelerate: bool, drafter_dir) -> Generator:
        if model_dir is None:
            from lightgen.demo import load_demo_model

            model, tokenizer = load_demo_model()
        else:
            model, tokenizer = _load_folder(Path(model_dir))
        # Requests set max_new_tokens; a saved max_length would only make HF warn on every call.
        model.generation_config.max_length = None
        if accelerate:
            import lightgen

            lightgen.accelerate_model(model)
        drafter = None
        if drafter_dir is not None or model_dir is None:
            from lightgen.demo import DRAFTER_DIR
            from lightgen.generation.drafting import NARDrafter

            drafter = NARDrafter.from_pretrained(drafter_dir or DRAFTER_DIR)
        return cls(model, tokenizer, accelerated=accelerate, drafter=drafter)

    def info(self) -> dict:
        return dict(model_type=self.model.config.model_type, accelerated=self.accelerated,
                    tokenizer=self.tokenizer is not None, drafter=self.drafter is not None,
                    limits=dataclasses.asdict(self.limits))

    def stats(self) -> dict:
        with self.stats_lock:
            return dict(batch_sizes=dict(self.batch_sizes), group_sizes=dict(self.group_sizes))

    def parse(self, request) -> tuple[list[int], Settings]:
        if not isinstance(request, dict):
            raise RequestError(f"a request is an object, got {type(request).__name__}")
        if ("text" in request) == ("input_ids" in request):
            raise RequestError("a request needs exactly one of 'text' or 'input_ids'")
        settings = parse_settings(request, self.limits, self.accelerated, self.drafter is not None)
        if "text" in request:
            text = request["text"]
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send 'input_ids'")
            if not isinstance(text, str) or not text.strip():
                raise RequestError("'text' must be a non-empty string")
            ids = self.tokenizer(text)["input_ids"]
        else:
            ids = request["input_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise RequestError("'input_ids' must be a non-empty list of integers")
            if not all(0 <= i < self.vocab_size for i in ids):
                raise RequestError(f"'input_ids' must lie in [0, {self.vocab_size})")
        if len(ids) > self.limits.max_input_tokens:
            raise RequestError(f"input is {len(ids)} tokens; this server takes at most "
                               f"{self.limits.max_input_tokens}")
        start = 1 if self.encoder_decoder else len(ids)
        if start + settings.max_new_tokens > self.max_positions:
            raise RequestError(f"max_new_tokens ({settings.max_new_tokens}) + {start} decoder tokens already there "
                               f"exceed the model's {self.max_positions} positions")
        return ids, settings

    def generate(self, requests: list) -> list[dict]:
        answers: list[dict | None] = [None] * len(requests)
        groups = collections.defaultdict(list)
        for index, request in enumerate(requests):
            try:
                ids, settings = self.parse(request)
            except RequestError as error:
                answers[index] = {"error": str(error)}
                continue
            # Seeded sampling runs alone: its sample must not depend on which requests shared its batch.
            groups[(settings, index if settings.seed is not None else None)].append((index, ids))
        with self.stats_lock:
            self.batch_sizes[len(requests)] += 1
        with self.lock:
            for (settings, _), members in groups.items():
                for index, answer in zip([i for i, _ in members], self._run_group(settings, members), strict=True):
                    answers[index] = answer
        return answers

    def _run_group(self, settings: Settings, members) -> list[dict]:
        try:
            rows = self._generate([ids for _, ids in members], settings)
        except Exception as error:  # noqa: BLE001 - one failing request must not fail its batch-mates
            if len(members) > 1:
                return [answer for member in members for answer in self._run_group(settings, [member])]
            return [{"error": f"generation failed: {type(error).__name__}: {error}"}]
        with self.stats_lock:
            self.group_sizes[len(members)] += 1
        return [self._answer(row) for row in rows]

    def _generate(self, inputs: list[list[int]], settings: Settings) -> list[list[int]]:
        longest = max(map(len, inputs))
        ids = torch.full((len(inputs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(inputs):
            # Decoder-only models continue the prompt's last token: pad on the left.
            span = slice(0, len(tokens)) if self.encoder_decoder else slice(longest - len(tokens), longest)
            ids[row, span] = torch.tensor(tokens)
            mask[row, span] = 1
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **settings.generate_kwargs(self.drafter))
        # Encoder-decoder outputs start with the decoder start token, decoder-only ones with the prompt.
        return [self._until_eos(row) for row in out[:, 1 if self.encoder_decoder else longest:].tolist()]

    def _until_eos(self, row: list[int]) -> list[int]:
        for position, token in enumerate(row):
            if token in self.eos_ids:
                return row[:position + 1]
        return row

    def _answer(self, output_ids: list[int]) -> dict:
        answer = {"output_ids": output_ids}
        if self.tokenizer is not None:
            answer["text"] = self.tokenizer.decode(output_ids, skip_special_tokens=True).strip()
        return answer


def answer_json(generator: Generator, rows: list[bytes]) -> list[bytes]:
    """Triton's rows: JSON requests in, JSON answers out; a row that is not JSON gets an error answer."""
    answers: list[dict | None] = [None] * len(rows)
    requests, positions = [], []
    for index, row in enumerate(rows):
        try:
            requests.append(json.loads(row))
            positions.append(index)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            answers[index] = {"error": f"request is not JSON: {error}"}
    for index, answer in zip(positions, generator.generate(requests), strict=True):
        answers[index] = answer
    return [json.dumps(answer).encode() for answer in answers]


def _load_folder(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a saved Hugging Face model (no config.json); "
                                "give a save_pretrained folder or a fairseq checkpoint (.pt)")
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    has_tokenizer = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model, tokenizer
