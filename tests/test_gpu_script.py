"""The GPU check script (scripts/gpu/check.sh), smoke-tested on the CPU with shrunken models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_real_size_script_runs_every_method_on_both_models(tmp_path):
    command = [sys.executable, str(ROOT / "scripts/gpu/real_size_ttft.py"), "--tiny", "--device", "cpu"]
    command += ["--dtype", "float32", "--prefix-lengths", "256", "--budgets", "0.05", "--repeats", "1"]
    result = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert environment["device"] == "cpu" and set(environment["kernels_installed"]) == {
        "flash-linear-attention",
        "causal-conv1d",
        "mamba-ssm",
    }
    for name in ("qwen3.5-4b", "olmo-hybrid-7b"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        rows = {(row["method"], row["budget"]) for row in summary["rows"]}
        assert ("full", None) in rows and ("tail-replay", 0.05) in rows and ("checkpoint", None) in rows
        assert summary["config"]["dtype"] == "float32"
