#!/usr/bin/env bash
# The whole test suite, from a fresh clone: environment, Rust checks, CUDA compile checks, Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
bash scripts/setup_env.sh
echo "== cargo fmt";    cargo fmt --all -- --check
echo "== cargo clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== ruff";         python3 -m ruff check python tests benches scripts
echo "== cargo test";   cargo test --workspace --release
echo "== cuda (compile + spill checks + host tests, no GPU needed)"; bash scripts/check_cuda.sh
echo "== build";        bash scripts/build.sh
echo "== pytest"
# pytest exits 5 when it collects no test: set -e turns that into a failure, as it must.
# Two workers, one test file each at a time (module fixtures are built once): most of a test is
# single-threaded (Python imports, subprocess CLIs, vLLM start-up), so two cores run two files.
python3 -m pytest tests -q -n "${TERNARY_TEST_WORKERS:-2}" --dist loadfile --durations=25
