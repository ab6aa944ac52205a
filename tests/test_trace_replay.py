"""`hybridkv trace-replay`: the scaled copy of a Mooncake trace, and simulated = measured through a
real `vllm serve` on a capacity-bound redis store (issue 47, §3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.eval.trace_sim import read_trace
from hybridkv.serving.trace_replay import TraceReplayConfig, scale_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake"
CONVERSATION = TRACES / "conversation_trace.jsonl"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_scaled_copy_shares_exactly_the_tokens_of_the_blocks_it_shares(tmp_path):
    rows = [
        {"input_length": 1300, "hash_ids": [1, 2, 3]},  # two whole blocks and a partial one
        {"input_length": 1024, "hash_ids": [1, 4]},
        {"input_length": 300, "hash_ids": [7]},  # no whole block: left out
        {"input_length": 1536, "hash_ids": [1, 2, 5]},
    ]
    scaled = scale_trace(_write(tmp_path / "t.jsonl", rows), requests=4, scale=8, vocab=1000, seed=3)
    assert scaled.block == 64 and [r["hash_ids"] for r in scaled.rows] == [[1, 2], [1, 4], [1, 2, 5]]
    a, b, c = scaled.prompts
    assert [len(p) for p in scaled.prompts] == [128, 128, 192] == [r["input_length"] for r in scaled.rows]
    assert a[:64] == b[:64] and a[64:] != b[64:] and c[:128] == a
    assert all(3 <= t < 1000 for p in scaled.prompts for t in p)
    again = scale_trace(tmp_path / "t.jsonl", requests=4, scale=8, vocab=1000, seed=3)
    assert again.prompts == scaled.prompts  # fixed content per hash id
    assert scale_trace(tmp_path / "t.jsonl", requests=4, scale=8, vocab=1000, seed=4).prompts != scaled.prompts
    # the copy is a trace the simulator reads at its block size
    copy = read_trace(_write(tmp_path / "copy.jsonl", scaled.rows), scaled.block)
    assert copy.lengths == [128, 128, 192] and copy.nodes == 4
    with pytest.raises(HybridKVError, match="none of its first 1 requests has a whole block"):
        scale_trace(_write(tmp_path / "short.jsonl", [rows[2]]), requests=1, scale=8, vocab=1000)


@pytest.mark.parametrize("bad", [{"scale": 3}, {"requests": 0}, {"capacities_mb": ()}, {"budget": 1.0}])
def test_a_replay_that_cannot_be_made_is_refused_in_one_line(bad):
    with pytest.raises(HybridKVError):
        TraceReplayConfig(trace=Path("t"), redis="redis://127.0.0.1:1", **bad).check()


@pytest.mark.skipif(not CONVERSATION.exists(), reason="the Mooncake traces are not beside the repo")
def test_the_simulator_predicts_what_vllm_serve_measures_on_a_bounded_store(redis_server, tmp_path):
    """40 requests of the conversation trace, scaled 4x onto the grid-128 model's 128-token blocks,
    through vllm serve with the connector on redis stores of 20 and 60 MB (LRU): the measured token
    hit share and exact-hit share are within 0.02 of trace-sim's for the same copy, the capacity was
    reached, and vLLM alone reused nothing."""
    pytest.importorskip("vllm")
    from hybridkv.serving.models import bench_checkpoint
    from hybridkv.serving.trace_replay import run_trace_replay

    model = str(bench_checkpoint("grid-128", tmp_path))
    config = TraceReplayConfig(CONVERSATION, redis_server.url, requests=40, capacities_mb=(20, 60))
    summary = run_trace_replay(config, model, tmp_path / "replay", show_progress=False)
    assert len(summary["agreement"]) == 2
    for row in summary["agreement"]:
        for share in ("token_hit_share", "exact_hit_share"):
            assert abs(row[f"measured_{share}"] - row[f"simulated_{share}"]) <= 0.02, row
    points = summary["simulated"]["points"]
    assert points[0]["evicted"] > 0 and sum(p["hit_tokens"] for p in points) > 0
    measured = {(m["config"], m["capacity_mb"]): m for m in summary["measured"]}
    assert measured[("no-cache", None)]["token_hit_share"] == 0
    assert measured[("hybridkv", 60)]["token_hit_share"] > 0
    lines = (tmp_path / "replay" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 4 * summary["requests"]
