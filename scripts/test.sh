#!/usr/bin/env bash
# The whole test suite, from a fresh clone: environment, Rust checks, CUDA compile checks, Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# Each step says when it starts (seconds since the start): CI's budget is 30 minutes in all.
step() { echo "== $1 (at ${SECONDS} s)"; }
bash scripts/setup_env.sh
step "cargo fmt";    cargo fmt --all -- --check
step "cargo clippy"; cargo clippy --workspace --all-targets -- -D warnings
step "ruff";         python3 -m ruff check python tests benches scripts
step "cargo test";   cargo test --workspace --release
step "cuda (compile + spill checks + host tests, no GPU needed)"; bash scripts/check_cuda.sh
step "build";        bash scripts/build.sh
step "pytest"
# pytest exits 5 when it collects no test: set -e turns that into a failure, as it must.
# Two workers, one test file each at a time (module fixtures are built once): most of a test is
# single-threaded (Python imports, subprocess CLIs, vLLM start-up), so two cores run two files.
python3 -m pytest tests -q -n "${TERNARY_TEST_WORKERS:-2}" --dist loadfile --durations=40
step "done"
