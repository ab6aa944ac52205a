"""The updates workload: records set again later, the latest setting asked and scored, its place
marked for the needle-in-tail split; and that split and retention's CI in the summary."""

from __future__ import annotations

import pytest

from hybridkv.eval.arena import needle_distance, scored_row
from hybridkv.eval.summary import summarise
from hybridkv.eval.workloads import get_workload, score_row
from hybridkv.eval.workloads.updates import SETTING, TOKENS_TO_GENERATE, generate
from hybridkv.models.tokenizer import ByteTokenizer


@pytest.mark.parametrize("task", ["updates", "updates-chat"])
@pytest.mark.parametrize("length", [2048, 8192])
def test_the_latest_setting_is_the_gold_and_every_prompt_fits(task, length):
    tokenizer = ByteTokenizer()
    samples = generate(task, length, 12, tokenizer, seed=1)
    assert len({s.id for s in samples}) == 12
    assert {s.meta["haystack"] for s in samples} == {"noise", "essay"}
    for sample in samples:
        prompt = len(tokenizer.encode(sample.context + sample.question))
        assert 0.95 * length < prompt + TOKENS_TO_GENERATE[task] <= length
        key = sample.question.split("number for ")[1].split("?")[0]
        # Every setting of the asked record in the text, in order; the gold is the last of them.
        found = sorted((sample.context.index(SETTING.format(key=key, value=v)), v)
                       for v in [*sample.meta["stale"], *sample.golds])  # fmt: skip
        assert [v for _, v in found] == [*sample.meta["stale"], *sample.golds]
        assert len(found) >= 2 and all(sample.context.count(v) == 1 for _, v in found)
        assert sample.context[sample.meta["answer_offset"] :].startswith(SETTING.format(key=key, value=sample.golds[0]))
        for setting in sample.meta["settings"]:
            assert sample.context[setting["offset"] :].startswith(setting["text"])
        # The arena's distance counts the tokens from that setting to the context's end.
        distance = needle_distance(sample, tokenizer, len(tokenizer.encode(sample.context)))
        tail = tokenizer.decode(tokenizer.encode(sample.context)[-distance:])
        assert tail.startswith(SETTING.format(key=key, value=sample.golds[0]))


def test_the_chat_form_puts_every_setting_in_a_user_turn_and_asks_after_the_last_turn():
    tokenizer = ByteTokenizer()
    plain, chat = (generate(task, 4096, 8, tokenizer, seed=0) for task in ("updates", "updates-chat"))
    for sample in chat:
        turns = sample.context.split("\n\n")[1:]  # after the head
        assert len(turns) >= 10 and all(t.startswith("User: ") and "\nAssistant: " in t for t in turns)
        for setting in sample.meta["settings"]:
            turn = next(t for t in turns if setting["text"] in t)
            assert turn.index(setting["text"]) < turn.index("\nAssistant: ")  # the user sets it
        assert sample.question.startswith("\n\nUser: What is the current")
        assert "\nAssistant: The current special magic number for" in sample.question
    # The chat form is its own draw: its samples are not the plain ones in another wrapping.
    assert [s.golds for s in plain] != [s.golds for s in chat]


def test_samples_are_seeded_and_the_same_records_at_every_length():
    tokenizer = ByteTokenizer()
    short, again, long = (generate("updates", n, 6, tokenizer, seed=s) for n, s in ((2048, 0), (2048, 0), (4096, 0)))
    assert short == again and short != generate("updates", 2048, 6, tokenizer, seed=1)
    assert [(s.golds, s.question) for s in short] == [(s.golds, s.question) for s in long]


def test_an_earlier_setting_scores_zero_even_beside_the_latest_and_rescoring_agrees():
    sample = generate("updates", 2048, 1, ByteTokenizer(), seed=0)[0]
    (gold,), stale = sample.golds, sample.meta["stale"]
    workload = get_workload("updates")
    cases = {f" {gold}.": 1.0, f" {stale[0]}.": 0.0, f" {gold}, earlier {stale[-1]}.": 0.0, " 1234.": 0.0}
    for prediction, expected in cases.items():
        row = scored_row("updates", sample, "full", None, prediction, workload.score)
        assert row["score"] == expected and score_row(row) == expected  # the stored row rescored alike


def _row(sample: int, method: str, score: float, budget=None, distance=None, replayed=0) -> dict:
    return {"workload": "updates", "task": "updates", "length": 2048, "id": f"s{sample}", "method": method,
            "budget": budget, "score": score, "prediction": str(score), "golds": ["1"], "context_tokens": 1000,
            "needle_distance": distance, "replayed_tokens": replayed}  # fmt: skip


def test_the_needle_split_counts_solved_samples_by_whether_the_tail_holds_the_latest_setting():
    # full solves s0-s3 (not s4); the tail (100 tokens) holds the setting of s0 and s1 only.
    full = [_row(i, "full", float(i < 4), replayed=1000) for i in range(5)]
    kept_at = [(1.0, 40), (0.0, 100), (1.0, 500), (1.0, 900), (1.0, 10)]  # (score, distance) per sample
    tail = [_row(i, "tail-replay", score, "0.1", distance, 100) for i, (score, distance) in enumerate(kept_at)]
    rows = {(r["method"], r["budget"]): r for r in summarise(full + tail)["rows"]}
    assert rows[("tail-replay", "0.1")]["needle_in_tail"] == {
        "inside_n": 2, "inside_kept": 0.5, "outside_n": 2, "outside_kept": 1.0
    }  # fmt: skip
    assert rows[("full", None)]["needle_in_tail"] is None  # full prefill replays no tail


def test_retention_has_a_paired_interval_around_it():
    full = [_row(i, "full", float(i % 4 != 0)) for i in range(40)]  # 30 of 40
    same = [_row(i, "zero-state", r["score"]) for i, r in enumerate(full)]
    kept = [_row(i, "tail-replay", r["score"] * (i % 2), "0.1") for i, r in enumerate(full)]  # 20 of the 30
    rows = {r["method"]: r for r in summarise(full + same + kept)["rows"]}
    assert rows["zero-state"]["retention"] == 1.0 and rows["zero-state"]["retention_ci95"] == [1.0, 1.0]
    low, high = rows["tail-replay"]["retention_ci95"]
    assert rows["tail-replay"]["retention"] == pytest.approx(2 / 3)
    assert low < 2 / 3 < high and 0.1 < high - low < 0.6
