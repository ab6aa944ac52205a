#!/usr/bin/env bash
# Set up .venv with the test extras (pytest, hypothesis, ruff, LMCache), make sure redis-server
# is installed (the store tests start their own on free loopback ports), then lint and test.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
  else
    echo "scripts/test.sh: redis-server is needed (e.g. sudo apt-get install redis-server)" >&2
    exit 1
  fi
fi
scripts/setup.sh --test
.venv/bin/ruff check hybridkv tests benchmarks scripts
.venv/bin/python -m pytest "$@"
