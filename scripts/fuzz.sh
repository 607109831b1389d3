#!/usr/bin/env bash
# Fuzz every reader, decoder and metadata parser; not part of CI.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]      (default 120 s, every target)
#
# Rust targets (rust/ternary-core/fuzz, harnesses in ternary_core::fuzzing): the GGUF and safetensors
# readers, the sharded-index parser and every block decoder, built for libFuzzer with AddressSanitizer
# exactly as `cargo fuzz build` does (same RUSTFLAGS; cargo-fuzz itself is not needed). That needs a
# nightly toolchain; without one, stable is used with RUSTC_BOOTSTRAP=1 (the script says which).
# Python target `prism_hadamard` (scripts/fuzz_hadamard.py): the prism.hadamard.* GGUF metadata and
# quantization_config["hadamard"] parsers (ternary_rs.core.hadamard.HadamardSpec), a mutation fuzzer.
#
# Targets run one at a time under `nice -n 10` (the machine may be shared), each for SECONDS_PER_TARGET
# and then on until MIN_EXECS (default 10^6) executions, seeded from the test corpora
# (scripts/fuzz_seeds.py) and rust/ternary-core/fuzz/regressions/<target>/. Limits: RSS_LIMIT_MB
# (default 2048), MALLOC_LIMIT_MB (default 128: any single allocation above it is a finding — inputs are
# at most MAX_LEN = 65536 bytes (4096 for the decoders), so only sizes taken from a header unchecked
# could reach it), TIMEOUT_S
# per input (default 10: a hang). Findings land in $FUZZ_DIR/artifacts/<target>/ (default
# target/fuzz-work); minimize one with `<binary> -minimize_crash=1 <file>` and copy it into
# rust/ternary-core/fuzz/regressions/<target>/, where `cargo test` replays it.
# Prints one line per target — executions, exec/s, findings — and exits 1 if anything was found.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SECONDS_PER_TARGET="${1:-120}"
shift || true
MIN_EXECS="${MIN_EXECS:-1000000}"
RSS_LIMIT_MB="${RSS_LIMIT_MB:-2048}"
MALLOC_LIMIT_MB="${MALLOC_LIMIT_MB:-128}"
TIMEOUT_S="${TIMEOUT_S:-10}"
MAX_LEN="${MAX_LEN:-65536}"
FUZZ_DIR="${FUZZ_DIR:-$ROOT/target/fuzz-work}"
FUZZ_CRATE="$ROOT/rust/ternary-core/fuzz"
TRIPLE="$(rustc -vV | sed -n 's/^host: //p')"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"

RUST_TARGETS=(gguf_open safetensors_open safetensors_index decode_tq1_0 decode_tq2_0 decode_q2_0
  decode_pq2_0 decode_ptq1_0 decode_q1_0 decode_stq1_0 decode_i2_s decode_bitnet decode_mlx decode_dense)
