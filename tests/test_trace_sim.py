"""The trace simulator (`hybridkv trace-sim`) and the store policy under it: hand-built traces with
known answers, and invariants on the Mooncake conversation trace beside the repository."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.eval.trace_sim import (
    POLICIES,
    Sizes,
    TraceSimConfig,
    direct_prefix_hits,
    model_sizes,
    read_trace,
    run_sweep,
    simulate,
)
from hybridkv.store.policy import KV_BLOCK, STATE, PolicyStore

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake"
CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.exists(), reason="the Mooncake traces are not beside the repo")


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _linear_sizes(trace, kv: int = 1, state: int = 1000) -> Sizes:
    """A model whose prefill costs one FLOP per token and no head: saved FLOPs are saved tokens."""
    top = max(trace.lengths) + 1
    return Sizes("linear", kv, state, {p: float(p) for p in range(top)}, 0.0)


HAND = [
    {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 2, "input_length": 700, "output_length": 1, "hash_ids": [1, 9]},
]


def test_a_hand_built_trace_gives_its_known_hits(tmp_path):
    trace = read_trace(_write(tmp_path / "t.jsonl", HAND))
    sizes = _linear_sizes(trace)
    log: list = []
    point = simulate(trace, sizes, "hybridkv", math.inf, tail=0.05, hit_log=log)
    # r1 matches r0's two blocks and finds r0's checkpoint at its last full block (1024): exact;
    # r2 matches one block (512), no checkpoint there: replays round(0.05 * 512) = 26 tokens
    assert log == [(1, 1024, 1024, True), (2, 512, 486, False)]
    assert (point.input_tokens, point.hit_tokens, point.exact_hit_tokens) == (3224, 1536, 1024)
    assert point.saved_flops == 1024 + 486
    assert point.bytes_read == 1536 * 1 + 1000  # KV of both hits, one state
    # KV of every distinct block (1024 + 476 + 188 tokens) and two states: at 1024 (the last full block of
    # r0 and of r1, one node) and at 512 (r2's, written after its approximate hit)
    assert point.bytes_written == 1024 + 476 + 188 + 2 * 1000
    log = []
    align = simulate(trace, sizes, "vllm-align", math.inf, align_block=1024, hit_log=log)
    assert log == [(1, 1024, 1024, True)]  # r2 is shorter than one block: never hits
    assert (align.hit_tokens, align.saved_flops, align.bytes_written) == (1024, 1024, 1024 + 1000)


def test_a_whole_prompt_repeated_leaves_one_token_to_compute(tmp_path):
    trace = read_trace(_write(tmp_path / "t.jsonl", [HAND[1], HAND[1]]))
    log: list = []
    simulate(trace, _linear_sizes(trace), "hybridkv", math.inf, tail=0.0, hit_log=log)
    assert log == [(1, 1499, 1499, False)]  # the checkpoint at 1024 lies outside an empty tail
    log = []
    simulate(trace, _linear_sizes(trace), "vllm-align", math.inf, align_block=512, hit_log=log)
    assert log == [(1, 1024, 1024, True)]


def test_a_corrupted_trace_line_is_refused_in_one_line_naming_it(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(HAND[0]) + "\n" + '{"input_length": 1024, "hash_ids": [1\n')
    with pytest.raises(HybridKVError, match=rf"^{path}:2: not a trace request") as err:
        read_trace(path)
    assert "\n" not in str(err.value)
    _write(path, [HAND[0], {**HAND[1], "hash_ids": [1, 2]}])  # 1,500 tokens need three blocks
    with pytest.raises(HybridKVError, match=rf"^{path}:2: .*needs 3 hash ids"):
        read_trace(path)
    with pytest.raises(HybridKVError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_unknown_policies_and_models_are_refused(tmp_path):
    with pytest.raises(HybridKVError, match="unknown policies nope"):
        TraceSimConfig(tmp_path / "t.jsonl", policies=("nope",)).check()
    trace = read_trace(_write(tmp_path / "t.jsonl", HAND))
    with pytest.raises(HybridKVError, match="unknown model 'no-such-model'"):
        model_sizes("no-such-model", trace, 0.05)


def test_value_eviction_never_keeps_an_entry_worth_less_than_one_it_evicted():
    store = PolicyStore(10_000, "value")
    checked = 0

    def check(victims, below):
        nonlocal checked
        worst_kept = min(e.priority for e in store.entries.values())
        assert max(v.priority for v in victims) <= worst_kept
        assert max(v.priority for v in victims) < below
        checked += 1

    store.on_evict = check
    rng = random.Random(0)
    for step in range(3000):
        key = step
        parent = rng.choice([None, *list(store.entries)[-5:]]) if store.entries else None
        if parent is not None and parent < 0:
            parent = None
        if rng.random() < 0.3 and parent is not None and -parent - 1 not in store:
            store.put(-parent - 1, STATE, rng.randint(500, 3000), rng.random() * 100, parent, -1)
        else:
            store.put(key, KV_BLOCK, rng.randint(50, 400), rng.random() * 100, parent)
        for held in rng.sample(list(store.entries), min(3, len(store.entries))):
            store.use(held)
        assert store.used <= store.capacity
    assert checked > 20


@pytest.fixture(scope="module")
def conversation():
    trace = read_trace(CONVERSATION)
    return trace, model_sizes("glm-5.3-flash", trace, 0.05)


@needs_trace
def test_an_unbounded_store_reproduces_the_direct_prefix_count(conversation):
    trace, sizes = conversation
    hit, total = direct_prefix_hits(trace)
    assert round(hit / total, 3) == 0.374  # the quick count, reproduced
    seen: set[int] = set()
    repeats = 0  # whole prompts seen before: a hit leaves their last token to compute
    for path in trace.paths:
        repeats += all(node in seen for node in path)
        seen.update(path)
    for policy in ("hybridkv", "hybridkv-value"):
        point = simulate(trace, sizes, policy, math.inf)
        assert point.hit_tokens == hit - repeats
        assert point.input_tokens == total
    every = simulate(trace, sizes, "vllm-align-every-block", math.inf)
    assert round(every.hit_tokens / total, 3) == 0.298  # the count with states every 3,584 tokens


@needs_trace
def test_no_capacity_gives_no_hits(conversation):
    trace, sizes = conversation
    for policy in POLICIES:
        point = simulate(trace, sizes, policy, 0)
        assert (point.hits, point.hit_tokens, point.saved_flops, point.bytes_written) == (0, 0, 0.0, 0), policy


@needs_trace
def test_more_capacity_never_lowers_lru_hits_and_align_hits_only_on_its_grid(conversation):
    trace, sizes = conversation
    for policy in ("hybridkv", "vllm-align", "vllm-align-every-block"):
        shares = [simulate(trace, sizes, policy, gb).hit_tokens for gb in (10, 50, 200, 1000, math.inf)]
        assert shares == sorted(shares), policy
    log: list = []
    simulate(trace, sizes, "vllm-align-marconi", 300, hit_log=log)
    assert log and all(tokens % 3584 == 0 and start == tokens and exact for _, tokens, start, exact in log)


@needs_trace
def test_the_sweep_reports_every_point_and_a_replicated_trace_scales(tmp_path):
    rows = CONVERSATION.read_text().splitlines()[:300]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(rows) + "\n")
    config = TraceSimConfig(small, capacities=(1, math.inf), policies=("hybridkv", "vllm-align"), workers=1)
    one = run_sweep(config, show_progress=False)
    assert len(one["points"]) == 4
    twice = run_sweep(TraceSimConfig(small, (math.inf,), ("hybridkv",), replicate=2, workers=1), show_progress=False)
    single = next(p for p in one["points"] if p["policy"] == "hybridkv" and p["capacity_gb"] == math.inf)
    (double,) = twice["points"]
    # copies share no block: twice the requests, twice the hits of one copy
    assert double["requests"] == 2 * single["requests"]
    assert double["hit_tokens"] == 2 * single["hit_tokens"]
    assert double["bytes_written"] == 2 * single["bytes_written"]
    # the headline table names the capacity its "compute saved" column is at: unbounded only when swept
    from hybridkv.report.trace_report import sweep_tables

    assert sweep_tables(one)[3].startswith("| policy | compute saved, unbounded |")
    bounded = TraceSimConfig(small, capacities=(1, 3), policies=("hybridkv",), workers=1)
    header = sweep_tables(run_sweep(bounded, show_progress=False))[3]
    assert "compute saved, 3 GB" in header and "half its saving at 3 GB" in header and "unbounded" not in header


def test_what_a_prompt_computed_after_an_approximate_start_never_makes_a_hit_exact(tmp_path):
    """r1 resumes r0's first block from a zero state, so its block 3 and its state are approximate;
    r2 resumes from that state (seeded, yet not exact); r3 from r0's exact one; r4 repeats r1 (a
    zero-state tail again), whose approximate state does not replace anything; r5 still seeds from
    r1's approximate state."""
    rows = [
        {"input_length": 1024, "hash_ids": [1, 2]},
        {"input_length": 1024, "hash_ids": [1, 3]},
        {"input_length": 1536, "hash_ids": [1, 3, 4]},
        {"input_length": 1536, "hash_ids": [1, 2, 5]},
        {"input_length": 1024, "hash_ids": [1, 3]},
        {"input_length": 1536, "hash_ids": [1, 3, 6]},
    ]
    trace = read_trace(_write(tmp_path / "t.jsonl", rows))
    log: list = []
    point = simulate(trace, _linear_sizes(trace), "hybridkv", math.inf, tail=0.05, hit_log=log)
    assert log == [
        (1, 512, 486, False), (2, 1024, 1024, False), (3, 1024, 1024, True), (4, 1023, 972, False),
        (5, 1024, 1024, False),
    ]  # fmt: skip
    assert (point.exact_hits, point.exact_hit_tokens) == (1, 1024)
