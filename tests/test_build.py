"""The kernel loader: env report, fallback to references, strict mode, concurrent first builds."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightgen import _build
from lightgen._compat import check_transformers_version
from lightgen.env import format_report, report

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=600)


def test_every_schema_has_reference_and_fake():
    from lightgen import ops

    assert set(_build.schemas()) == set(ops.REFERENCES) == set(ops.FAKES)


def test_every_op_has_a_cuda_kernel_built_only_where_a_gpu_is():
    registered = set()
    for path in _build.cuda_sources():
        registered |= set(re.findall(r'm\.impl\("(\w+)"', path.read_text()))
    assert registered == set(_build.schemas())
    assert _build._gencode_flags(["9.0", "8.0"]) == ["-gencode=arch=compute_90,code=sm_90",
                                                     "-gencode=arch=compute_80,code=sm_80"]
    if not torch.cuda.is_available():
        assert _build.load().cuda is None
        assert report()["ops"]["attention"]["cuda"] == "n/a (no CUDA device)"


def test_env_report_lists_every_op_as_compiled():
    info = report()
    assert info["kernels_compiled"]
    assert set(info["ops"]) == set(_build.schemas())
    assert all(where["cpu"] == "compiled" for where in info["ops"].values())
    assert "attention" in format_report(info)


def test_transformers_outside_tested_range_is_refused():
    for outside in ("4.57.0", "5.20.2", "5.25.0"):
        with pytest.raises(ImportError, match=r"supports transformers >=5.21.0,<5.25.0"):
            check_transformers_version(outside)
    for tested in ("5.21.1", "5.22.2", "5.23.0", "5.24.0"):
        check_transformers_version(tested)


@pytest.mark.slow
def test_disabled_extension_falls_back_with_one_warning_per_op_and_same_results():
    """LIGHTGEN_DISABLE_EXT=1: op, family parity and engine tests pass on the references (the C++ error
    messages are the kernels' own, so those tests stay with the kernels; GAD's tests add drafting
    logic, not ops, and would double this run)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops", "tests/adapters/test_parity.py",
         "tests/generation", "--ignore", "tests/generation/test_gad.py", "-k", "not error and not raise", "-W",
         "ignore::RuntimeWarning"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "LIGHTGEN_DISABLE_EXT": "1"}, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    warned = _run("""
        import warnings, torch
        from lightgen import ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ops.layer_norm(torch.randn(2, 8), torch.ones(8), None, 1e-5)
                ops.bias_act(torch.randn(2, 8), None, "gelu")
        print(len(caught)); print(caught[0].message)
    """, LIGHTGEN_DISABLE_EXT="1")
    count, message = warned.stdout.splitlines()[:2]
    assert count == "2" and "LIGHTGEN_DISABLE_EXT=1" in message and "layer_norm_ref" in message


def test_failed_build_warns_with_log_path_and_strict_mode_raises(tmp_path):
    """A broken compiler: references run with a warning naming the log; LIGHTGEN_STRICT=1 raises."""
    fake_compiler = tmp_path / "broken-c++"
    fake_compiler.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    fake_compiler.chmod(0o755)
    env = dict(CXX=str(fake_compiler), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = """
        import torch
        from lightgen import _build, ops
        status = _build.load()
        print(status.compiled, status.log_path)
        print(ops.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6).sum().item())
    """
    result = _run(code, **env)
    assert result.returncode == 0, result.stderr
    compiled, log_path = result.stdout.splitlines()[0].split()
    assert compiled == "False" and "broken" in Path(log_path).read_text()
    assert "no compiled kernel for op 'rms_norm'" in result.stderr and log_path in result.stderr
    strict = _run(code, LIGHTGEN_STRICT="1", **env)
    assert strict.returncode != 0 and "KernelBuildError" in strict.stderr


@pytest.mark.slow
def test_two_processes_building_at_once_both_get_kernels(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "from lightgen import _build; print(_build.load().compiled)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env) for _ in range(2)]
    outputs = [proc.communicate(timeout=900) for proc in procs]
    assert [out.strip() for out, _ in outputs] == ["True", "True"], outputs


@pytest.mark.skipif(not _build.lock_file_blocks(), reason="this torch's build lock frees itself")
def test_a_lock_left_by_a_killed_build_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    _build.clear_stale_lock(tmp_path)  # a fresh lock belongs to a build in progress
    assert lock.exists()
    old = time.time() - _build.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removing a build lock left 16 minutes ago"):
        _build.clear_stale_lock(tmp_path)
    assert not lock.exists()
