"""The position-independent workloads (`rag`, `agent-reports`): separately encoded chunks, and
how the runner and the prefix methods meet them."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.eval.arena import ArenaPlan, read_rows, run_arena
from hybridkv.eval.contract import ArenaConfig
from hybridkv.eval.workloads import Sample, agent_reports, rag
from hybridkv.eval.workloads.frozen import freeze, load_frozen
from hybridkv.methods import Budget
from hybridkv.models.tokenizer import ByteTokenizer
from tests.helpers import assert_greedy_agrees, record_answers


def prompt_tokens(sample: Sample, tokenizer) -> int:
    return sum(len(tokenizer.encode(chunk)) for chunk in sample.chunks) + len(tokenizer.encode(sample.question))


@pytest.mark.parametrize("task", rag.TASKS)
@pytest.mark.parametrize("length", [2048, 4096, 16384])
def test_rag_passages_fit_hold_their_fact_once_and_recur_across_samples(length, task):
    tokenizer = ByteTokenizer()
    samples = rag.generate(task, length, 24, tokenizer, seed=3)
    texts: dict[int, set[str]] = defaultdict(set)  # passage id -> its texts across samples
    places: dict[int, set[int]] = defaultdict(set)  # passage id -> chunk indices it took
    for sample in samples:
        assert "".join(sample.chunks) == sample.context and sample.chunks[0] == rag.HEADER
        assert prompt_tokens(sample, tokenizer) + rag.TOKENS_TO_GENERATE[task] <= length
        assert prompt_tokens(sample, tokenizer) > 0.85 * length  # grown to fill the length
        (gold,) = sample.golds
        assert sample.context.count(gold) == 1 and gold in sample.chunks[sample.meta["gold_chunk"]]
        assert gold not in sample.question
        title = sample.question.split("registration number of ")[1].split("?")[0]
        assert sample.chunks[sample.meta["gold_chunk"]].startswith(f"Passage: {title}\n")
        for place, passage in enumerate(sample.meta["passages"], start=1):
            texts[passage].add(sample.chunks[place])
            places[passage].add(place)
    assert all(len(t) == 1 for t in texts.values())  # a passage reads the same wherever it lands
    if len({s.context for s in samples}) > 1:  # rag-shared at 16K asks all 24 of one set
        assert any(len(p) > 1 for p in places.values())  # and lands in different places


@pytest.mark.parametrize("length", [2048, 4096])
def test_rag_shared_asks_every_passage_of_one_retrieved_set_once(length):
    """The shared-context case: a set's questions share its context to the byte (so a server
    caches it once), each asks a different passage of it, and the next set is another context."""
    tokenizer = ByteTokenizer()
    samples = rag.generate("rag-shared", length, 20, tokenizer, seed=1)
    groups: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        groups[sample.meta["context_group"]].append(sample)
    per_set = len(samples[0].meta["passages"])
    assert len(samples) == 20 and len(groups) == -(-20 // per_set)
    for members in groups.values():
        assert len({m.context for m in members}) == 1 and len({m.question for m in members}) == len(members)
        assert sorted(m.meta["gold_chunk"] for m in members) == list(range(1, len(members) + 1))
        assert len(members) == per_set or members is groups[max(groups)]  # only the last set is cut short
    assert len({members[0].context for members in groups.values()}) == len(groups)


def test_agent_reports_need_two_different_reports():
    tokenizer = ByteTokenizer()
    samples = agent_reports.generate("agent-reports", 8192, 12, tokenizer, seed=1)
    for sample in samples:
        assert "".join(sample.chunks) == sample.context and len(sample.chunks) - 1 >= 3
        assert prompt_tokens(sample, tokenizer) + agent_reports.TOKENS_TO_GENERATE["agent-reports"] <= 8192
        first, second = sample.meta["gold_chunks"]
        assert first != second
        for gold, place in zip(sample.golds, (first, second), strict=True):
            assert sample.context.count(gold) == 1 and gold in sample.chunks[place] and gold not in sample.question
        for place, chunk in enumerate(sample.chunks[1:], start=1):
            assert chunk.startswith(f"Report from agent {place} on ") and chunk.count("Finding:") == 1
        assert agent_reports.score("agent-reports", " and ".join(sample.golds), sample.golds) == 1.0
        assert agent_reports.score("agent-reports", sample.golds[0], sample.golds) == 0.5


@pytest.mark.parametrize("module, task", [(rag, "rag"), (agent_reports, "agent-reports")])
def test_chunked_workloads_are_seeded_freeze_and_refuse_short_lengths(module, task, tmp_path):
    tokenizer = ByteTokenizer()
    assert module.generate(task, 4096, 3, tokenizer, seed=1) == module.generate(task, 4096, 3, tokenizer, seed=1)
    assert module.generate(task, 4096, 3, tokenizer, seed=1) != module.generate(task, 4096, 3, tokenizer, seed=2)
    samples = module.generate(task, 4096, 3, tokenizer)
    freeze(samples, tmp_path / "w.jsonl")
    assert load_frozen(tmp_path / "w.jsonl") == samples
    with pytest.raises(HybridKVError, match="cannot hold"):
        module.generate(task, 1024, 1, tokenizer)
    with pytest.raises(HybridKVError, match="unknown"):
        module.generate("nope", 4096, 1, tokenizer)


def test_workloads_frozen_before_chunks_existed_still_load(tmp_path):
    record = {"id": "x-1", "task": "x", "length": 8, "context": "ab", "question": "c", "golds": ["d"], "meta": {}}
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    (tmp_path / "old.jsonl").write_bytes(data)
    (tmp_path / "old.jsonl.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  old.jsonl\n")
    (sample,) = load_frozen(tmp_path / "old.jsonl")
    assert sample.chunks == [] and sample.segments() == ["ab"]


class Recorder:
    """An outside method that answers with nothing and records what the runner hands it."""

    name = "recorder"
    budget = None

    def __init__(self) -> None:
        self.built: list[list[int]] = []
        self.given: list[list] = []

    def setup(self, model, config):
        pass

    def build_cache(self, source):
        self.built.append(source)
        return len(self.built) - 1

    def answer(self, question, caches, config):
        from hybridkv.eval.contract import Answer

        self.given.append(caches)
        return Answer(text="", tokens=[], ttft_s=0.0)


def test_the_runner_builds_one_cache_per_chunk_tokenised_alone(models, tmp_path, monkeypatch):
    from hybridkv.eval import arena

    recorder = Recorder()
    monkeypatch.setattr(arena, "get_arena_method", lambda name, budget: recorder)
    tokenizer = ByteTokenizer()
    (sample,) = rag.generate("rag", 2048, 1, tokenizer)
    run_arena(models["random-olmo-hybrid"], tokenizer, [sample], ArenaPlan("rag", ["recorder"]), ArenaConfig(),
              tmp_path, rag.score, False)  # fmt: skip
    assert recorder.built == [tokenizer.encode(chunk) for chunk in sample.chunks]
    assert recorder.given == [list(range(len(sample.chunks)))]
    (row,) = read_rows(tmp_path / "results.jsonl")
    assert row["chunks"] == len(sample.chunks) and row["context_tokens"] == sum(map(len, recorder.built))


def test_prefix_methods_reuse_only_the_first_chunk_and_replaying_it_all_equals_full_prefill(
    models, tmp_path, monkeypatch
):
    model, tokenizer = models["random-glm5-next"], ByteTokenizer()
    answers = record_answers(monkeypatch)
    data = rag.generate("rag", 2048, 2, tokenizer)
    plan = ArenaPlan("rag", ["full", "zero-state", "tail-replay"], [Budget(fraction=1.0)])
    rows = read_rows(run_arena(model, tokenizer, data, plan, ArenaConfig(max_new_tokens=4), tmp_path, rag.score, False))
    header = len(tokenizer.encode(rag.HEADER))
    layers = model.description.num_layers
    by_method = {(r["id"], r["method"]): r for r in rows}
    for sample in data:
        full, zero, replay = (by_method[(sample.id, m)] for m in ("full", "zero-state", "tail-replay"))
        prompt = full["context_tokens"] + full["question_tokens"]
        assert zero["reused_tokens"] == replay["reused_tokens"] == header  # the header is the only prefix hit
        assert zero["recomputed_layer_tokens"] == (prompt - header) * layers
        assert replay["recomputed_layer_tokens"] == full["recomputed_layer_tokens"] == prompt * layers
    for (prompt, want), (replay_prompt, got) in zip(
        answers[("full", "None")], answers[("tail-replay", str(Budget(fraction=1.0)))], strict=True
    ):
        assert replay_prompt == prompt
        assert_greedy_agrees(model, prompt, got, want)


def test_pairs_run_in_the_arena_with_their_costs(models, tmp_path):
    """`ATTENTION+LINEAR` pairs through the runner: every chunk's stored KV counted, the recomputed
    tokens and the state bytes each linear policy keeps (none for zero, end states for linearkv,
    also the composition maps for compose)."""
    model, tokenizer = models["random-nemotron-h"], ByteTokenizer()
    (sample,) = rag.generate("rag", 2048, 1, tokenizer)
    pairs = ["naive+zero", "naive+linearkv", "epic+compose"]
    plan = ArenaPlan("rag", pairs)
    rows = read_rows(
        run_arena(model, tokenizer, [sample], plan, ArenaConfig(max_new_tokens=2), tmp_path, rag.score, False)
    )
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == set(pairs)
    context = by_method["naive+zero"]["context_tokens"]
    question = by_method["naive+zero"]["question_tokens"]
    chunks = [len(tokenizer.encode(chunk)) for chunk in sample.chunks]
    for row in rows:
        assert row["reused_tokens"] + row["recomputed_tokens"] == context + question
        assert row["kv_bytes"] == model.description.kv_bytes_per_token * context
        assert row["build_s"] > 0
    assert by_method["naive+zero"]["recomputed_tokens"] == question and by_method["naive+zero"]["state_bytes"] == 0
    assert by_method["naive+linearkv"]["state_bytes"] == model.description.state_bytes * len(chunks)
    # epic recomputes 32 tokens of every chunk after the first, compose the 8-token seam of the first too
    assert by_method["epic+compose"]["recomputed_tokens"] == question + 8 + 32 * (len(chunks) - 1)
    assert by_method["epic+compose"]["state_bytes"] > by_method["naive+linearkv"]["state_bytes"]
