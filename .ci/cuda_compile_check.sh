#!/usr/bin/env bash
# CI: every CUDA kernel compiles and links for sm_90 and sm_80 (no GPU here), through the loader code
# that builds them on first use on a GPU machine (`lightgen build-cuda`). The CPU test run uses the
# CPU torch build, which cannot compile .cu files, so this has its own venv with torch's CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
venv=.ci/venv-cuda  # inside the clone: CI caches nothing outside it
started=$SECONDS
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.14.1 -e .
echo "cuda compile check: venv ready in $((SECONDS - started)) s"
TORCH_EXTENSIONS_DIR="$PWD/.ci/cuda-build" "$venv/bin/lightgen" build-cuda --arch 9.0 --arch 8.0
echo "cuda compile check: done in $((SECONDS - started)) s"
