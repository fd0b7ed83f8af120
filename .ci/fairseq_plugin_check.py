"""CI, in the wheel check's fresh venv: ``fairseq-interactive`` with the installed plugin
(``--user-dir "$(lightgen fairseq-plugin-dir)" --task translation_lightgen``), from a folder outside the source
tree, on a tiny fairseq Transformer with random weights; it must translate every line on lightgen's generator
(no fallback warning). Token parity with fairseq is tests/with_fairseq's job, on trained models."""

import subprocess
import sys
from pathlib import Path

import torch
from fairseq import options, tasks
from fairseq.data import Dictionary

root = Path(sys.argv[1])
vocab = Dictionary()
for i in range(40):
    vocab.add_symbol(f"w{i}")
for side in ("src", "tgt"):
    vocab.save(str(root / f"dict.{side}.txt"))
args = options.parse_args_and_arch(options.get_training_parser(), [
    str(root), "--arch", "transformer", "--source-lang", "src", "--target-lang", "tgt", "--encoder-layers", "2",
    "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"])
torch.manual_seed(0)
model = tasks.setup_task(args).build_model(args)
torch.save({"args": args, "model": model.state_dict(), "extra_state": {"train_iterator": {"epoch": 1}},
            "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                   "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, root / "model.pt")

scripts = Path(sys.executable).parent
plugin = subprocess.run([scripts / "lightgen", "fairseq-plugin-dir"], check=True, capture_output=True,
                        text=True).stdout.strip()
assert Path(plugin).is_relative_to(Path(sys.prefix)), f"the plugin is not the installed one: {plugin}"
lines = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9 w10 w11"]
for flags in (["--beam", "4"], ["--beam", "1", "--lightgen-decoding", "iad"]):
    done = subprocess.run([scripts / "fairseq-interactive", str(root), "--path", str(root / "model.pt"),
                           "--source-lang", "src", "--target-lang", "tgt", "--max-len-b", "12", *flags,
                           "--user-dir", plugin, "--task", "translation_lightgen"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=root, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    hypotheses = [line for line in done.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == len(lines), done.stdout
    assert "running fairseq's own generator" not in done.stderr, done.stderr[-3000:]
    print(f"fairseq-interactive {' '.join(flags)} with {plugin}: {len(hypotheses)} hypotheses")
