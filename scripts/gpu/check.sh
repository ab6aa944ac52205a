#!/usr/bin/env bash
# The GPU check, one command: TTFT of every method at the real sizes of Qwen3.5-4B and
# OLMo-Hybrid-7B (random weights, bfloat16) at 8K/16K/32K prefixes. Run from the repository
# root on a machine with a CUDA GPU; results land in results/gpu-ttft/ (commit them).
#   scripts/gpu/check.sh [extra arguments for scripts/gpu/real_size_ttft.py]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" scripts/gpu/real_size_ttft.py "$@"
