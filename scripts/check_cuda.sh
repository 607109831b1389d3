#!/usr/bin/env bash
# CUDA checks that need no GPU (CI): compile every cuda/*.cu for sm_89 and sm_90 (+ compute_90 PTX)
# with warnings as errors, fail if ptxas reports any spill or stack frame in a kernel, then build and run
# the host tests of the kernels' per-thread fragment/unpack/permutation logic (cuda/tests).
# Toolkit: CUDA_HOME / CUDA_PATH, nvcc on PATH, or the PyPI one (scripts/setup_env.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."

find_nvcc() {
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then echo "$d/bin/nvcc"; return; fi
  done
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return; fi
  python3 - <<'PY'
import os, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
for p in nvidia.__path__:
    for sub in ("cu13", "cu12", "cuda_nvcc"):
        c = os.path.join(p, sub, "bin", "nvcc")
        if os.access(c, os.X_OK):
            print(c)
            sys.exit(0)
PY
}

NVCC=$(find_nvcc)
if [ -z "$NVCC" ]; then
  echo "check_cuda: no nvcc found (set CUDA_HOME or run scripts/setup_env.sh)" >&2
  exit 1
fi
echo "== nvcc: $NVCC ($("$NVCC" --version | tail -1))"

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# 1. Host tests first (seconds): the kernels' index logic replayed over whole grids against a reference.
echo "== host tests of the fragment logic (g++)"
CXX=${CXX:-g++}
"$CXX" -std=c++17 -O2 -Wall -Wextra -Werror cuda/tests/test_fragments.cpp -o "$OUT/test_fragments"
"$OUT/test_fragments" | tail -3
echo "== host replay of the int8 activation quantizers (g++)"
"$CXX" -std=c++17 -O2 -Wall -Wextra -Werror cuda/tests/test_activation_quant.cpp -o "$OUT/test_activation_quant"
"$OUT/test_activation_quant" --self-test | tail -2

# 2. Device compile: both real architectures and PTX, warnings as errors, ptxas statistics.
echo "== nvcc sm_89 + sm_90 + compute_90, -Werror all-warnings"
for src in cuda/*.cu; do
  "$NVCC" -std=c++17 -O3 -Werror all-warnings -Xptxas -v -Xcompiler -fPIC,-Wall,-Wextra \
    -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90,code=sm_90 \
    -gencode arch=compute_90,code=compute_90 -c "$src" -o "$OUT/$(basename "$src" .cu).o" 2>> "$OUT/ptxas.log" \
    || { cat "$OUT/ptxas.log" >&2; exit 1; }
done

# 3. No kernel may spill or use a stack frame (local memory in the hot loops).
python3 - "$OUT/ptxas.log" <<'PY'
import re, sys
log = open(sys.argv[1]).read().splitlines()
kernel, arch, bad, n = None, None, [], 0
for line in log:
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
    if m:
        kernel, arch = m.group(1), m.group(2)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and kernel:
        n += 1
        if any(int(v) for v in m.groups()):
            bad.append(f"{arch} {kernel}: {line.strip()}")
    m = re.search(r"Used (\d+) registers", line)
    if m and kernel:
        short = re.sub(r"_ZN7ternary\w*?(gemm_kernel|gemv_kernel)", r"\1", kernel)[:70]
        print(f"   {arch} {short}: {m.group(1)} registers")
if n == 0:
    sys.exit("check_cuda: ptxas printed no statistics (did -Xptxas -v change?)")
if bad:
    print("check_cuda: spills or stack frames in kernels:", *bad, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print(f"== ptxas: {n} kernel builds, no spills, no stack frames")
PY
# 4. The bindings with the CUDA kernels linked in (the native CUDA op registration, torch/cuda_op.rs):
#    compiled and linted as the GPU wheel builds them.
echo "== cargo clippy --features cuda (bindings + kernels)"
CUDA_HOME=$(dirname "$(dirname "$NVCC")") cargo clippy -q -p ternary-rs-py --features cuda --all-targets -- -D warnings
echo "== check_cuda: ok"
