#!/usr/bin/env bash
# Build the Rust extension (release) and install the package in editable mode into the current Python.
# Rerun after changing Rust code. Extra args go to pip (e.g. --config-settings=build-args="--features cuda").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --disable-pip-version-check --no-build-isolation -q -e . "$@" 2>&1 | grep -v "Running pip as the 'root' user" || true
python3 -c "import ternary_rs" 
