"""``lightgen`` command line: ``env`` (kernel report), ``build`` (compile the kernels ahead of time),
``demo`` (the shipped grammar corrector, HF vs lightgen), ``serve`` (a model behind Triton or Ray Serve),
``install-fairseq`` (the tested fairseq, for ``lightgen[fairseq]``), ``fairseq-plugin-dir`` (the folder for
fairseq's ``--user-dir``), ``train-drafter`` (a GAD drafter distilled from a verifier) and ``build-cuda``
(compile the CUDA kernels for chosen GPU architectures, with or without a GPU)."""

from __future__ import annotations

# Nothing heavy at module level: ``lightgen --help`` must not import torch (seconds of CPU). Each command
# imports what it needs.
import argparse
import re
import subprocess
import sys


def random_model_demo(layers: int, batch: int, src_len: int, new_tokens: int, repeats: int) -> None:
    import copy

    import torch
    import transformers as tf

    import lightgen
    from lightgen.demo.compare import median_seconds
    from lightgen.env import format_report, report

    print(format_report(report()), "\n")
    config = tf.BartConfig(vocab_size=8000, d_model=512, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                           decoder_ffn_dim=2048, max_position_embeddings=256)
    torch.manual_seed(0)
    hf_model = tf.BartForConditionalGeneration(config).eval()
    accelerated = lightgen.accelerate_model(copy.deepcopy(hf_model))
    input_ids = torch.randint(4, config.vocab_size, (batch, src_len))
    kwargs = dict(input_ids=input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  num_beams=1)
    print(f"model: BART {layers}+{layers} layers, d_model 512, ffn 2048, vocab 8000 (random weights, built from "
          f"config); batch {batch} x {src_len} source tokens, greedy, {new_tokens} new tokens")
    with torch.no_grad():
        same = torch.equal(hf_model.generate(**kwargs), accelerated.generate(**kwargs))
        rows = []
        for label, call in [
            ("prefill forward", lambda m: m(input_ids=input_ids, decoder_input_ids=input_ids)),
            ("generate (greedy)", lambda m: m.generate(**kwargs)),
        ]:
            before = median_seconds(lambda run=call: run(hf_model), repeats)
            after = median_seconds(lambda run=call: run(accelerated), repeats)
            rows.append((label, before, after))
    print(f"\n{'':<20}{'HF (ms)':>10}{'lightgen (ms)':>15}{'speedup':>10}")
    for label, before, after in rows:
        print(f"{label:<20}{before * 1e3:>10.1f}{after * 1e3:>15.1f}{before / after:>9.2f}x")
    print(f"\ngenerated tokens identical to HF: {same}")
    if not same:
        raise SystemExit("lightgen produced different tokens from HF generate")


def install_fairseq() -> None:
    """pip cannot say "without dependencies" in an extra: fairseq-fixed's own requirements pull a torchaudio
    built for another torch, which breaks ``import transformers``' model imports. The ``fairseq`` extra
    lists its real dependencies; this installs the package itself, built against the torch already here."""
    from lightgen._compat import FAIRSEQ_DISTRIBUTION, FAIRSEQ_RANGE

    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
               f"{FAIRSEQ_DISTRIBUTION}=={FAIRSEQ_RANGE[0]}"]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def build() -> None:
    """Compile the kernels into the cache now (an image, a CI job), where every later process, and every
    virtualenv with the same torch build, loads them without compiling."""
    from lightgen import _build

    status = _build.load()
    for what, built in (("CPU", status), ("CUDA", status.cuda)):
        if built is None:
            continue
        if not built.compiled:
            raise SystemExit(f"lightgen: the {what} kernels are not available: {built.reason}")
        print(f"lightgen: {what} kernels for {built.isa} {built.source} in {built.build_seconds:.1f} s: "
              f"{built.library_path}")


def fairseq_plugin_dir() -> None:
    """Print the installed fairseq plugin's folder, for ``--user-dir "$(lightgen fairseq-plugin-dir)"``."""
    from lightgen.integrations import FAIRSEQ_PLUGIN_DIR

    print(FAIRSEQ_PLUGIN_DIR)


def _compute_capability(value: str) -> str:
    if not re.fullmatch(r"\d+\.\d+", value):
        raise argparse.ArgumentTypeError(f"expected a compute capability such as 9.0 or 8.0, got {value!r}")
    return value


