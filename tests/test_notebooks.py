"""Every notebook in notebooks/ runs headless, top to bottom, without errors."""

import os
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    if "fairseq" in path.name and not os.environ.get("CI"):  # CI installs fairseq: there it must run
        pytest.importorskip("fairseq", reason="fairseq not installed: pip install -e '.[fairseq]' && "
                                              "lightgen install-fairseq")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # Keep Jupyter's runtime and config files out of $HOME.
    for variable in ("JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR", "IPYTHONDIR"):
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # A kernel whose virtualenv is not on PATH (registered from another environment): console scripts are found
    # beside sys.executable, not by name.
    scripts = os.path.dirname(os.path.abspath(sys.executable))
    monkeypatch.setenv("PATH", os.pathsep.join(entry for entry in os.environ.get("PATH", "").split(os.pathsep)
                                               if os.path.abspath(entry) != scripts))
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
