"""summary.json from results rows: grouping, retention and PGR against floor and oracle, costs."""

from __future__ import annotations

import pytest

from hybridkv.eval.summary import agreement, rescore, summarise


def row(sample: int, method: str, score: float, budget=None, **costs) -> dict:
    base = {"recomputed_layer_tokens": 10, "dense_layer_tokens": 100, "kv_bytes": 0, "state_bytes": 0,
            "ttft_s": 1.0, "build_s": 0.5}  # fmt: skip
    return {"workload": "w", "task": "t", "length": 4096, "id": f"s{sample}", "method": method, "budget": budget,
            "score": score, "prediction": str(score), "golds": ["1.0"], **base, **costs}  # fmt: skip


def test_retention_and_pgr_are_computed_per_setting():
    # floor 0.2, oracle 0.8, method 0.5 on average -> PGR (0.5 - 0.2) / (0.8 - 0.2) = 0.5; retention 0.5 / 0.8
    rows = [
        row(0, "no-context", 0.0), row(1, "no-context", 0.4),
        row(0, "full", 1.0), row(1, "full", 0.6),
        row(0, "tail-replay", 0.6, budget=0.05), row(1, "tail-replay", 0.4, budget=0.05, ttft_s=3.0),
    ]  # fmt: skip
    summary = {(r["method"], r["budget"]): r for r in summarise(rows)["rows"]}
    replay = summary[("tail-replay", 0.05)]
    assert replay["n"] == 2 and replay["score"] == pytest.approx(0.5)
    assert replay["pgr"] == pytest.approx(0.5)
    assert replay["retention"] == pytest.approx(0.5 / 0.8)
    assert replay["ttft_s"] == pytest.approx(2.0)
    assert summary[("full", None)]["pgr"] == pytest.approx(1.0)
    assert summary[("no-context", None)]["pgr"] == pytest.approx(0.0)


def test_agreement_with_full_is_how_far_into_full_prefills_answer_a_method_agrees():
    rows = [
        row(0, "full", 0.0), row(1, "full", 0.0), row(2, "full", 0.0),
        {**row(0, "zero-state", 0.0), "prediction": "0.5"},  # full said "0.0": agrees on 2 of 3 characters
        {**row(1, "zero-state", 0.0), "prediction": "x"}, row(2, "zero-state", 0.0),
    ]  # fmt: skip
    summary = {r["method"]: r for r in summarise(rows)["rows"]}
    assert summary["zero-state"]["agreement_with_full"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert summary["full"]["agreement_with_full"] == 1.0
    assert agreement("0.0 and more", "0.0") == 1.0 and agreement("", "0.0") == 0.0


def test_same_as_full_counts_only_answers_equal_to_full_prefills_to_the_end():
    # An answer that holds full prefill's and runs on past it agrees in full but is not the same answer.
    rows = [
        row(0, "full", 1.0), row(1, "full", 1.0), row(2, "full", 1.0), row(3, "full", 1.0),
        {**row(0, "zero-state", 1.0), "prediction": "1.0\nThe grass is green."}, row(1, "zero-state", 1.0),
        {**row(2, "zero-state", 0.0), "prediction": "2.0"}, row(3, "zero-state", 1.0),
    ]  # fmt: skip
    summary = {r["method"]: r for r in summarise(rows)["rows"]}
    assert summary["zero-state"]["same_as_full"] == pytest.approx(2 / 4)
    assert summary["zero-state"]["agreement_with_full"] == pytest.approx((1 + 1 + 0 + 1) / 4)
    assert summary["full"]["same_as_full"] == 1.0


def test_pgr_is_undefined_when_the_oracle_does_not_beat_the_floor():
    rows = [row(0, "no-context", 0.5), row(0, "full", 0.5), row(0, "zero-state", 0.5)]
    for summary_row in summarise(rows)["rows"]:
        assert summary_row["pgr"] is None and summary_row["pgr_ci95"] is None


def test_scores_are_recomputed_from_predictions_not_trusted():
    rows = [row(0, "full", 1.0), row(0, "zero-state", 1.0)]
    rows[1]["prediction"] = "wrong"
    rescored = rescore(rows, lambda row: float(row["prediction"] in row["golds"]))
    assert [r["score"] for r in rescored] == [1.0, 0.0]


def test_report_writes_plots_and_tables(tmp_path):
    import json

    from hybridkv.cli import main

    rows = [
        row(0, "no-context", 0.0), row(0, "full", 1.0, ttft_s=2.0), row(0, "zero-state", 0.0, ttft_s=0.5),
        row(0, "tail-replay", 0.5, budget=0.05, ttft_s=0.5, kv_bytes=2**20),
        row(0, "tail-replay", 1.0, budget=0.1, ttft_s=1.0, kv_bytes=2**20),
    ]  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summarise(rows)))
    assert main(["arena", "report", str(tmp_path)]) == 0
    for name in ("quality_vs_budget.png", "pgr.png", "ttft_speedup.png", "bytes.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "report.md").read_text()
    assert "tail-replay" in report and "![pgr.png](pgr.png)" in report
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()
    assert not (tmp_path / "pairs.png").exists() and "attention \\ linear" not in report  # no pairs in this run


def test_report_grids_pairs_by_attention_and_linear_policy(tmp_path):
    import json

    from hybridkv.cli import main

    # Two samples: floor 0 and oracle 1 on both, so a pair's PGR is its mean score.
    rows = [row(s, m, v) for s in (0, 1) for m, v in (("no-context", 0.0), ("full", 1.0))]
    rows += [row(0, "epic+compose", 1.0), row(1, "epic+compose", 0.0)]
    rows += [row(s, "naive+zero", 0.0) for s in (0, 1)] + [row(s, "naive+compose", 1.0) for s in (0, 1)]
    (tmp_path / "summary.json").write_text(json.dumps(summarise(rows)))
    assert main(["arena", "report", str(tmp_path)]) == 0
    assert (tmp_path / "pairs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "report.md").read_text()
    table = report[report.index("| attention \\ linear") :].split("\n\n")[0].splitlines()
    assert table[0] == "| attention \\ linear | zero | compose |"  # the methods' own order, not alphabetical
    assert table[2].startswith("| naive | 0.00 ") and "| 1.00 " in table[2]
    assert table[3].startswith("| epic |  | 0.50 [")  # no epic+zero in the run: an empty cell
