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
#    benches/bench_cpu_op.py's cache-resident ("hot") and DRAM ("cold") rows, in ROUNDS (3) alternating
#    rounds, then each side's best round and their ratio.
# 2. A Ternary-Bonsai-1.7B-shaped model: the synthetic checkpoint of benches/bench_vllm.py, converted by
#    `ternary-rs convert --to gguf --gguf-type TQ2_0`; `llama-bench -p 0 -n $TOKENS` (decode tokens/s; TOKENS=128 by default) at one
#    and two threads beside vLLM CPU + ternary_rs at batch 1 with the same thread counts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Decode tokens per run for both sides (tg<N>); a few seconds per run keeps this machine's noise down.
TOKENS=${TOKENS:-128}
# Alternating rounds of the GEMV comparison (section 1).
ROUNDS=${ROUNDS:-3}
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

echo "== 1. TQ2_0 GEMV, 14336 -> 4096, one thread, $ROUNDS alternating rounds"
# The two sides alternate round by round (this machine's speed drifts by 1.5x over minutes, so one run
# of each, minutes apart, compares different phases); the summary takes each side's best round.
gemv="$WORK/gemv_rounds.txt"
: > "$gemv"
for round in $(seq 1 "$ROUNDS"); do
  echo "-- round $round: llama.cpp test-backend-ops (G weights/s = 4096*14336 / time)"
  "$LLAMA_CPP_BIN/test-backend-ops" perf -o MUL_MAT -b CPU \
      -p 'type_a=tq2_0,type_b=f32,m=4096,n=(1|2|4|8),k=14336,' 2>&1 \
    | grep -o 'n=[0-9]*,k=14336.*us/run' \
    | sed -E 's/n=([0-9]+),k=14336.* ([0-9.]+) us\/run/\1 \2/' \
    | awk -v rounds="$gemv" '{ gws = 4096 * 14336 / $2 / 1000
             printf "  llama.cpp M=%s: %.3f ms, %.1f G weights/s\n", $1, $2 / 1000, gws
             print "llama", $1, gws >> rounds }'
  echo "-- round $round: ternary_rs (bench_cpu_op.py; 'int8 hot' is llama.cpp's condition)"
  "$PY" benches/bench_cpu_op.py --shapes 14336x4096 --m 1,2,4,8 --threads 1 --hot --no-bf16 --budget 1.5 \
    | tee "$WORK/ours_round.txt"
  awk '$NF != "" && $6 == "int8" && $7 == "hot" { print "ours", $4, $9 }' "$WORK/ours_round.txt" >> "$gemv"
done
echo "-- best round of each side (G weights/s)"
awk '{ if ($3 > best[$1 " " $2]) best[$1 " " $2] = $3 }
     END { for (m = 1; m <= 8; m *= 2) if (("llama " m) in best && ("ours " m) in best)
             printf "  M=%d: ternary_rs %.1f, llama.cpp %.1f: %.2fx\n", m, best["ours " m], best["llama " m],
                    best["ours " m] / best["llama " m] }' "$gemv"

echo "== 2. Bonsai-1.7B-shaped model, decode (batch 1)"
gguf="$WORK/bonsai-1.7b-TQ2_0.gguf"
if [ ! -f "$gguf" ]; then
  # The synthetic checkpoint first (bench_vllm.py writes it), then its TQ2_0 GGUF. TQ2_0 has one scale
  # per 256 weights, Bonsai (and the synthetic checkpoint) one per 128: --requantize re-ternarizes at
  # group 256. The weights change; decode speed does not depend on them.
  "$PY" benches/bench_vllm.py --preset bonsai-1.7b --workdir "$WORK/model" --only ternary --batches 1 --tokens 8 \
    > /dev/null
  "$PY" -m ternary_rs convert "$WORK/model/ternary" "$gguf" --to gguf --gguf-type TQ2_0 --requantize --no-progress
fi
# Each thread count: ours, then llama.cpp right after (adjacent runs see the same phase of the machine).
for threads in 1 2; do
  # One thread: vLLM's OpenMP pool bound to CPU 0 alone (its default binds every CPU).
  bind=()
  [ "$threads" = 1 ] && bind=(env VLLM_CPU_OMP_THREADS_BIND=0)
  "${bind[@]}" "$PY" benches/bench_vllm.py --preset bonsai-1.7b --workdir "$WORK/model" \
    --only ternary --batches 1 --tokens "$TOKENS" > "$WORK/vllm_${threads}thread.txt"
  echo "-- $threads thread(s): vLLM CPU + ternary_rs, batch 1: $(grep 'batch 1' "$WORK/vllm_${threads}thread.txt")"
  echo "-- $threads thread(s): llama.cpp llama-bench (tg$TOKENS)"
  "$LLAMA_CPP_BIN/llama-bench" -m "$gguf" -p 0 -n "$TOKENS" -t "$threads" -r 3 -o md 2>/dev/null
done
