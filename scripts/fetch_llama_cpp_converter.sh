#!/usr/bin/env bash
# llama.cpp's reference GGUF writer alone — convert_hf_to_gguf.py with its conversion/ package and its own
# gguf-py, all plain Python — taken from the llama.cpp copy vendored in PyPI's llama-cpp-python sdist,
# without building anything (seconds, where scripts/build_llama_cpp.sh builds the binaries in ~25 min):
#
#   bash scripts/fetch_llama_cpp_converter.sh [DEST]      # default DEST: .cache/llama_cpp_converter
#
# The tests find it there (tests/support/llama_cpp.py: convert_dir); scripts/setup_env.sh calls this, so CI has it.
# Same version as build_llama_cpp.sh (LLAMA_CPP_PYTHON_VERSION); a DEST already holding it is kept.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$REPO/.cache/llama_cpp_converter}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}

if [ -f "$DEST/convert_hf_to_gguf.py" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "[llama.cpp converter] $VERSION already in $DEST"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[llama.cpp converter] downloading llama-cpp-python==$VERSION sdist"
# --no-binary for this one package: pip prepares the sdist's metadata (nothing is compiled) with
# scikit-build-core, which only looks for cmake; :all: would build cmake itself from source. Where both are
# installed already (build_llama_cpp.sh installs them) that takes seconds, else pip sets them up in an
# isolated environment (~15 s more).
isolation=()
if $PY -c "import scikit_build_core" 2>/dev/null && command -v cmake >/dev/null 2>&1; then
  isolation=(--no-build-isolation)
fi
$PY -m pip download --disable-pip-version-check -q --no-deps "${isolation[@]}" --no-binary llama-cpp-python \
    -d "$tmp" "llama-cpp-python==$VERSION"
root="llama_cpp_python-$VERSION/vendor/llama.cpp"
mkdir "$tmp/converter"
tar -xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp/converter" --strip-components=3 \
    "$root/convert_hf_to_gguf.py" "$root/conversion" "$root/gguf-py"
echo "$VERSION" > "$tmp/converter/VERSION"
mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST"
mv "$tmp/converter" "$DEST"
echo "[llama.cpp converter] $DEST/convert_hf_to_gguf.py"
