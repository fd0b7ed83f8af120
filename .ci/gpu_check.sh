#!/usr/bin/env bash
# On a machine with a GPU: build the kernels (CPU, and CUDA for the visible GPU), run the cuda-marked tests and
# the GPU generate() benchmark, and leave the environment report with the build logs, a JUnit report and the
# benchmark's JSON, chart and profile in $OUT (default ./gpu-check). Uses $PYTHON (default python3, with
# pytest-xdist and pytest-timeout) and this checkout (PYTHONPATH), and, where present:
#   .whl/*.whl            wheels the machine lacks (transformers in lightgen's range), installed to /tmp/site
#   .gpu-prebuilt/<dir>   a CUDA library built elsewhere for the GPU machine's torch build (in a venv with that torch:
#                         TORCH_EXTENSIONS_DIR=.gpu-prebuilt lightgen build-cuda --arch 9.0), loaded as "built by
#                         another compiler" instead of compiling here; compiled here if it does not load
# GPU_CHECK_TESTS / GPU_CHECK_BENCH=0 skip a part; GPU_CHECK_PYTEST_ARGS adds pytest arguments (-k ...).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
py="${PYTHON:-python3}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/lightgen-gpu-check}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
mkdir -p "$TORCH_EXTENSIONS_DIR"
nvidia-smi > "$out/env.txt" 2>&1
started=$SECONDS

# The CPU library first, on its own (no GPU visible, so no CUDA build starts).
CUDA_VISIBLE_DEVICES="" "$py" -c "from lightgen import _build; print('cpu:', _build.load())" 2>&1 | tee -a "$out/env.txt"
echo "cpu build: $((SECONDS - started)) s" | tee -a "$out/env.txt"
if compgen -G ".gpu-prebuilt/*" > /dev/null; then
    cp -r .gpu-prebuilt/* "$TORCH_EXTENSIONS_DIR/"
    # No compiler found: the loader takes the carried library, built by another compiler.
    export CXX=/nonexistent/c++
    "$py" -c "from lightgen import _build; s = _build.load(); print('cuda (prebuilt):', s.cuda)" 2>&1 \
        | tee -a "$out/env.txt" | grep -q "compiled=True" || { echo "prebuilt CUDA library did not load"; unset CXX; }
fi
"$py" -m lightgen.env 2>&1 | tee -a "$out/env.txt"
echo "build (or cache load): $((SECONDS - started)) s" | tee -a "$out/env.txt"
for log in "$TORCH_EXTENSIONS_DIR"/*/build.log; do  # into env.txt: a lent GPU machine returns at most 8 files
    [ -f "$log" ] && { echo "=== $log"; cat "$log"; } >> "$out/env.txt"
done

status=0
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
    # shellcheck disable=SC2086
    timeout 150 "$py" -m pytest -q -p no:cacheprovider -m cuda -rfE -n 8 --timeout 120 \
        tests/ops/test_cuda.py tests/adapters/test_cuda_parity.py ${GPU_CHECK_PYTEST_ARGS:-} \
        --junitxml="$out/cuda-tests.xml" > "$out/cuda-tests.txt" 2>&1
    status=$?
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/cuda-tests.txt" | cut -c1-300 | tail -60
    echo "tests: $((SECONDS - started)) s, pytest exit status $status"
fi
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
    timeout 290 "$py" benchmarks/gpu_generate.py --profile --out "$out" > "$out/gpu_generate.txt" 2>&1
    bench=$?
    tail -25 "$out/gpu_generate.txt"
    echo "benchmark: $((SECONDS - started)) s, exit status $bench"
    [ "$bench" = 0 ] || status=1
fi
echo "total: $((SECONDS - started)) s"
exit "$status"
