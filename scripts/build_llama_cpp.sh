#!/usr/bin/env bash
# Build upstream llama.cpp (the copy vendored in PyPI's llama-cpp-python sdist) for the tests that check
# our GGUF output in real llama.cpp:  bash scripts/build_llama_cpp.sh DEST
#
# Result:  DEST/build/bin/llama-completion (+ llama-cli, llama-server, llama-bench, test-backend-ops when
# that version has them), DEST/convert_hf_to_gguf.py with DEST/conversion and DEST/gguf-py (llama.cpp's own reference GGUF
# writer). Point the tests at it with  export LLAMA_CPP_BIN=DEST/build/bin  (they skip without it).
# Takes ~25 min on 2 cores, so CI (scripts/test.sh) does not run it.
set -euo pipefail
DEST=${1:?usage: build_llama_cpp.sh DEST}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"

mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

# Build tools (PyPI wheels): cmake and ninja binaries, scikit-build-core for pip download's metadata step.
command -v cmake >/dev/null 2>&1 || $PIP "cmake>=3.21"
command -v ninja >/dev/null 2>&1 || $PIP ninja
$PY -c "import scikit_build_core" 2>/dev/null || $PIP scikit-build-core

sdist_dir="$DEST/sdist"
mkdir -p "$sdist_dir"
if ! ls "$sdist_dir"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
  echo "[llama.cpp] downloading llama-cpp-python==$VERSION sdist"
  $PY -m pip download --disable-pip-version-check --no-deps --no-build-isolation --no-binary :all: \
      -d "$sdist_dir" "llama-cpp-python==$VERSION"
fi
tarball=$(ls "$sdist_dir"/llama_cpp_python-"$VERSION".tar.gz)
src="$DEST/src"
if [ ! -f "$src/CMakeLists.txt" ]; then
  rm -rf "$src.tmp" && mkdir -p "$src.tmp"
  tar -xzf "$tarball" -C "$src.tmp" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
  mv "$src.tmp" "$src"
fi

# llama.cpp's reference converter and its gguf-py, next to the binaries.
cp "$src/convert_hf_to_gguf.py" "$DEST/"
[ -f "$src/convert_hf_to_gguf_update.py" ] && cp "$src/convert_hf_to_gguf_update.py" "$DEST/"
# The converter imports `gguf` from ./gguf-py and its model classes from ./conversion (newer versions).
for d in gguf-py conversion; do
  [ -d "$src/$d" ] && rm -rf "$DEST/$d" && cp -r "$src/$d" "$DEST/$d"
done

echo "[llama.cpp] configuring"
cmake -S "$src" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=ON \
      -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF

# Build whichever of the wanted targets this version defines; llama-completion is required.
available=$(cmake --build "$DEST/build" --target help | sed -n 's/^\([A-Za-z0-9_-]*\):.*/\1/p')
targets=()
for t in llama-completion llama-bench test-backend-ops llama-cli llama-server; do
  if grep -qx "$t" <<<"$available"; then targets+=("$t"); else echo "[llama.cpp] (no target $t here)"; fi
done
grep -qx llama-completion <<<"$available" || { echo "[llama.cpp] error: no llama-completion target" >&2; exit 1; }
echo "[llama.cpp] building ${targets[*]} with -j$JOBS"
start=$(date +%s)
cmake --build "$DEST/build" -j "$JOBS" --target "${targets[@]}"
echo "[llama.cpp] built in $(( $(date +%s) - start )) s: $DEST/build/bin"
ls "$DEST/build/bin"
echo "export LLAMA_CPP_BIN=$DEST/build/bin"
