#!/usr/bin/env bash
# The one-command device check of the CUDA kernels (H200 machine, no network; aim: well under 6 minutes).
#
# Needs the abi3 GPU wheel built on the build machine and carried along (dist/ is git-ignored):
#     maturin build --release --features cuda -o dist/       # here, with the CUDA toolkit
#     device run: carry ["dist"], command "bash benches/gpu_check.sh"
# It installs that wheel (pip --no-deps --no-index, into a private target dir), checks that the kernels
# load and see the GPU, runs the GPU tests (tests/test_cuda.py, tests/test_gpu_layout.py; on a failure
# the kernel tests once more through the Python path, to tell the native op registration from the
# kernels) and then benches/bench_gpu.py (the native op's per-call overhead, then ternary vs cuBLAS bf16
# on the 27B shapes). Uses only what the machine has:
# python3 with torch, numpy, pytest, hypothesis. Results also go to $OUT (when set) as files.
# SANITIZE=1 additionally runs a few GPU tests under compute-sanitizer memcheck (slow; Firecracker only).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-/tmp/ternary_gpu_check}
mkdir -p "$RESULTS"
status=0

# What the machine runs, before anything is installed: a refused wheel then explains itself (ours is
# manylinux_2_34: glibc >= 2.34).
echo "== machine"
ldd --version 2>&1 | head -1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null \
  || echo "nvidia-smi: not available"
python3 -c "import sys, torch; print(f'python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})')" \
  || { echo "gpu_check: python3 cannot import torch" >&2; exit 2; }

shopt -s nullglob
WHEELS=(dist/ternary_rs-*.whl)
shopt -u nullglob
if [ "${#WHEELS[@]}" -ne 1 ]; then
  echo "gpu_check: need exactly one CUDA wheel in dist/, found ${#WHEELS[@]}: ${WHEELS[*]:-none}" >&2
  echo "  (build it with: rm -rf dist && maturin build --release --features cuda -o dist/)" >&2
  exit 2
fi
WHEEL=${WHEELS[0]}
SITE=${TMPDIR:-/tmp}/ternary_rs_site
rm -rf "$SITE"
echo "== install $WHEEL"
python3 -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --target "$SITE" "$WHEEL" \
  || { echo "gpu_check: wheel install failed" >&2; exit 2; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

python3 - <<'PY' || exit 2
import sys, torch, ternary_rs
from ternary_rs import _core
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"ternary_rs {ternary_rs.__version__} from {ternary_rs.__file__}")
print(f"cuda_available={_core.cuda_available()} kernels' runtime sees {_core.cuda_device_count()} device(s); "
      f"torch sees {torch.cuda.device_count()}")
if not _core.cuda_available():
    sys.exit("gpu_check: the wheel has no CUDA kernels (build with --features cuda)")
if _core.cuda_device_count() < 1 or not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible")
PY

echo "== GPU tests"
# The kernel tests first and on their own: a collection error elsewhere must not hide them.
timeout 240 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider --noconftest \
  --junitxml="$RESULTS/gpu_tests_cuda.xml" 2>&1 | tee "$RESULTS/gpu_tests_cuda.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  status=1
  # Tell the natively registered op (torch/cuda_op.rs) apart from the kernels: the same tests through the
  # Python path (test_the_cuda_kernel_is_registered_natively then fails by design).
  echo "== GPU kernel tests again through the Python path (TERNARY_RS_CUDA_NATIVE=0)"
  TERNARY_RS_CUDA_NATIVE=0 timeout 180 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider --noconftest \
    -x --deselect tests/test_cuda.py::test_the_cuda_kernel_is_registered_natively 2>&1 \
    | tee "$RESULTS/gpu_tests_cuda_python_path.log" | tail -15
fi
# Then the layout tests and the CUDA FWHT (block 1024, width 5120, bf16/fp16/fp32).
timeout 180 python3 -m pytest tests/test_gpu_layout.py "tests/test_hadamard.py::test_cuda_matches_cpu" -q \
  -p no:cacheprovider --noconftest --continue-on-collection-errors \
  --junitxml="$RESULTS/gpu_tests_rest.xml" 2>&1 | tee "$RESULTS/gpu_tests_rest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "${SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck (subset)"
  # torch's caching allocator hands out sub-blocks of big allocations: memcheck only sees overruns
  # past real allocations, so turn the cache off (the kernels are built with -lineinfo for the report).
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest tests/test_cuda.py -q \
    -p no:cacheprovider --noconftest -k "group_32 or split_k or opcheck" 2>&1 | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

echo "== benchmark (ternary vs cuBLAS bf16)"
timeout 240 python3 benches/bench_gpu.py --json "$RESULTS/bench_gpu.json" 2>&1 | tee "$RESULTS/bench_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== gpu_check: $([ $status -eq 0 ] && echo ok || echo FAILED)"
exit $status
