#!/usr/bin/env bash
# On a machine with a GPU: build the kernels (CPU, and CUDA for the visible GPU), run the cuda-marked
# tests, and leave the environment report, build logs and a JUnit report in $OUT (default ./gpu-check).
# Uses the python on PATH and this checkout as is (PYTHONPATH), installing nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/lightgen-gpu-check}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
started=$SECONDS
python -m lightgen.env 2>&1 | tee "$out/env.txt"
echo "build (or cache load): $((SECONDS - started)) s" | tee -a "$out/env.txt"
for log in "$TORCH_EXTENSIONS_DIR"/*/build.log; do
    [ -f "$log" ] && cp "$log" "$out/$(basename "$(dirname "$log")").log"
done
python -m pytest -q -p no:cacheprovider -m cuda -rfE tests/ops/test_cuda.py tests/adapters/test_cuda_parity.py \
    --junitxml="$out/cuda-tests.xml" 2>&1 | tee "$out/cuda-tests.txt"
status=${PIPESTATUS[0]}
echo "total: $((SECONDS - started)) s, pytest exit status $status"
exit "$status"
