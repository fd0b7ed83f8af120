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
import logging
import threading
from pathlib import Path

import torch

TRITON_MODEL_NAME = "lightgen"
SETTINGS = ("max_new_tokens", "num_beams", "do_sample", "top_k", "top_p", "temperature", "seed", "decoding",
            "max_draft", "beta", "tau")
DECODINGS = ("auto", "iad", "gad")
SAMPLING_ONLY = ("top_k", "top_p", "temperature", "seed")
# Below this, logits / temperature overflows float32 (1e-300 becomes 0: a division by zero); sampling this cold
# is greedy decoding anyway.
MIN_TEMPERATURE = 1e-2
MAX_BODY_BYTES = 1 << 20  # default cap on one HTTP body (Ray) or one request row (Triton)
TEXT_BYTES_PER_TOKEN = 32  # default text cap: max_input_tokens tokens of up to this many UTF-8 bytes each
MAX_JSON_DEPTH = 4  # a Ray body nests 3 deep (list > request > input_ids), a Triton row 2
LOG = logging.getLogger("lightgen.serving")


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
    max_body_bytes: int = MAX_BODY_BYTES
    max_text_bytes: int | None = None  # None: TEXT_BYTES_PER_TOKEN * max_input_tokens

    @property
    def text_bytes(self) -> int:
        return self.max_text_bytes or TEXT_BYTES_PER_TOKEN * self.max_input_tokens


def _show(value, width: int = 40) -> str:
    """A client's value in an error message, cut short: a message never echoes a megabyte back."""
    return _cut(repr(value) if not isinstance(value, int) or abs(value) < 10**30
                else f"an integer of {value.bit_length()} bits", width)


def _cut(text: str, width: int = 200) -> str:
    return text if len(text) <= width else text[:width] + "..."


def _integer(name, value, low, high):
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be in [{low}, {high}], got {_show(value)}")
    return value


