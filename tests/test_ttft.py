"""`hybridkv ttft`: the validate measurement reduced to speed rows, with the cost-model bound."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.models import load_model
from hybridkv.models.meta import cost_model


def test_ttft_rows_carry_the_bound_of_each_methods_recomputed_span(tmp_path, capsys):
    out = tmp_path / "ttft"
    args = ["ttft", "--model", "random-glm5-next", "--prefix-lengths", "200", "--budgets", "0.1", "--suffix-length",
            "8", "--checkpoint-interval", "64", "--repeats", "1", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    rows = {(r["method"], r["budget"]): r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert set(rows) == {("full", None), ("tail-replay", 0.1), ("tail-replay-recompute", 0.1), ("checkpoint", None),
                         ("seeded-replay", 0.1), ("adaptive-replay", 0.1)}  # fmt: skip
    costs = cost_model(load_model("random-glm5-next").config, dense_attention=True)  # as transformers runs it
    prompt = 200 + 8
    assert rows[("full", None)]["bound"] == 1.0
    assert rows[("tail-replay", 0.1)]["bound"] == pytest.approx(costs.speedup_bound(prompt, 200 - 20))
    assert rows[("checkpoint", None)]["bound"] == pytest.approx(costs.speedup_bound(prompt, 192))
    assert rows[("seeded-replay", 0.1)]["bound"] == pytest.approx(costs.speedup_bound(prompt, 192))
    adaptive = rows[("adaptive-replay", 0.1)]  # never longer than the budget's tail
    assert adaptive["replayed_tokens"] <= rows[("tail-replay", 0.1)]["replayed_tokens"] == 20
    assert adaptive["bound"] == pytest.approx(costs.speedup_bound(prompt, 200 - adaptive["replayed_tokens"]))
    assert rows[("checkpoint", None)]["decay_bound"] == 0.0 and 0 < rows[("tail-replay", 0.1)]["decay_bound"] <= 1
    for row in rows.values():
        assert row["speedup"] == pytest.approx(row["full_ttft_s"] / row["ttft_s"])
    assert (out / "ttft.png").read_bytes()[:4] == b"\x89PNG"
    assert "| tail-replay | 0.1 | 200 | 20 |" in capsys.readouterr().out
