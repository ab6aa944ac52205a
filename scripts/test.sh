#!/usr/bin/env bash
# Set up .venv with the test extras (pytest, hypothesis, ruff, LMCache), make sure redis-server
# is installed (the store tests start their own on free loopback ports), then lint and test; a run
# of the whole suite then runs the vLLM tests a second time on another CPU's kernels (below).
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
# A whole run goes on to run the vLLM tests again on the kernels vLLM and oneDNN take on a CPU with
# AVX-512 but neither AVX-512-BF16 nor AMX (an Intel Xeon seen in CI), where this CPU takes others:
# a test calibrated on one kind of CPU fails on the other here too (docs/design.md, "Two kinds of
# x86 CPU"; the hook is tests/cpu_isa/sitecustomize.py).
if [ $# -eq 0 ]; then
  if .venv/bin/python -c 'import sys, torch.cpu as c
sys.exit(not (c._is_avx512_supported() and (c._is_avx512_bf16_supported() or c._is_amx_tile_supported())))'; then
    HYBRIDKV_CPU_ISA=avx512 .venv/bin/python -m pytest tests/test_vllm_*.py
  else
    echo "scripts/test.sh: this CPU takes vLLM's AVX-512-without-BF16 kernels already (or has no AVX-512): one pass"
  fi
fi
