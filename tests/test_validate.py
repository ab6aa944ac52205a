"""`hybridkv validate` end to end through the CLI, and its bad-input errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridkv.cli import main

ROW_KEYS = {
    "method",
    "decay_bound",
    "budget",
    "prefix_length",
    "suffix_length",
    "reused_tokens",
    "replayed_tokens",
    "recomputed_tokens",
    "kl_mean",
    "top1_agreement",
    "greedy_agreement",
    "ttft_s",
    "full_ttft_s",
    "speedup",
    "state_bytes",
    "kv_bytes",
}


@pytest.fixture(scope="module")
def validate_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("validate")
    argv = [
        "validate",
        "--model", "random-qwen3-next",
        "--prefix-lengths", "100,150",
        "--suffix-length", "16",
        "--budgets", "0.1,1.0",
        "--checkpoint-interval", "64",
        "--repeats", "1",
        "--greedy-tokens", "4",
        "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    code = main(argv)
    return code, out


def test_validate_writes_results_with_the_documented_schema(validate_run):
    code, out = validate_run
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert {"name", "model_type", "num_layers", "linear_layers", "attention_layers"} <= results["model"].keys()
    assert results["model"]["model_type"] == "qwen3_next"
    rows = results["rows"]
    # 3 methods without a budget + 4 with two budgets each, for two prefix lengths
    assert len(rows) == 2 * (3 + 4 * 2)
    for row in rows:
        assert row.keys() >= ROW_KEYS
        assert (row["budget"] is None) == (row["method"] in ("full", "zero-state", "checkpoint"))
    report = (out / "report.md").read_text()
    assert "| method |" in report and "tail-replay" in report


def test_validate_rows_obey_the_method_invariants(validate_run):
    _, out = validate_run
    for row in json.loads((out / "results.json").read_text())["rows"]:
        length, suffix = row["prefix_length"], row["suffix_length"]
        assert row["reused_tokens"] + row["recomputed_tokens"] == length + suffix
        assert 0 <= row["replayed_tokens"] <= length
        if row["method"] == "full" or (row["budget"] == 1.0 and row["method"] != "adaptive-replay"):
            # whole-prefix replay is full prefill
            assert row["kl_mean"] < 1e-6 and row["top1_agreement"] == 1.0, row
        if row["method"] == "checkpoint":
            assert row["reused_tokens"] == length // 64 * 64
            assert row["kl_mean"] < 1e-6
            assert row["state_bytes"] > 0
        if row["method"] in ("tail-replay", "tail-replay-recompute"):
            assert row["state_bytes"] == 0 and row["kv_bytes"] > 0
            assert row["replayed_tokens"] == round(row["budget"] * length)
        if row["method"] == "adaptive-replay":  # under the tolerance, or the whole budget spent
            assert row["decay_bound"] < 0.01 or row["replayed_tokens"] == round(row["budget"] * length)
        if row["method"] in ("full", "checkpoint"):
            assert row["decay_bound"] == 0.0  # exact states drop nothing
        assert row["split_noise_kl"] < 1e-6  # qwen3_next is split-invariant
        assert row["speedup"] == pytest.approx(row["full_ttft_s"] / row["ttft_s"])


def test_validate_prints_a_table(tmp_path, capsys):
    argv = ["validate", "--model", "random-olmo-hybrid", "--prefix-lengths", "40", "--suffix-length", "8",
            "--methods", "full,tail-replay", "--budgets", "0.5", "--checkpoint-interval", "0", "--repeats", "1",
            "--greedy-tokens", "2", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "method" in printed.splitlines()[0] and "speedup" in printed.splitlines()[0]
    assert "tail-replay" in printed and "results.json" in printed


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--budgets", "1.5"], "outside [0, 1]"),
        (["--budgets", "abc"], "not a number"),
        (["--methods", "full,magic"], "unknown method 'magic'"),
        (["--suffix-length", "0"], "suffix length"),
        (["--prefix-lengths", "0"], "prefix lengths"),
        (["--prefix-lengths", "70000"], "max_position_embeddings"),
    ],
)
def test_bad_input_gives_one_line_error(args, expected, tmp_path, capsys):
    argv = ["validate", "--model", "random-olmo-hybrid", "--no-progress", "--out", str(tmp_path), *args]
    if "--model" in args:
        argv = ["validate", "--no-progress", "--out", str(tmp_path), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hybridkv: error:")
    assert expected in err
    assert not (tmp_path / "results.json").exists()


def test_unreadable_model_directory_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    assert main(["validate", "--model", str(tmp_path / "ckpt"), "--no-progress", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and str(tmp_path / "ckpt") in err


def test_console_script_help_explains_the_options():
    done = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "validate", "--help"], capture_output=True, text=True, check=True
    )
    for option in ("--model", "--prefix-lengths", "--suffix-length", "--budgets", "--methods",
                   "--checkpoint-interval", "--seed", "--out"):  # fmt: skip
        assert option in done.stdout