ALL_TARGETS=("${RUST_TARGETS[@]}" prism_hadamard)
SELECTED=("$@")
[ ${#SELECTED[@]} -eq 0 ] && SELECTED=("${ALL_TARGETS[@]}")

# ---- toolchain ---------------------------------------------------------------------------------
if rustup run nightly rustc --version >/dev/null 2>&1; then
  CARGO=(cargo +nightly)
  echo "toolchain: $(rustup run nightly rustc --version) (nightly)"
else
  CARGO=(env RUSTC_BOOTSTRAP=1 cargo)
  echo "toolchain: $(rustc --version) (stable with RUSTC_BOOTSTRAP=1: no nightly installed)"
fi

# ---- seeds and build ---------------------------------------------------------------------------
mkdir -p "$FUZZ_DIR/seeds" "$FUZZ_DIR/corpus" "$FUZZ_DIR/artifacts" "$FUZZ_DIR/logs"
python3 "$ROOT/scripts/fuzz_seeds.py" "$FUZZ_DIR/seeds" >/dev/null

needs_rust=0
for t in "${SELECTED[@]}"; do [ "$t" != prism_hadamard ] && needs_rust=1; done
if [ $needs_rust -eq 1 ]; then
  # cargo-fuzz's flags for libFuzzer + ASan (cargo fuzz build --release, default sanitizer).
  RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Zsanitizer=address -Cdebug-assertions \
-Coverflow-checks -Cforce-frame-pointers" \
  ASAN_OPTIONS=detect_odr_violation=0 \
    nice -n 10 "${CARGO[@]}" build --manifest-path "$FUZZ_CRATE/Cargo.toml" --release \
    --target "$TRIPLE" --bins --target-dir "$FUZZ_DIR/build" 2>&1 | tail -3
fi
BIN_DIR="$FUZZ_DIR/build/$TRIPLE/release"

# ---- run ---------------------------------------------------------------------------------------
printf '%-20s %12s %10s %9s  %s\n' target executions exec/s findings notes
total_findings=0
for t in "${SELECTED[@]}"; do
  log="$FUZZ_DIR/logs/$t.log"
  mkdir -p "$FUZZ_DIR/corpus/$t" "$FUZZ_DIR/artifacts/$t" "$FUZZ_DIR/seeds/$t"
  before=$(find "$FUZZ_DIR/artifacts/$t" -type f | wc -l)
  execs=0 secs=0 notes=""
  : >"$log"
  if [ "$t" = prism_hadamard ]; then
    nice -n 10 python3 "$ROOT/scripts/fuzz_hadamard.py" --seconds "$SECONDS_PER_TARGET" \
      --min-execs "$MIN_EXECS" --artifacts "$FUZZ_DIR/artifacts/$t" >"$log" 2>&1 || true
    execs=$(sed -n 's/^executions: //p' "$log" | tail -1)
    secs=$(sed -n 's/^seconds: //p' "$log" | tail -1)
  else
    budget=$SECONDS_PER_TARGET
    while :; do
      start=$(date +%s)
      # -runs caps a continuation at what is still missing; the first round runs on time alone.
      runs=-1
      [ "$execs" -gt 0 ] && runs=$((MIN_EXECS - execs))
      # Decoders read at most ~1 KiB (small shapes); longer inputs would only slow them down.
      len=$MAX_LEN
      case $t in decode_*) len=$((MAX_LEN < 4096 ? MAX_LEN : 4096)) ;; esac
      ASAN_OPTIONS=detect_odr_violation=0:allocator_may_return_null=0 nice -n 10 "$BIN_DIR/$t" \
        -max_total_time="$budget" -runs="$runs" -rss_limit_mb="$RSS_LIMIT_MB" \
        -malloc_limit_mb="$MALLOC_LIMIT_MB" -timeout="$TIMEOUT_S" -max_len="$len" \
        -print_final_stats=1 -artifact_prefix="$FUZZ_DIR/artifacts/$t/" \
        "$FUZZ_DIR/corpus/$t" "$FUZZ_DIR/seeds/$t" >>"$log" 2>&1 || true
      got=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
      execs=$((execs + ${got:-0}))
      secs=$((secs + $(date +%s) - start))
      # Stop on a finding, at MIN_EXECS, or when a round made no progress (it crashed at start).
      if [ "$(find "$FUZZ_DIR/artifacts/$t" -type f | wc -l)" -gt "$before" ] || [ "$execs" -ge "$MIN_EXECS" ] ||
        [ "${got:-0}" -eq 0 ]; then
        break
      fi
      budget=$((SECONDS_PER_TARGET * 4))
      notes="continued to reach $MIN_EXECS"
    done
  fi
  found=$(($(find "$FUZZ_DIR/artifacts/$t" -type f | wc -l) - before))
  total_findings=$((total_findings + found))
  rate=$(( ${execs:-0} / (${secs:-1} > 0 ? ${secs:-1} : 1) ))
  [ "$found" -gt 0 ] && notes="$notes see $FUZZ_DIR/artifacts/$t and $log"
  [ "${execs:-0}" -lt "$MIN_EXECS" ] && notes="$notes BELOW MIN_EXECS"
  printf '%-20s %12s %10s %9s  %s\n' "$t" "${execs:-0}" "$rate" "$found" "$notes"
done
rm -rf /dev/shm/ternary-fuzz-* 2>/dev/null || true
echo "findings: $total_findings"
[ "$total_findings" -eq 0 ]
