#!/usr/bin/env bash
# Set up .venv with the test extras, then lint and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check hybridkv tests
.venv/bin/python -m pytest "$@"