def build_cuda(archs: list[str]) -> None:
    """Compile the CUDA kernels for ``archs`` into the kernel cache and load them: a CI compile check,
    or a prebuild for GPUs the building machine does not have."""
    from pathlib import Path

    from lightgen import _build

    # The op schemas first, as on a GPU machine, so that loading the CUDA library checks every kernel's
    # signature against its schema; defined from Python, without building the CPU library.
    _build._register(_build.BuildStatus(reason="lightgen build-cuda defines the schemas only"))
    sources = ", ".join(path.name for path in _build.cuda_sources())
    print(f"lightgen: compiling {sources} for {_build.cuda_target(archs)} ...", flush=True)
    status = _build.build_cuda(archs)
    if not status.compiled:
        if status.log_path:
            print(Path(status.log_path).read_text()[-20000:], file=sys.stderr)
        raise SystemExit(f"lightgen: {status.reason}")
    print(f"lightgen: built {status.library_path} in {status.build_seconds:.0f} s")


def serve(args, parser) -> None:
    from lightgen.serving import ServeOptions, backend

    problems = [f"--{name.replace('_', '-')} must be positive"
                for name in ("max_batch_size", "num_replicas", "threads", "max_input_tokens", "max_new_tokens",
                             "max_replicas", "max_body_bytes", "max_text_bytes", "drain_timeout")
                if getattr(args, name) is not None and getattr(args, name) <= 0]
    if args.max_replicas is not None and args.max_replicas < args.num_replicas:
        problems.append("--max-replicas must be at least --num-replicas")
    if args.self_drafter is not None and (args.drafter is not None or args.no_accelerate):
        problems.append("--self-drafter takes neither --drafter nor --no-accelerate")
    if problems:  # all of them at once
        parser.error("; ".join(problems))
    options = ServeOptions(
        model_dir=args.model_dir, drafter_dir=args.drafter, self_drafter=args.self_drafter,
        fairseq_data=args.fairseq_data,
        accelerate=not args.no_accelerate, threads=args.threads, host=args.host,
        port=args.port, max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms,
        max_input_tokens=args.max_input_tokens, max_new_tokens=args.max_new_tokens, max_body_bytes=args.max_body_bytes,
        max_text_bytes=args.max_text_bytes, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        workspace=args.workspace, num_replicas=args.num_replicas, max_replicas=args.max_replicas,
        ray_address=args.ray_address, drain_timeout_s=args.drain_timeout)
    if args.export_repository:
        if args.backend != "triton":
            parser.error("--export-repository is for --backend triton")
        from lightgen.serving.triton_repository import write_repository

        print(f"wrote {write_repository(options, args.export_repository)}")
        return
    try:
        module = backend(args.backend)
    except ImportError as error:
        raise SystemExit(str(error)) from error
    module.serve(options)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="lightgen", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="report versions, ISA and which ops are compiled")
    commands.add_parser("build", help="compile the kernels into the cache now (for images and CI); later runs, "
                        "in any virtualenv with the same torch build, load them without compiling")
    demo_parser = commands.add_parser(
        "demo", help="correct sentences with the shipped demo model: HF vs lightgen greedy, IAD and beam search")
    demo_parser.add_argument("--sentences", type=int, default=12, help="held-out sentences added to the examples")
    demo_parser.add_argument("--batch", type=int, default=1)
    demo_parser.add_argument("--repeats", type=int, default=3)
    demo_parser.add_argument("--short", action="store_true", help="4 held-out sentences, one timed repeat")
    demo_parser.add_argument("--random-model", action="store_true",
                             help="instead: a BART with random weights built from a config (greedy, forced length)")
    demo_parser.add_argument("--layers", type=int, default=3, help="--random-model only")
    demo_parser.add_argument("--src-len", type=int, default=32, help="--random-model only")
    demo_parser.add_argument("--new-tokens", type=int, default=24, help="--random-model only")
    serve_parser = commands.add_parser(
        "serve", help="serve a model (the demo model by default) behind Triton (lightgen[triton]) or Ray Serve "
                      "(lightgen[ray]) until SIGINT/SIGTERM")
    serve_parser.add_argument("model_dir", nargs="?", help="a save_pretrained folder or a fairseq checkpoint (.pt) "
                              "(default: the demo model)")
    serve_parser.add_argument("--fairseq-data", metavar="DIR", help="a fairseq checkpoint's dictionaries "
                              "(dict.*.txt; default: the checkpoint's folder)")
    serve_parser.add_argument("--drafter", metavar="DIR", help="a lightgen NARDrafter folder trained for the model: "
                              "serves decoding='gad' (the demo model has its own)")
    serve_parser.add_argument("--self-drafter", metavar="PRECISION",
                              choices=["int4", "int4-dynamic", "int8", "int8-dynamic", "bf16"],
                              help="serves decoding='gad' with the model's own copy in this precision drafting on "
                              "its cache (Hugging Face models; no training)")
    serve_parser.add_argument("--backend", choices=["triton", "ray"], default="triton")
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve_parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve_parser.add_argument("--no-accelerate", action="store_true", help="plain HF generate (for comparisons)")
    serve_parser.add_argument("--threads", type=int, help="torch threads per model instance")
    serve_parser.add_argument("--max-batch-size", type=int, default=32)
    serve_parser.add_argument("--max-delay-ms", type=float, default=10.0,
                              help="how long a batch's first request waits for batch-mates")
    serve_parser.add_argument("--max-input-tokens", type=int, help="default: the model's positions")
    serve_parser.add_argument("--max-new-tokens", type=int, help="cap and default per request (default 128)")
    serve_parser.add_argument("--max-body-bytes", type=int, help="largest HTTP body (ray) or request row (triton) "
                              "read; larger ones are refused before parsing (default 1 MiB)")
    serve_parser.add_argument("--max-text-bytes", type=int, help="largest 'text' in UTF-8 bytes, refused before "
                              "tokenizing (default 32 per --max-input-tokens)")
    serve_parser.add_argument("--grpc-port", type=int, help="triton: default port + 1")
    serve_parser.add_argument("--metrics-port", type=int, help="triton: default port + 2")
    serve_parser.add_argument("--workspace", help="triton: PyTriton's model store (removed at shutdown)")
    serve_parser.add_argument("--export-repository", metavar="DIR",
                              help="triton: write a model repository for a standalone tritonserver and exit")
    serve_parser.add_argument("--num-replicas", type=int, default=1, help="ray: model replicas")
    serve_parser.add_argument("--max-replicas", type=int,
                              help="ray: autoscale between --num-replicas and this many replicas")
    serve_parser.add_argument("--ray-address", help="ray: an existing cluster ('auto' on a node of it); "
                                                    "default: start a local one, on 127.0.0.1 only")
    serve_parser.add_argument("--drain-timeout", type=float, default=30.0,
                              help="ray: on SIGTERM, seconds in-flight requests may take to finish (default 30)")
    commands.add_parser("install-fairseq", help="install the tested fairseq (after pip install 'lightgen[fairseq]')")
    commands.add_parser("fairseq-plugin-dir", help="print the fairseq plugin's folder: fairseq-interactive ... "
                        "--user-dir \"$(lightgen fairseq-plugin-dir)\" --task translation_lightgen")
    commands.add_parser("train-drafter", add_help=False,
                        help="distil a GAD drafter for a verifier (lightgen train-drafter --help)")
    cuda_parser = commands.add_parser("build-cuda", help="compile the CUDA kernels for given GPU architectures "
                                      "(needs nvcc and a CUDA build of torch, not a GPU)")
    cuda_parser.add_argument("--arch", action="append", required=True, type=_compute_capability,
                             help="compute capability such as 9.0 or 8.0; repeat for several")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "train-drafter":  # whose options its own parser reads
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    for name in ("sentences", "batch", "repeats", "layers", "src_len", "new_tokens"):
        if getattr(args, name, 1) < (0 if name == "sentences" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.command == "env":
        from lightgen.env import main as env_main

        env_main()
    elif args.command == "build":
        build()
    elif args.command == "install-fairseq":
        install_fairseq()
    elif args.command == "fairseq-plugin-dir":
        fairseq_plugin_dir()
    elif args.command == "train-drafter":
        from lightgen.drafter_cli import main as train_drafter_main

        train_drafter_main(rest)
    elif args.command == "build-cuda":
        build_cuda(args.arch)
    elif args.command == "serve":
        serve(args, parser)
    elif args.random_model:
        random_model_demo(args.layers, args.batch, args.src_len, args.new_tokens, args.repeats)
    else:
        from lightgen.demo.compare import run

        run(4 if args.short else args.sentences, args.batch, 1 if args.short else args.repeats)


if __name__ == "__main__":
    main()
