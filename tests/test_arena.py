"""The arena runner: the method contract, an outside method through the entry point, resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.eval.arena import ArenaPlan, method_grid, read_rows, run_arena
from hybridkv.eval.contract import ArenaConfig, available_methods, get_arena_method
from hybridkv.eval.workloads import Sample
from hybridkv.methods import Budget
from hybridkv.models.tokenizer import ByteTokenizer
from tests.helpers import assert_greedy_agrees, record_answers


def samples(n: int) -> list[Sample]:
    return [
        Sample(f"toy-{i}", "toy", 256, f"Record {i}: the code word is {'abcdefgh'[i % 8] * 3}. " * 6,
               " What is the code word?", ["aaa"])
        for i in range(n)
    ]  # fmt: skip


def contains_gold(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    return float(any(g in prediction for g in golds))


@pytest.fixture(scope="module")
def model(models):
    return models["random-olmo-hybrid"]


PLAN = ArenaPlan("toy", ["no-context", "full", "zero-state", "tail-replay"], [Budget(fraction=0.1), Budget(1.0)])
CONFIG = ArenaConfig(max_new_tokens=4, checkpoint_interval=64)


def test_every_sample_gets_one_row_per_method_and_budget(model, tmp_path):
    results = run_arena(model, ByteTokenizer(), samples(3), PLAN, CONFIG, tmp_path, contains_gold, False)
    rows = read_rows(results)
    keys = Counter((r["id"], r["method"], r["budget"]) for r in rows)
    assert len(rows) == 3 * (1 + 1 + 1 + 2) and max(keys.values()) == 1
    for row in rows:
        assert row["reused_tokens"] + row["recomputed_tokens"] == (
            row["context_tokens"] + row["question_tokens"] if row["method"] != "no-context" else row["question_tokens"]
        )
        assert row["recomputed_layer_tokens"] <= row["dense_layer_tokens"]


def test_whole_prefix_replay_answers_exactly_as_full_prefill(model, tmp_path, monkeypatch):
    answers = record_answers(monkeypatch)
    run_arena(model, ByteTokenizer(), samples(2), PLAN, CONFIG, tmp_path, contains_gold, False)
    full, replay = answers[("full", "None")], answers[("tail-replay", str(Budget(1.0)))]
    assert len(full) == len(replay) == 2
    for (prompt, want), (replay_prompt, got) in zip(full, replay, strict=True):
        assert replay_prompt == prompt
        assert_greedy_agrees(model, prompt, got, want)


def test_a_killed_run_resumes_without_duplicates(model, tmp_path):
    tokenizer, data = ByteTokenizer(), samples(3)
    complete = read_rows(run_arena(model, tokenizer, data, PLAN, CONFIG, tmp_path / "a", contains_gold, False))
    killed = tmp_path / "b"
    killed.mkdir()
    lines = [json.dumps(row, sort_keys=True) for row in complete]
    (killed / "results.jsonl").write_text("\n".join(lines[:7]) + "\n" + lines[7][:25])  # torn last line
    resumed = read_rows(run_arena(model, tokenizer, data, PLAN, CONFIG, killed, contains_gold, False))
    assert len(resumed) == len(complete)
    assert Counter((r["id"], r["method"], r["budget"]) for r in resumed).most_common(1)[0][1] == 1
    assert resumed[:7] == complete[:7]  # kept, not redone

    def predictions(rows):
        return {(r["id"], r["method"], r["budget"]): r["prediction"] for r in rows}

    assert predictions(resumed) == predictions(complete)


def test_results_lines_split_on_newline_only(tmp_path):
    """A row written by another tool with ensure_ascii=False may hold U+2028, U+2029 or U+0085 raw;
    str.splitlines() would tear it in two and the row would vanish from the summary."""
    rows = [{"id": f"s{i}", "prediction": f"line{sep}break", "score": 1.0} for i, sep in enumerate("\u2028\u2029\x85")]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert read_rows(path) == rows


def test_only_a_torn_last_line_is_dropped(tmp_path):
    good = [json.dumps({"id": f"s{i}", "score": 0.5}) for i in range(3)]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(good) + "\n" + good[0][:9])  # killed mid-line: no newline after it
    assert [row["id"] for row in read_rows(path)] == ["s0", "s1", "s2"]
    path.write_text(good[0] + "\n" + good[1][:9] + "\n" + good[2] + "\n")  # a broken line in the middle
    with pytest.raises(HybridKVError, match=r"results.jsonl:2: not a JSON line"):
        read_rows(path)
    path.write_text(good[0] + "\n" + good[1][:9] + "\n")  # a complete (newline-ended) line that is not JSON
    with pytest.raises(HybridKVError, match=r"results.jsonl:2"):
        read_rows(path)
    path.write_text(good[0] + "\n[1, 2]\n")
    with pytest.raises(HybridKVError, match=r"results.jsonl:2: not a JSON object"):
        read_rows(path)
    path.write_bytes(good[0].encode() + b"\n\xff\xfe\n")
    with pytest.raises(HybridKVError, match="not UTF-8"):
        read_rows(path)


def test_a_corrupt_results_line_stops_arena_score_with_one_line(tmp_path, capsys):
    from hybridkv.cli import main

    (tmp_path / "results.jsonl").write_text('{"id": "a"}\n{"id": \n{"id": "b"}\n')
    assert main(["arena", "score", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridkv: error:") and "results.jsonl:2" in err[0]
    assert not (tmp_path / "summary.json").exists()


def test_captures_are_keyed_by_the_models_weights_not_its_identity():
    """The same model object with changed weights must not be served its old capture (a capture
    cache keyed by id(model) did, and a freed model's id is handed on to the next model)."""
    import torch

    from hybridkv.cache import capture_prompt
    from hybridkv.eval.contract import CaptureCache
    from hybridkv.models import load_model

    model = load_model("random-olmo-hybrid")  # our own copy: its weights change below
    source = list(range(3, 103))
    captures = CaptureCache()
    config = ArenaConfig(checkpoint_interval=64, captures=captures)

    def build(method: str, budget=None):
        arena_method = get_arena_method(method, budget)
        arena_method.setup(model, config)
        return arena_method.build_cache(source)

    first = build("checkpoint")
    assert build("checkpoint") is first  # shared within the run
    assert build("seeded-replay", Budget(fraction=0.1)) is first  # same capture kind, other method
    with torch.no_grad():
        for parameter in model.backbone.parameters():
            parameter.mul_(1.5)
    second = build("checkpoint")
    assert second is not first
    fresh = capture_prompt(model, torch.tensor(source), 64)
    for layer, tensors in fresh.attention.items():
        for name, tensor in tensors.items():
            assert torch.equal(second.handle.attention[layer][name], tensor)
            assert not torch.equal(first.handle.attention[layer][name], tensor)


def test_each_run_owns_its_captures_and_reports_build_time_as_a_value(model, tmp_path):
    """Two runs do not share captures; rows of methods sharing one capture report its build time."""
    plan = ArenaPlan("toy", ["checkpoint", "seeded-replay"], [Budget(fraction=0.1)])
    rows = read_rows(run_arena(model, ByteTokenizer(), samples(1), plan, CONFIG, tmp_path / "a", contains_gold, False))
    again = read_rows(run_arena(model, ByteTokenizer(), samples(1), plan, CONFIG, tmp_path / "b", contains_gold, False))
    (checkpoint, seeded), (checkpoint_again, _) = rows, again
    assert checkpoint["build_s"] > 0 and seeded["build_s"] == checkpoint["build_s"]
    assert checkpoint_again["build_s"] != checkpoint["build_s"]  # the second run captured anew


OUTSIDE = '''
from hybridkv.eval.contract import Answer

class Echo:
    """An outside method: answers with the last bytes of the question, builds no cache."""
    name = "outside-echo"

    def __init__(self, budget):
        self.budget = budget

    def setup(self, model, config):
        self.model = model

    def build_cache(self, source):
        return len(source)

    def answer(self, question, caches, config):
        return Answer(text="aaa" if caches == [caches[0]] else "", tokens=[], ttft_s=0.0,
                      recomputed_tokens=len(question))

def factory(budget):
    return Echo(budget)
'''


def test_an_outside_method_registers_through_the_entry_point(model, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "outside_hkv_method-0.1.dist-info").mkdir(parents=True)
    (site / "outside_hkv_method-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: outside-hkv-method\nVersion: 0.1\n"
    )
    (site / "outside_hkv_method-0.1.dist-info" / "entry_points.txt").write_text(
        "[hybridkv.methods]\noutside-echo = outside_hkv_method:factory\n"
    )
    (site / "outside_hkv_method.py").write_text(OUTSIDE)
    monkeypatch.syspath_prepend(str(site))
    assert "outside-echo" in available_methods()
    plan = ArenaPlan("toy", ["full", "outside-echo"])
    rows = read_rows(
        run_arena(model, ByteTokenizer(), samples(2), plan, CONFIG, tmp_path / "out", contains_gold, False)
    )
    outside = [r for r in rows if r["method"] == "outside-echo"]
    assert len(outside) == 2 and all(r["score"] == 1.0 and r["prediction"] == "aaa" for r in outside)


def test_unknown_and_budgetless_methods_are_clear_errors():
    with pytest.raises(HybridKVError, match="unknown method 'nope'"):
        get_arena_method("nope", None)
    with pytest.raises(HybridKVError, match="needs a budget"):
        get_arena_method("tail-replay", None)


def test_a_pinned_budget_runs_that_method_at_that_budget_only():
    plan = ArenaPlan("toy", ["full", "tail-replay", "seeded-replay@0.2", "adaptive-replay@64tok"],
                     [Budget(fraction=0.02), Budget(fraction=0.05)])  # fmt: skip
    assert method_grid(plan) == [
        ("full", None), ("tail-replay", Budget(fraction=0.02)), ("tail-replay", Budget(fraction=0.05)),
        ("seeded-replay", Budget(fraction=0.2)), ("adaptive-replay", Budget(tokens=64)),
    ]  # fmt: skip
    with pytest.raises(HybridKVError, match="takes no budget"):
        method_grid(ArenaPlan("toy", ["full@0.05"]))
    with pytest.raises(HybridKVError, match="not a number"):
        method_grid(ArenaPlan("toy", ["tail-replay@half"]))


def test_arena_cli_runs_scores_reports_and_resumes(tmp_path, capsys):
    from hybridkv.cli import main

    out = tmp_path / "arena"
    argv = ["arena", "run", "--workload", "ruler", "--tasks", "niah_single_1,vt,qa_1", "--lengths", "1024",
            "--samples", "1", "--methods", "no-context,full,tail-replay", "--budgets", "0.1",
            "--model", "random-olmo-hybrid", "--max-new-tokens", "4", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "qa_1 skipped" in capsys.readouterr().out
    rows = read_rows(out / "results.jsonl")
    assert {(r["task"], r["method"]) for r in rows} == {
        (t, m) for t in ("niah_single_1", "vt") for m in ("no-context", "full", "tail-replay")
    }
    summary = json.loads((out / "summary.json").read_text())
    expected = {"workload", "task", "length", "method", "budget", "n", "score", "retention", "pgr", "pgr_ci95",
                "recomputed_layer_tokens", "kv_bytes", "state_bytes", "ttft_s", "build_s"}  # fmt: skip
    assert all(expected <= row.keys() for row in summary["rows"]) and len(summary["rows"]) == 6 + 3
    # One "overall" row per method pools both tasks' samples.
    for method in ("no-context", "full", "tail-replay"):
        per_task = [r for r in summary["rows"] if r["method"] == method and r["task"] != "overall"]
        (overall,) = [r for r in summary["rows"] if r["method"] == method and r["task"] == "overall"]
        assert overall["n"] == sum(r["n"] for r in per_task)
        assert overall["score"] == pytest.approx(sum(r["score"] * r["n"] for r in per_task) / overall["n"])
    samples_before = (out / "samples.jsonl").read_bytes()
    assert main(argv) == 0  # a second run finds everything done
    assert read_rows(out / "results.jsonl") == rows
    assert (out / "samples.jsonl").read_bytes() == samples_before
    # Other prompts or another answer cap would mix with the rows there: refused, nothing written.
    capsys.readouterr()
    for option, value, started in (("--samples", "2", "1"), ("--lengths", "1024,2048", "1024"),
                                   ("--max-new-tokens", "8", "4")):  # fmt: skip
        changed = argv.copy()
        changed[changed.index(option) + 1] = value
        assert main(changed) == 2
        assert f"was started with {option} {started}, not {option} {value}" in capsys.readouterr().err
        assert read_rows(out / "results.jsonl") == rows
        assert (out / "samples.jsonl").read_bytes() == samples_before
    assert main(["arena", "score", str(out)]) == 0
    assert main(["arena", "report", str(out)]) == 0
    assert (out / "report.html").exists() and (out / "pgr.png").exists()


def test_arena_runs_longbench_from_a_local_copy_and_rescores_with_its_classes(tmp_path):
    from hybridkv.cli import main

    data = tmp_path / "longbench"
    data.mkdir()
    records = {
        "hotpotqa": {"input": "Who wrote the memo?", "context": "Passage 1:\nThe memo was written by Ada. " * 8,
                     "answers": ["Ada"], "all_classes": None},
        "trec": {"input": "What city hosts the fair?", "context": "Question: Who is it?\nType: Individual\n" * 6,
                 "answers": ["City"], "all_classes": ["City", "Individual", "Date"]},
    }  # fmt: skip
    for dataset, record in records.items():
        lines = [
            json.dumps({**record, "length": 100, "dataset": dataset, "language": "en", "_id": f"{dataset}{i}"})
            for i in range(2)
        ]
        (data / f"{dataset}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "arena"
    argv = ["arena", "run", "--workload", "longbench", "--data", str(data), "--tasks", "hotpotqa,trec",
            "--lengths", "1024", "--samples", "2", "--methods", "no-context,full,tail-replay", "--budgets", "0.1",
            "--model", "random-olmo-hybrid", "--max-new-tokens", "3", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 2 * 2 * 3
    assert all(r["score_meta"]["all_classes"] == records["trec"]["all_classes"] for r in rows if r["task"] == "trec")
    assert main(["arena", "score", str(out)]) == 0  # trec rescoring needs the stored classes
    summary_rows = json.loads((out / "summary.json").read_text())["rows"]
    assert {r["task"] for r in summary_rows} == {"hotpotqa", "trec", "overall"}