def _number(name, value, low, high, low_open=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number, got {type(value).__name__}")
    if not ((low < value) if low_open else (low <= value)) or not value <= high:
        raise RequestError(f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {_show(value)}")
    return float(value)


def parse_settings(request: dict, limits: Limits, accelerated: bool, has_drafter: bool = False) -> Settings:
    """The request's settings, or one RequestError that lists every bad setting (not only the first)."""
    errors = []
    unknown = sorted(set(request) - set(SETTINGS) - {"text", "input_ids"})
    if unknown:
        errors.append(f"unknown setting(s) {_show(unknown, 200)} (known: text or input_ids, {', '.join(SETTINGS)})")
    get = request.get

    def checked(name, check, *bounds, default=None):
        value = get(name, default)
        if value is None:
            return None
        try:
            return check(name, value, *bounds)
        except RequestError as error:
            errors.append(str(error))
            return None

    do_sample = get("do_sample", False)
    if not isinstance(do_sample, bool):
        errors.append(f"'do_sample' must be true or false, got {type(do_sample).__name__}")
    else:
        errors += [f"'{name}' needs do_sample=true" for name in SAMPLING_ONLY if get(name) is not None and not do_sample]
    decoding = get("decoding", "auto")
    if not isinstance(decoding, str) or decoding not in DECODINGS:
        errors.append(f"'decoding' must be one of {', '.join(map(repr, DECODINGS))}, got {_show(decoding)}")
        decoding = None  # unknown: the checks that depend on it are skipped
    num_beams = checked("num_beams", _integer, 1, limits.max_beams, default=1)
    if decoding in ("iad", "gad"):
        if not accelerated:
            errors.append(f"decoding={decoding!r} needs lightgen's engine; this server runs plain HF generate")
        if decoding == "gad" and not has_drafter:
            errors.append("decoding='gad' needs a drafter; this server has none (lightgen serve --drafter DIR or "
                          "--self-drafter int4)")
        if num_beams not in (None, 1) or do_sample is True:
            errors.append(f"decoding={decoding!r} is greedy decoding: num_beams=1 and do_sample=false")
    elif decoding == "auto" and get("max_draft") is not None:
        errors.append("'max_draft' needs decoding='iad' or 'gad'")
    if decoding is not None:
        errors += [f"'{name}' needs decoding='gad'" for name in ("beta", "tau")
                   if get(name) is not None and decoding != "gad"]
    values = dict(
        max_new_tokens=checked("max_new_tokens", _integer, 1, limits.max_new_tokens, default=limits.max_new_tokens),
        top_k=checked("top_k", _integer, 1, 1 << 20),
        top_p=checked("top_p", _number, 0.0, 1.0),
        temperature=checked("temperature", _number, MIN_TEMPERATURE, 100.0, False),
        seed=checked("seed", _integer, 0, 2**63 - 1),
        max_draft=checked("max_draft", _integer, 1, 64),
        beta=checked("beta", _integer, 1, 64),
        tau=checked("tau", _number, 0.0, 100.0, False))
    if errors:
        raise RequestError("; ".join(errors))
    return Settings(num_beams=num_beams, do_sample=do_sample, decoding=decoding, **values)


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
             drafter_dir: str | Path | None = None, self_drafter: str | None = None,
             fairseq_data: str | Path | None = None, **limits) -> Generator:
        """A saved HF model folder (``save_pretrained``; its tokenizer too, if saved there), a fairseq
        checkpoint file (``.pt``; its dictionaries in ``fairseq_data``, default its folder), or the shipped
        demo model when ``model_dir`` is None; ``drafter_dir``: a ``NARDrafter`` folder for GAD requests
        (the demo model's shipped drafter by default), or ``self_drafter``: a precision ("int4", ...) in which
        the accelerated HF model's own copy drafts (``lightgen.drafting.self_drafter``)."""
        if self_drafter is not None and (drafter_dir is not None or not accelerate):
            raise ValueError("a self-drafter is the accelerated model's own copy: it takes no drafter folder and "
                             "needs acceleration")
        if threads:
            torch.set_num_threads(threads)
        if model_dir is not None and Path(model_dir).suffix == ".pt":
            if self_drafter is not None:
                raise ValueError("a self-drafter needs a Hugging Face model; fairseq checkpoints take a drafter "
                                 "folder")
            from lightgen.serving.fairseq_model import load_fairseq_checkpoint

            model, tokenizer = load_fairseq_checkpoint(Path(model_dir), fairseq_data, accelerate)
            generator = cls(model, tokenizer, accelerated=accelerate, drafter=drafter_dir and str(drafter_dir))
        else:
            generator = cls._load_hf(model_dir, accelerate, drafter_dir, self_drafter)
        if limits:
            generator.limits = dataclasses.replace(generator.limits, **limits)
        return generator

    @classmethod
    def _load_hf(cls, model_dir, accelerate: bool, drafter_dir, self_drafter: str | None) -> Generator:
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
        if self_drafter is not None:
            from lightgen.adapters.self_drafter import self_drafter as make_self_drafter

            drafter = make_self_drafter(model, self_drafter)
        elif drafter_dir is not None or model_dir is None:
            from lightgen.demo import DRAFTER_DIR
            from lightgen.generation.drafting import NARDrafter

            drafter = NARDrafter.from_pretrained(drafter_dir or DRAFTER_DIR)
        return cls(model, tokenizer, accelerated=accelerate, drafter=drafter)

    def info(self) -> dict:
        return dict(model_type=self.model.config.model_type, accelerated=self.accelerated,
                    tokenizer=self.tokenizer is not None, drafter=self.drafter is not None,
                    limits=dict(dataclasses.asdict(self.limits), max_text_bytes=self.limits.text_bytes))

    def stats(self) -> dict:
        with self.stats_lock:
            return dict(batch_sizes=dict(self.batch_sizes), group_sizes=dict(self.group_sizes))

    def refusal(self, request) -> str | None:
        """What is wrong with a request, as far as it can be told without tokenizing it (None: nothing); cheap
        enough for a server to refuse at once instead of queueing the request for a batch."""
        try:
            self.check(request)
        except RequestError as error:
            return str(error)
        return None

    def parse(self, request) -> tuple[list[int], Settings]:
        """A request's token ids and settings, or one RequestError listing what is wrong with it. The
        limits come before the work: the text is measured in bytes before it is tokenized, and a request
        whose settings are refused is not tokenized at all."""
        settings = self.check(request)
        ids = self.tokenizer(request["text"])["input_ids"] if "text" in request else request["input_ids"]
        if len(ids) > self.limits.max_input_tokens:
            raise RequestError(f"input is {len(ids)} tokens; this server takes at most "
                               f"{self.limits.max_input_tokens}")
        start = 1 if self.encoder_decoder else len(ids)
        if start + settings.max_new_tokens > self.max_positions:
            raise RequestError(f"max_new_tokens ({settings.max_new_tokens}) + {start} decoder tokens already there "
                               f"exceed the model's {self.max_positions} positions")
        return ids, settings

    def check(self, request) -> Settings:
        """The request's settings after every check that needs no tokenizer, or one RequestError listing
        all that fail."""
        if not isinstance(request, dict):
            raise RequestError(f"a request is an object, got {type(request).__name__}")
        errors = []
        if ("text" in request) == ("input_ids" in request):
            errors.append("a request needs exactly one of 'text' or 'input_ids'")
        elif "text" in request:
            errors += self._check_text(request["text"])
        else:
            errors += self._check_ids(request["input_ids"])
        try:
            settings = parse_settings(request, self.limits, self.accelerated, self.drafter is not None)
        except RequestError as error:
            errors.append(str(error))
        if errors:
            raise RequestError("; ".join(errors))
        return settings

    def _check_text(self, text) -> list[str]:
        if self.tokenizer is None:
            return ["this model has no tokenizer: send 'input_ids'"]
        if not isinstance(text, str) or not text.strip():
            return ["'text' must be a non-empty string"]
        limit = self.limits.text_bytes
        try:  # a character is at least one byte: a text this long is refused without encoding it
            size = len(text) if len(text) > limit else len(text.encode("utf-8"))
        except UnicodeEncodeError as error:  # a lone surrogate ("\ud800" in JSON): tokenizers raise TypeError
            return [f"'text' is not valid Unicode: {error.reason} (character {error.start})"]
        if size > limit:
            return [f"'text' is {'at least ' if len(text) > limit else ''}{size} bytes; this server takes at most "
                    f"{limit} (lightgen serve --max-text-bytes)"]
        return []

    def _check_ids(self, ids) -> list[str]:
        if not isinstance(ids, list) or not ids:
            return ["'input_ids' must be a non-empty list of integers"]
        if len(ids) > self.limits.max_input_tokens:
            return [f"input is {len(ids)} tokens; this server takes at most {self.limits.max_input_tokens}"]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return ["'input_ids' must be a non-empty list of integers"]
        if not all(0 <= i < self.vocab_size for i in ids):
            return [f"'input_ids' must lie in [0, {self.vocab_size})"]
        return []

    def generate(self, requests: list) -> list[dict]:
        """One answer per request, in order; never raises: whatever goes wrong with one request (a refusal,
        or any exception while tokenizing or generating it) is that request's error, logged server-side
        with its traceback, and its batch-mates are answered."""
        try:
            return self._generate_all(requests)
        except Exception:  # a bug here must still answer every request
            LOG.exception("lightgen: a batch of %d requests failed", len(requests))
            return [internal_error() for _ in requests]

    def _generate_all(self, requests: list) -> list[dict]:
        answers: list[dict | None] = [None] * len(requests)
        groups = collections.defaultdict(list)
        for index, request in enumerate(requests):
            try:
                ids, settings = self.parse(request)
            except RequestError as error:
                answers[index] = {"error": str(error)}
                continue
            except Exception:  # e.g. the tokenizer failing on an input nobody foresaw
                LOG.exception("lightgen: reading a request failed")
                answers[index] = internal_error()
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
            answers = [self._answer(row) for row in rows]
        except Exception as error:  # one failing request must not fail its batch-mates
            if len(members) > 1:
                return [answer for member in members for answer in self._run_group(settings, [member])]
            LOG.exception("lightgen: generation failed for one request (%s)", settings)
            return [{"error": f"generation failed: {type(error).__name__}: {_cut(str(error))}"}]
        with self.stats_lock:
            self.group_sizes[len(members)] += 1
        return answers

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


def internal_error() -> dict:
    """What a client learns of a server-side failure: that it happened; the traceback goes to the log."""
    return {"error": "internal error while answering this request; the server logged it"}


def load_json(body: bytes, limits: Limits):
    """A client's JSON, or a RequestError: too large (checked before parsing), not JSON (or not UTF-8), or
    nested deeper than any request is (a RecursionError inside ``json`` otherwise)."""
    if len(body) > limits.max_body_bytes:
        raise RequestError(f"request is {len(body)} bytes; this server takes at most {limits.max_body_bytes} "
                           "(lightgen serve --max-body-bytes)")
    try:
        value = json.loads(body)
    except RecursionError:
        level = None  # deeper than the interpreter's recursion limit
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, integers of over 4300 digits
        raise RequestError(f"request is not JSON: {_cut(str(error))}") from None
    else:
        level = [value]
        for _ in range(MAX_JSON_DEPTH + 1):  # empty at the end unless some container nests deeper
            level = [child for item in level if isinstance(item, (list, dict))
                     for child in (item.values() if isinstance(item, dict) else item)]
    if level is None or level:
        raise RequestError(f"request JSON nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def answer_json(generator: Generator, rows: list[bytes]) -> list[bytes]:
    """Triton's rows: JSON requests in, JSON answers out; a row that is refused (too large, not JSON, too
    deep) gets an error answer, and so does every row if anything unforeseen fails (logged, never raised:
    an exception would fail the rows of every client in Triton's batch, with a traceback)."""
    try:
        answers: list[dict | None] = [None] * len(rows)
        requests, positions = [], []
        for index, row in enumerate(rows):
            try:
                requests.append(load_json(row, generator.limits))
                positions.append(index)
            except RequestError as error:
                answers[index] = {"error": str(error)}
        for index, answer in zip(positions, generator.generate(requests) if requests else [], strict=True):
            answers[index] = answer
        return [json.dumps(answer).encode() for answer in answers]
    except Exception:
        LOG.exception("lightgen: answering %d Triton rows failed", len(rows))
        return [json.dumps(internal_error()).encode() for _ in rows]


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
