"""Benchmarks run end to end in quick mode (each checks its outputs inside the script)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _quick_run(script: str, out_dir: Path) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--quick", "--out", str(out_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads((out_dir / f"{script}.json").read_text()), result.stdout


def test_matmul_benchmark_quick_run_writes_results(tmp_path):
    payload, stdout = _quick_run("matmul", tmp_path)
    assert [entry["rows"] for entry in payload["results"]] == [1, 8]
    lightgen = payload["results"][0]["providers"]["lightgen"]
    assert lightgen["relative_error"] < 1e-5 and lightgen["ms"] > 0
    assert "| 1 |" in stdout


def test_int8_keeps_the_demo_model_close_to_fp32(tmp_path):
    payload, _ = _quick_run("quality", tmp_path)  # exits non-zero if lightgen fp32 differs from HF
    rows = {(row["provider"], row["decoding"]): row for row in payload["results"]}
    for decoding in ("greedy", "beam 4"):
        assert rows["lightgen fp32", decoding]["sentences_equal_hf_fp32"] == 1.0
        assert rows["lightgen int8", decoding]["tokens_equal_hf_fp32"] >= 0.97
        assert rows["lightgen int8", decoding]["f0_5"] >= rows["hf fp32", decoding]["f0_5"] - 0.05


def test_every_benchmark_script_imports():
    """The scripts CI does not run still import what they use (quantize_quality.py once imported a helper that
    had moved, and only failed when someone ran it). fairseq.py (shadows the package) and the CTranslate2 and
    llama.cpp workers (optional installs) are left out."""
    scripts = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py")
                     if path.stem not in ("fairseq", "_ct2_worker", "_llama_worker"))
    code = "import importlib, sys; sys.path.insert(0, 'benchmarks'); [importlib.import_module(n) for n in sys.argv[1:]]"
    result = subprocess.run([sys.executable, "-c", code, *scripts], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
