"""Runs CTranslate2 models for benchmarks/generate.py in a process of their own.

CTranslate2's wheel bundles libgomp, but in a process that loaded torch first its OpenMP calls bind
to torch's libgomp: CTranslate2's worker thread then adds a second thread team to torch's runtime,
which by all signs switches libgomp to its throttled spin for more threads than CPUs: torch's worker
thread then sleeps between parallel regions, and each one waits on a wake-up (measured on 2 cores:
lightgen's BART batch-1 step went from 5.4-7.5 ms to 10-12 ms after CTranslate2's first call, and
stayed there). The same happens between two CTranslate2 models in one process, each with its own
team: a BART batch-1 step took 12.7 ms with the int8 model loaded beside the float32 one, 7.4 ms
alone. Users run a model in a process of its own, so the benchmark runs each CTranslate2 model in
one. This script never imports torch.

Requests (benchmarks/_worker_loop.py): ("load", model_dir, compute_type, threads, encoder_decoder) -> None;
("generate", token_rows, options, measure_rss) -> (new token ids, peak RSS growth in MB or None).
"""

from pathlib import Path

import ctranslate2
from _worker_loop import serve


def rss_and_peak_bytes() -> tuple[int, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def generate(runner, encoder_decoder: bool, token_rows: list, options: dict, measure_rss: bool):
    start_rss = None
    if measure_rss:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
            start_rss, _ = rss_and_peak_bytes()
        except OSError:
            pass
    if encoder_decoder:  # a TranslationResult has token strings only ("t<id>")
        results = runner.translate_batch(token_rows, **options)
        new_ids = [[int(text[1:]) for text in result.hypotheses[0]] for result in results]
    else:
        results = runner.generate_batch(token_rows, **options)
        new_ids = [result.sequences_ids[0] for result in results]
    growth = None if start_rss is None else (rss_and_peak_bytes()[1] - start_rss) / 2**20
    return new_ids, growth


def main() -> None:
    loaded = None  # (runner, encoder_decoder)

    def handle(request):
        nonlocal loaded
        if request[0] == "load":
            model_dir, compute_type, threads, encoder_decoder = request[1:]
            runner = ctranslate2.Translator if encoder_decoder else ctranslate2.Generator
            loaded = (runner(model_dir, device="cpu", compute_type=compute_type, intra_threads=threads,
                             inter_threads=1), encoder_decoder)
            return None
        token_rows, options, measure_rss = request[1:]
        ctranslate2.set_random_seed(options.pop("seed"))
        return generate(*loaded, token_rows, options, measure_rss)

    serve(handle)


if __name__ == "__main__":
    main()
