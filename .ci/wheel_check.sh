#!/usr/bin/env bash
# CI: lightgen as `pip install lightgen` gives it. Build the wheel, install it (not editable) in a fresh venv
# outside the source tree, and from another folder run `lightgen demo --short` and fairseq-interactive with the
# installed plugin (`--user-dir "$(lightgen fairseq-plugin-dir)"`). The kernels come from the cache the test run
# filled (same torch build, another venv): the demo must say "loaded from cache".
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/lightgen-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
python=${PYTHON:-"$repo/.venv/bin/python"}
started=$SECONDS

# From a copy of the tree's files (tracked and new, not ignored): setuptools' build/ folder in the tree could
# hold files deleted since, and would slip them into the wheel.
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo" && tar --null --ignore-failed-read -cf - -T - 2>/dev/null) | tar -xf - -C "$work/src"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/lightgen-*.whl)
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet torch==2.13.0 "$wheel[fairseq]"
echo "wheel check: built and installed $(basename "$wheel") in $((SECONDS - started)) s"

mkdir "$work/elsewhere" && cd "$work/elsewhere"
unset PYTHONPATH
export PATH="$work/venv/bin:$PATH"
installed=$(python -c "import lightgen; print(lightgen.__file__)")
case "$installed" in
    "$work/venv/"*) ;;
    *) echo "wheel check: lightgen was imported from $installed, not from the wheel" >&2; exit 1 ;;
esac
lightgen demo --short | tee demo.log
grep -q "kernels: compiled (loaded from cache in" demo.log || {
    echo "wheel check: the fresh venv compiled the kernels again instead of loading the shared cache" >&2; exit 1; }
echo "wheel check: demo done at $((SECONDS - started)) s"

lightgen install-fairseq  # pip reuses the fairseq wheel it built for the test command
python "$repo/.ci/fairseq_plugin_check.py" "$work/elsewhere"
echo "wheel check: passed in $((SECONDS - started)) s"
