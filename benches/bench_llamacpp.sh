#!/usr/bin/env bash
# Upstream llama.cpp's TQ2_0 numbers beside ours, same machine, same shapes and model, one run
# (optional: never part of CI).
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin bash benches/bench_llamacpp.sh [WORKDIR]
#
# Without LLAMA_CPP_BIN it first builds upstream llama.cpp from the source vendored in PyPI's
# llama-cpp-python sdist (scripts/build_llama_cpp.sh, about 25 minutes on 2 cores) into
# ${LLAMA_CPP_DIR:-$HOME/.cache/ternary_rs/llama.cpp}.
#
# 1. GEMV at the shape llama.cpp's own perf suite times (14336 -> 4096, M = 1, 2, 4, 8, one thread):
#    `test-backend-ops perf -o MUL_MAT` on TQ2_0 (its weights stay in cache between runs) beside
#    benches/bench_cpu_op.py's cache-resident ("hot") and DRAM ("cold") rows.
# 2. A Ternary-Bonsai-1.7B-shaped model: the synthetic checkpoint of benches/bench_vllm.py, converted by
#    `ternary-rs convert --to gguf --gguf-type TQ2_0`; `llama-bench -p 0 -n $TOKENS` (decode tokens/s; TOKENS=128 by default) at one
#    and two threads beside vLLM CPU + ternary_rs at batch 1 with the same thread counts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Decode tokens per run for both sides (tg<N>); a few seconds per run keeps this machine's noise down.
TOKENS=${TOKENS:-128}
WORK=${1:-$(mktemp -d /tmp/bench_llamacpp.XXXXXX)}
mkdir -p "$WORK"

if [ -z "${LLAMA_CPP_BIN:-}" ]; then
  dest=${LLAMA_CPP_DIR:-$HOME/.cache/ternary_rs/llama.cpp}
  [ -x "$dest/build/bin/llama-bench" ] || bash scripts/build_llama_cpp.sh "$dest"
  LLAMA_CPP_BIN=$dest/build/bin
fi
for tool in test-backend-ops llama-bench; do
  [ -x "$LLAMA_CPP_BIN/$tool" ] || { echo "no $tool in $LLAMA_CPP_BIN" >&2; exit 2; }
done

echo "== 1. TQ2_0 GEMV, 14336 -> 4096, one thread"
echo "-- llama.cpp test-backend-ops (G weights/s = 4096*14336 / time)"
"$LLAMA_CPP_BIN/test-backend-ops" perf -o MUL_MAT -b CPU \
    -p 'type_a=tq2_0,type_b=f32,m=4096,n=(1|2|4|8),k=14336,' 2>&1 \
  | grep -o 'n=[0-9]*,k=14336.*us/run' \
  | sed -E 's/n=([0-9]+),k=14336.* ([0-9.]+) us\/run/\1 \2/' \
  | while read -r n us; do
      awk -v n="$n" -v us="$us" 'BEGIN { printf "  llama.cpp M=%s: %.3f ms, %.1f G weights/s\n", n, us / 1000, 4096 * 14336 / us / 1000 }'
    done
echo "-- ternary_rs (bench_cpu_op.py; 'int8 hot' is llama.cpp's condition)"
"$PY" benches/bench_cpu_op.py --shapes 14336x4096 --m 1,2,4,8 --threads 1 --hot --no-bf16 --budget 1.5

echo "== 2. Bonsai-1.7B-shaped model, decode (batch 1)"
"$PY" benches/bench_vllm.py --preset bonsai-1.7b --workdir "$WORK/model" --only ternary --batches 1 --tokens "$TOKENS" \
  > "$WORK/vllm_2threads.txt"
gguf="$WORK/bonsai-1.7b-TQ2_0.gguf"
# TQ2_0 has one scale per 256 weights, Bonsai (and the synthetic checkpoint) one per 128: --requantize
# re-ternarizes at group 256. The weights change; decode speed does not depend on them.
[ -f "$gguf" ] || "$PY" -m ternary_rs convert "$WORK/model/ternary" "$gguf" --to gguf --gguf-type TQ2_0 --requantize \
  --no-progress
echo "-- llama.cpp llama-bench (tg$TOKENS)"
"$LLAMA_CPP_BIN/llama-bench" -m "$gguf" -p 0 -n "$TOKENS" -t 1,2 -r 3 -o md 2>/dev/null
echo "-- vLLM CPU + ternary_rs, batch 1"
VLLM_CPU_OMP_THREADS_BIND=0 "$PY" benches/bench_vllm.py --preset bonsai-1.7b --workdir "$WORK/model" --only ternary \
  --batches 1 --tokens "$TOKENS" > "$WORK/vllm_1thread.txt"
echo "  1 thread:  $(grep 'batch 1' "$WORK/vllm_1thread.txt")"
echo "  2 threads: $(grep 'batch 1' "$WORK/vllm_2threads.txt")"
