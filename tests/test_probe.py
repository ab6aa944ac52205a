"""`hybridkv probe`: where a model reads its answer, measured by swapping its KV and its states."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from hybridkv.cli import main
from hybridkv.errors import HybridKVError
from hybridkv.eval.probe import PROBE_FILE, ProbeConfig, Prober, counterfactual, find_probe, run_probe, verdict
from hybridkv.eval.workloads import Sample, get_workload
from hybridkv.methods import Budget
from hybridkv.models.tiny import TRAINED_MODELS
from hybridkv.models.tokenizer import ByteTokenizer, load_tokenizer

BUDGETS = [Budget(fraction=0.1), Budget(fraction=1.0)]


def _probe(models, name: str, length: int = 2048, samples: int = 4) -> dict:
    config = ProbeConfig(tasks=["niah_single_1"], length=length, samples=samples, budgets=BUDGETS, min_solved=2)
    return run_probe(models[name], load_tokenizer(name), config, show_progress=False)


@pytest.fixture(scope="module")
def glm_probe(models) -> dict:
    return _probe(models, "tiny-glm5-next")


def test_the_default_glm_model_reads_its_answer_from_kda_layer_2(glm_probe):
    """Measured, not looked up: with the true MLA KV and a counterfactual context's states it answers
    the counterfactual value; swapping layer 2's state alone does the same, layers 0 and 1 do not."""
    assert glm_probe["reads_from"] == "states, layer 2"
    task = glm_probe["tasks"][0]
    assert task["solved"] >= 2  # a verdict on samples the model answers
    assert task["state_swap_follows_states"] >= 0.5 > task["kv_swap_follows_kv"]


def test_the_gated_deltanet_model_reads_its_answer_from_attention(models):
    found = _probe(models, "tiny-qwen3-next")
    assert found["reads_from"] == "attention"
    assert found["tasks"][0]["kv_swap_follows_kv"] >= 0.5


def test_every_probe_condition_rests_on_exact_resumes(glm_probe):
    """The unswapped resume at L (true KV, true states) keeps every solved answer, and replaying the
    whole prefix (budget 1.0: the needle is always inside the tail) keeps every one too."""
    task = glm_probe["tasks"][0]
    assert task["resumed_kept"] == 1.0
    whole = next(row for row in task["replay"] if row["budget"] == 1.0)
    assert whole["kept"] == 1.0 and whole["needle_in_tail_n"] == task["solved"] and whole["needle_outside_n"] == 0


def test_a_model_that_solves_nothing_gets_no_verdict(models):
    found = _probe(models, "random-qwen3-next", length=512, samples=2)
    assert found["tasks"][0]["solved"] == 0 and found["reads_from"] == "unmeasured"


@pytest.mark.parametrize("value", ["4817203", "blue-whale", "3f2b9c1e-7a4d-4e8b-9f10-2c3d4e5f6a7b", "VAR ABCDE"])
def test_a_counterfactual_value_differs_everywhere_but_keeps_its_shape(value):
    other = counterfactual(value)
    assert len(other) == len(value) and other != value
    for a, b in zip(value, other, strict=True):
        assert (a.isdigit(), a.isalpha(), a.isupper()) == (b.isdigit(), b.isalpha(), b.isupper())
        assert a == b if not a.isalnum() else a != b
    if value.count("-") == 4:  # a uuid stays hexadecimal
        assert set(other) <= set("0123456789abcdef-")


def test_verdicts_follow_the_shares():
    assert verdict(0.0, 1.0, 0.0, [2]) == "states, layer 2"
    assert verdict(0.1, 0.9, 0.2, [1, 2]) == "states, layers 1, 2"
    assert verdict(0.9, 0.0, 1.0) == "attention"
    # the value is in attention, but zeroed states lose it (layer 4's alone does)
    assert verdict(0.9, 0.0, 0.3, [], [4]) == "attention, with states, layer 4"
    assert verdict(0.6, 0.7, 0.0) == "mixed: both"
    assert verdict(0.3, 0.1, 1.0) == "mixed: neither"  # no swap moves the answer in half the samples
    assert verdict(0.3, 0.3, 1.0) == "mixed: split"
    assert verdict(0.1, 0.8, 0.5, [0], kind="order") == "order from states, layer 0"
    assert verdict(None, None) == "unmeasured"


