"""The matmul benchmark runs end to end in quick mode (its outputs are checked inside the script)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_matmul_benchmark_quick_run_writes_results(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/matmul.py", "--quick", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    payload = json.loads((tmp_path / "matmul.json").read_text())
    assert [entry["rows"] for entry in payload["results"]] == [1, 8]
    lightgen = payload["results"][0]["providers"]["lightgen"]
    assert lightgen["relative_error"] < 1e-5 and lightgen["ms"] > 0
    assert "| 1 |" in result.stdout