def test_too_few_solved_samples_give_no_verdict(models):
    config = ProbeConfig(tasks=["niah_single_1"], length=1024, samples=2, budgets=BUDGETS, min_solved=3)
    found = run_probe(models["tiny-qwen3-next"], load_tokenizer("tiny-qwen3-next"), config, show_progress=False)
    assert found["tasks"][0]["reads_from"] == f"too few solved ({found['tasks'][0]['solved']} < 3)"
    assert found["reads_from"] == "too few solved"
    k, n = found["tasks"][0]["counts"]["zero_state_kept"]
    assert n == found["tasks"][0]["solved"] and k == round(found["tasks"][0]["zero_state_kept"] * n)


def test_an_order_counterfactual_exchanges_the_latest_setting_with_the_first():
    sample = get_workload("updates").generate("updates", 1024, 1, ByteTokenizer(), 0)[0]
    kind, swapped, other, meta, _ = Prober.counterfactual_of(sample)
    (gold,), first = sample.golds, sample.meta["stale"][0]
    assert kind == "order" and other == [first] and len(swapped) == len(sample.context)
    assert swapped.index(gold) < swapped.index(first)  # the latest value now stands first, and the first last
    assert sorted(swapped) == sorted(sample.context)  # the same values, in another order
    score = get_workload("updates").score
    assert score("updates", f" {first}.", other, meta) == 1.0 and score("updates", f" {gold}.", other, meta) == 0.0


def test_a_counterfactual_that_tokenizes_to_another_length_is_refused(models):
    class Merging:  # BPE-like: "55" is one token, so 1002003's counterfactual 6557558 is two tokens shorter
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text.replace("55", "5")]

    context = "Noise. One of the special magic numbers for tall-tree is: 1002003. More noise."
    sample = Sample("s", "niah_single_1", 512, context, "\nWhat is it? It is", ["1002003"])
    assert Prober(models["tiny-qwen3-next"], Merging(), ProbeConfig()).probe(sample) == "counterfactual length"


def test_a_corrupt_probe_beside_a_checkpoint_is_refused(tmp_path):
    (tmp_path / PROBE_FILE).write_text("{not json")
    with pytest.raises(HybridKVError, match="not a hybridkv probe"):
        find_probe(str(tmp_path))


def test_probe_writes_beside_a_checkpoint_and_the_arena_report_shows_it(tmp_path, capsys):
    """`hybridkv probe --model DIR` keeps its verdict beside the checkpoint; an arena run on that
    checkpoint then states it above its scores."""
    checkpoint = tmp_path / "model"
    shutil.copytree(TRAINED_MODELS["tiny-qwen3-next"], checkpoint)
    (checkpoint / PROBE_FILE).unlink(missing_ok=True)
    args = ["--model", str(checkpoint), "--length", "1024", "--samples", "2", "--tasks", "niah_single_1"]
    args += ["--min-solved", "1"]
    assert main(["probe", *args, "--budgets", "0.1", "--out", str(tmp_path / "probe"), "--no-progress"]) == 0
    assert "reads its answer from: attention" in capsys.readouterr().out
    kept = json.loads((checkpoint / PROBE_FILE).read_text())
    assert kept == json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert (tmp_path / "probe" / "probe.png").stat().st_size > 0
    # every share printed with its count and a 95% interval
    table = (tmp_path / "probe" / "probe.md").read_text()
    shares = re.findall(r"\| \d\.\d\d \(\d+/\d+\) \[\d\.\d\d, \d\.\d\d\] ", table)
    assert len(shares) == 3  # KV swap, state swap, zero-state
    arena = tmp_path / "arena"
    run = ["arena", "run", "--model", str(checkpoint), "--lengths", "1024", "--samples", "1"]
    assert main([*run, "--tasks", "niah_single_1", "--methods", "full", "--out", str(arena), "--no-progress"]) == 0
    assert main(["arena", "score", str(arena)]) == 0 and main(["arena", "report", str(arena)]) == 0
    report = (arena / "report.md").read_text()
    assert f"Where {checkpoint} reads its answer: attention" in report


def test_probe_refuses_a_task_it_does_not_know(models):
    with pytest.raises(HybridKVError, match="unknown ruler task"):
        run_probe(models["tiny-qwen3-next"], load_tokenizer("tiny-qwen3-next"), ProbeConfig(tasks=["nope"]))


def test_a_length_the_workload_cannot_fill_is_one_line(models):
    config = ProbeConfig(workload="multi-turn", tasks=["multi-turn"], length=1024, samples=1)
    with pytest.raises(HybridKVError, match=r"^probe: multi-turn multi-turn at 1024 tokens: .*cannot hold"):
        run_probe(models["tiny-qwen3-next"], load_tokenizer("tiny-qwen3-next"), config)
