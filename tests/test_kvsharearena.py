"""KVShareArena's layout in and out: its querysets read into chunked samples (refused line by line
when malformed), scored by its F1, and an arena run exported as kva.result.v1 files its scorer
would recompute to the arena's F1 and PGR. The fixtures are small records of our own, written in
its layout (`data/queryset/<subset>_n100.jsonl`, `agent_reports/<subset>_notes.jsonl`, `sha256.json`)."""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from pathlib import Path

import pytest

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.arena import read_rows
from hybridkv.eval.workloads import kvsharearena
from hybridkv.eval.workloads.frozen import freeze
from hybridkv.eval.workloads.longbench import PROMPTS
from hybridkv.models.tokenizer import ByteTokenizer

HOTPOT = [
    {"_id": "h1", "input": "Who wrote the first program?", "answers": ["Ada Lovelace"], "chunk_mode": "passage",
     "chunks": ["Passage 1:\nAda Lovelace wrote the first program in 1843.\n",
                "Passage 2:\nThe Analytical Engine was designed by Charles Babbage.\n"]},
    {"_id": "h2", "input": "Which engine did Babbage design?", "answers": ["the Analytical Engine", "Analytical"],
     "chunk_mode": "passage",
     "chunks": ["Passage 1:\nCharles Babbage designed the Analytical Engine.\n",
                "Passage 2:\nThe Difference Engine came first.\n", "Passage 3:\nBoth were mechanical.\n"]},
]  # fmt: skip
QASPER = [
    {"_id": "q1", "input": "what is the source of the data?", "answers": ["Android application"],
     "chunk_mode": "token512",  # pieces cut mid-word, as fixed-size token chunks are
     "chunks": ["The speech was collected with an Andr", "oid application by volunteers.", " It holds 1969 speakers."]},
]  # fmt: skip
NOTES = {
    "h1": ["Ada Lovelace wrote the first program (1843).", "Charles Babbage designed the Analytical Engine."],
    "h2": ["Babbage designed the Analytical Engine.", "The Difference Engine came first.", "Both were mechanical."],
}


def record(item: dict) -> dict:
    return {**item, "context": "".join(item["chunks"]), "n_chunks": len(item["chunks"]), "n_tok_ctx": 99}


def notes_record(item: dict) -> dict:
    notes = [{"passage_idx": i, "note_text": text, "note_token_ids": [7, 8, 9], "finish_reason": "stop"}
             for i, text in enumerate(NOTES[item["_id"]])]  # fmt: skip
    return {"_id": item["_id"], "input": item["input"], "n_notes": len(notes), "notes": notes}


def write_lines(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_release(root: Path, with_sums: bool = True) -> Path:
    """A release in KVShareArena's layout under root/data/queryset; returns that folder."""
    queryset = root / "data" / "queryset"
    write_lines(queryset / "hotpotqa_n100.jsonl", [record(r) for r in HOTPOT])
    write_lines(queryset / "qasper_n100.jsonl", [record(r) for r in QASPER])
    write_lines(queryset / "agent_reports" / "hotpotqa_notes.jsonl", [notes_record(r) for r in HOTPOT])
    (queryset / "manifest.json").write_text(json.dumps({"seed": 42, "n": 100}))
    if with_sums:
        files = ["hotpotqa_n100.jsonl", "qasper_n100.jsonl", "agent_reports/hotpotqa_notes.jsonl", "manifest.json"]
        sums = {f: hashlib.sha256((queryset / f).read_bytes()).hexdigest() for f in files}
        (queryset / "sha256.json").write_text(json.dumps(sums))
    return queryset


def test_samples_are_the_declared_chunks_behind_the_longbench_head(tmp_path):
    queryset = write_release(tmp_path)
    tokenizer = ByteTokenizer()
    for task, items in (("re-hotpotqa", HOTPOT), ("re-qasper", QASPER)):
        subset = task.removeprefix("re-")
        head, tail = PROMPTS[subset].split("{context}")
        # the release folder itself, or the folder holding data/queryset
        for data in (queryset, tmp_path):
            samples = kvsharearena.generate(task, 2048, 10, tokenizer, data_path=str(data))
            assert len(samples) == len(items)
            for sample, item in zip(samples, items, strict=True):
                assert sample.chunks == [head, *item["chunks"]]
                assert "".join(sample.chunks) == sample.context == head + record(item)["context"]
                assert sample.context + sample.question == PROMPTS[subset].format(**record(item))
                assert sample.golds == item["answers"] and sample.meta["_id"] == item["_id"]
                assert sample.meta["track"] == "re" and sample.meta["subset"] == subset
                assert sample.meta["tokens_to_generate"] == kvsharearena.TOKENS_TO_GENERATE[task]
                assert sample.meta["context_tokens"] == sum(len(tokenizer.encode(c)) for c in sample.chunks)
    # the first n in file order
    (first,) = kvsharearena.generate("re-hotpotqa", 2048, 1, tokenizer, data_path=str(queryset))
    assert first.meta["_id"] == "h1"
    # the agent reports: one chunk per note, the golds joined from the queryset by _id
    head, tail = PROMPTS["hotpotqa"].split("{context}")
    reports = kvsharearena.generate("ar-hotpotqa", 2048, 10, tokenizer, data_path=str(queryset))
    for sample, item in zip(reports, HOTPOT, strict=True):
        assert sample.chunks == [head, *(note + kvsharearena.NOTE_SEPARATOR for note in NOTES[item["_id"]])]
        assert "".join(sample.chunks) == sample.context
        assert sample.question == tail.format(input=item["input"]) and sample.golds == item["answers"]
        assert sample.meta["track"] == "ar" and sample.meta["reports_file"] == "agent_reports/hotpotqa_notes.jsonl"


def test_missing_data_skips_the_task_and_a_record_too_long_is_refused_not_cut(tmp_path):
    queryset = write_release(tmp_path)
    tokenizer = ByteTokenizer()
    with pytest.raises(MissingDataError, match="re-hotpotqa skipped: needs --data"):
        kvsharearena.generate("re-hotpotqa", 2048, 2, tokenizer)
    with pytest.raises(MissingDataError, match="holds no multifieldqa_en_n100.jsonl"):
        kvsharearena.generate("re-multifieldqa_en", 2048, 2, tokenizer, data_path=str(queryset))
    with pytest.raises(HybridKVError, match=r"hotpotqa_n100.jsonl:1 \(_id h1\) needs \d+ tokens.*--lengths"):
        kvsharearena.generate("re-hotpotqa", 200, 2, tokenizer, data_path=str(queryset))
    with pytest.raises(HybridKVError, match="unknown kvsharearena task"):
        kvsharearena.generate("hotpotqa", 2048, 2, tokenizer, data_path=str(queryset))


def _corrupt(name: str, queryset: Path) -> tuple[str, str]:
    """Break the release one way; return (the file:line expected in the message, the rest of it)."""
    hotpot = queryset / "hotpotqa_n100.jsonl"
    notes = queryset / "agent_reports" / "hotpotqa_notes.jsonl"
    lines = hotpot.read_text().splitlines()
    second = json.loads(lines[1])
    if name == "not json":
        lines[1] = lines[1][:-5]
    elif name == "missing field":
        del second["chunks"]
        lines[1] = json.dumps(second)
    elif name == "answers not a list":
        second["answers"] = "Analytical"
        lines[1] = json.dumps(second)
    elif name == "n_chunks wrong":
        second["n_chunks"] = 2
        lines[1] = json.dumps(second)
    elif name == "duplicate _id":
        second["_id"] = "h1"
        lines[1] = json.dumps(second)
    elif name == "not an object":
        lines[1] = "[1, 2]"
    elif name.startswith("notes"):
        note_lines = notes.read_text().splitlines()
        bad = json.loads(note_lines[1])
        if name == "notes out of order":
            bad["notes"][0]["passage_idx"] = 1
        elif name == "notes unknown _id":
            bad["_id"] = "h9"
        elif name == "notes without text":
            del bad["notes"][2]["note_text"]
        note_lines[1] = json.dumps(bad)
        notes.write_text("\n".join(note_lines) + "\n")
        expected = {"notes out of order": "passage_idx 1 out of order", "notes unknown _id": "'h9' is not in",
                    "notes without text": r"notes\[2\]: no 'note_text' field"}  # fmt: skip
        return f"{notes}:2", expected[name]
    hotpot.write_text("\n".join(lines) + "\n")
    expected = {"not json": "not a JSON line", "missing field": "no 'chunks' field",
                "answers not a list": "'answers' is a str",
                "n_chunks wrong": "declares n_chunks 2 but holds 3", "duplicate _id": "_id 'h1' again",
                "not an object": "not a JSON object"}  # fmt: skip
    return f"{hotpot}:2", expected[name]


@pytest.mark.parametrize(
    "name",
    ["not json", "missing field", "answers not a list", "n_chunks wrong", "duplicate _id", "not an object",
     "notes out of order", "notes unknown _id", "notes without text"],
)  # fmt: skip
def test_a_malformed_line_is_refused_with_its_file_and_line(tmp_path, name):
    queryset = write_release(tmp_path, with_sums=False)
    where, what = _corrupt(name, queryset)
    task = "ar-hotpotqa" if name.startswith("notes") else "re-hotpotqa"
    with pytest.raises(HybridKVError, match=f"^{re.escape(where)}: .*{what}") as err:
        kvsharearena.generate(task, 2048, 1, ByteTokenizer(), data_path=str(queryset))  # n=1: line 2 is read too
    assert not isinstance(err.value, MissingDataError) and "\n" not in str(err.value)


def test_a_changed_or_unreadable_file_is_refused(tmp_path):
    queryset = write_release(tmp_path)
    hotpot = queryset / "hotpotqa_n100.jsonl"
    hotpot.write_text(hotpot.read_text().replace("1843", "1842"))
    with pytest.raises(HybridKVError, match="hotpotqa_n100.jsonl: sha256 .* sha256.json records"):
        kvsharearena.generate("re-hotpotqa", 2048, 2, ByteTokenizer(), data_path=str(queryset))
    (queryset / "sha256.json").unlink()
    hotpot.unlink()
    hotpot.mkdir()  # there, but not a readable file
    with pytest.raises(HybridKVError, match="hotpotqa_n100.jsonl: cannot read") as err:
        kvsharearena.generate("re-hotpotqa", 2048, 2, ByteTokenizer(), data_path=str(queryset))
    assert not isinstance(err.value, MissingDataError)
    (queryset / "qasper_n100.jsonl").write_bytes(b'{"_id": "q\xff"}\n')
    with pytest.raises(HybridKVError, match="qasper_n100.jsonl: not UTF-8"):
        kvsharearena.generate("re-qasper", 2048, 2, ByteTokenizer(), data_path=str(queryset))


@pytest.mark.parametrize(
    "prediction, golds, expected",
    [
        ("Ada Lovelace", ["Ada Lovelace"], 1.0),
        ("The answer: ada, LOVELACE!", ["Ada Lovelace"], 2 * (2 / 3) * 1 / (2 / 3 + 1)),  # "answer" is extra
        ("an Analytical Engine", ["the Analytical Engine", "Analytical"], 1.0),  # articles dropped; best gold
        ("Engine", ["the Analytical Engine", "Analytical"], 2 * 1 * 0.5 / 1.5),
        ("", ["Ada"], 0.0),
        ("the", ["a"], 0.0),  # both empty after normalisation: nothing shared
        ("Ada", [], 0.0),  # no golds: 0.0, as its max(..., default=0.0)
        ("Ada Ada Ada", ["Ada"], 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # multiset overlap
    ],
)
def test_f1_raw_is_kvsharearenas_token_f1(prediction, golds, expected):
    assert kvsharearena.f1_raw(prediction, golds) == pytest.approx(expected)
    assert kvsharearena.score("re-hotpotqa", prediction, golds) == kvsharearena.f1_raw(prediction, golds)


# KVShareArena's validate (kvsharearena/schema.py), restated for the check: the keys it requires,
# their types where it checks them, and the version string; not the frozen-release checks
# (100 samples, the release's _ids), which our fixtures cannot meet.
SUMMARY_KEYS = {"method", "track", "subset", "model", "n", "backend", "versions", "git_rev"}
ITEM_KEYS = {"_id", "pred", "golds", "f1_raw", "recomputed_layer_tokens", "dense_payload_layer_tokens", "kv_bytes",
             "ttft_ms"}  # fmt: skip
CARD_KEYS = {"name", "provenance", "backend", "versions", "cost_notes", "training_data"}


def assert_kva_result(doc: dict) -> None:
    assert doc["schema"] == "kva.result.v1"
    assert set(doc) >= {"schema", "summary", "results", "method_card"}
    summary, rows, card = doc["summary"], doc["results"], doc["method_card"]
    assert summary.keys() >= SUMMARY_KEYS and isinstance(rows, list) and summary["n"] == len(rows) > 0
    assert len({r["_id"] for r in rows}) == len(rows)
    for row in rows:
        assert row.keys() >= ITEM_KEYS
        assert isinstance(row["_id"], str) and isinstance(row["pred"], str)
        assert isinstance(row["golds"], list) and all(isinstance(g, str) for g in row["golds"])
        for key in ("recomputed_layer_tokens", "dense_payload_layer_tokens", "kv_bytes"):
            assert isinstance(row[key], int | float) and not isinstance(row[key], bool) and row[key] >= 0
        assert isinstance(row["ttft_ms"], float) and row["ttft_ms"] >= 0
    assert card.keys() >= CARD_KEYS and card["provenance"] in ("official", "port", "reference")
    assert summary["track"] in ("re", "ar") and summary["subset"] in ("qasper", "multifieldqa_en", "hotpotqa")
    json.dumps(doc, allow_nan=False)  # plain JSON: no NaN or infinity


def their_pgr(doc: dict, anchors: dict) -> float | None:
    """PGR as KVShareArena's score_doc computes it: F1 recomputed from pred/golds, means over the
    file's samples and over the anchors', rounded to 4 places, None when the gap is ≤ 1e-3."""
    scores = [kvsharearena.f1_raw(r["pred"], r["golds"]) for r in doc["results"]]
    anchor = anchors["tracks"][doc["summary"]["track"]][doc["summary"]["subset"]]
    floor, oracle = statistics.fmean(anchor["floor"].values()), statistics.fmean(anchor["oracle"].values())
    return None if oracle - floor <= 1e-3 else round((statistics.fmean(scores) - floor) / (oracle - floor), 4)


def test_arena_runs_the_release_and_exports_kva_results(tmp_path, capsys):
    from hybridkv.cli import main
    from hybridkv.eval.kva import check_resume

    queryset = write_release(tmp_path / "release")
    out = tmp_path / "arena"
    methods = ["no-context", "full", "naive+linearkv"]
    argv = ["arena", "run", "--workload", "kvsharearena", "--data", str(queryset), "--tasks", "re-hotpotqa,ar-hotpotqa",
            "--lengths", "2048", "--samples", "2", "--methods", ",".join(methods), "--model", "random-nemotron-h",
            "--max-new-tokens", "4", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 2 * 2 * len(methods)
    assert {r["chunks"] for r in rows if r["task"] == "re-hotpotqa"} == {3, 4}  # head + 2 or 3 passages
    assert json.loads((out / "run.json").read_text())["model"] == "random-nemotron-h"
    capsys.readouterr()
    to = tmp_path / "kva"
    assert main(["arena", "export", "--format", "kva", str(out), "--to", str(to)]) == 0
    assert "anchors_random-nemotron-h.json" in capsys.readouterr().out
    files = sorted(to.glob("*_*_hotpotqa.json"))
    assert [f.name for f in files] == sorted(f"{m}_{track}_hotpotqa.json" for m in methods for track in ("ar", "re"))
    anchors = json.loads((to / "anchors_random-nemotron-h.json").read_text())
    summary = {(r["task"], r["method"]): r for r in json.loads((out / "summary.json").read_text())["rows"]}
    by_key = {(r["task"], r["method"], r["id"]): r for r in rows}
    for path in files:
        doc = json.loads(path.read_text())
        assert_kva_result(doc)
        s = doc["summary"]
        task = f"{s['track']}-{s['subset']}"
        assert s["model"] == "random-nemotron-h" and s["n"] == 2 and s["method"] in methods
        assert doc["method_card"]["name"] == s["method"]
        assert doc["method_card"]["provenance"] == ("port" if "+" in s["method"] else "reference")
        assert s["queryset"]["file"] == "hotpotqa_n100.jsonl"
        assert s["queryset"]["sha256"] == hashlib.sha256((queryset / "hotpotqa_n100.jsonl").read_bytes()).hexdigest()
        assert s["queryset"]["manifest_checked"] is True  # write_release's sha256.json lists every file read
        assert [r["_id"] for r in doc["results"]] == ["h1", "h2"]
        for item in doc["results"]:
            row = by_key[(task, s["method"], item["aux"]["hybridkv_id"])]
            # the F1 their scorer recomputes from the exported prediction equals the arena's row
            assert kvsharearena.f1_raw(item["pred"], item["golds"]) == item["f1_raw"] == row["score"]
            assert item["pred"] == row["prediction"] and item["golds"] == row["golds"]
            assert item["ttft_ms"] == pytest.approx(row["ttft_s"] * 1000)
            assert item["kv_bytes"] == row["kv_bytes"] + row["state_bytes"]
            assert item["dense_payload_layer_tokens"] == row["context_tokens"] * item["aux"]["layers"]
            assert item["aux"]["build_ms"] == pytest.approx(row["build_s"] * 1000)
            assert item["n_chunks"] == row["chunks"] - 1
        ours = summary[(task, s["method"])]
        assert s["f1_raw"] == pytest.approx(ours["score"]) and s["pgr"] == ours["pgr"]
        mine = their_pgr(doc, anchors)
        assert mine == (None if ours["pgr"] is None else round(ours["pgr"], 4))
        if s["method"] == "full":
            assert all(i["recomputed_layer_tokens"] == i["dense_payload_layer_tokens"] for i in doc["results"])
        if s["method"] == "no-context":
            assert all(i["recomputed_layer_tokens"] == 0 and i["kv_bytes"] == 0 for i in doc["results"])
        if s["method"] == "naive+linearkv":  # stored KV and states reused, only the question run
            assert all(i["recomputed_layer_tokens"] == 0 < i["kv_bytes"] for i in doc["results"])
    with pytest.raises(HybridKVError, match="was started with --model random-nemotron-h, not --model random-olmo"):
        check_resume(out, model="random-olmo-hybrid", dtype="float32", seed=0, max_new_tokens=4)


def test_export_pgr_is_the_arenas_where_the_gap_is_defined(tmp_path):
    """Hand-written answers with known F1 (the random models score 0 everywhere): the exported files
    give the arena's PGR, and their anchors are the no-context and full rows."""
    from hybridkv.eval.kva import export_kva
    from hybridkv.eval.summary import rescore, summarise

    queryset = write_release(tmp_path / "release")
    samples = kvsharearena.generate("re-hotpotqa", 2048, 2, ByteTokenizer(), data_path=str(queryset))
    out = tmp_path / "run"
    freeze(samples, out / "samples.jsonl")
    answers = {"no-context": ["Babbage", "Difference"], "full": ["Ada Lovelace", "Analytical"],
               "epic+compose": ["Lovelace", "Analytical Engine"]}  # fmt: skip
    rows = []
    for method, predictions in answers.items():
        for sample, prediction in zip(samples, predictions, strict=True):
            rows.append({
                "workload": "kvsharearena", "id": sample.id, "task": sample.task, "length": sample.length,
                "method": method, "budget": None, "prediction": prediction, "golds": sample.golds, "score": -1.0,
                "score_meta": {}, "context_tokens": 100, "chunks": len(sample.chunks), "question_tokens": 10,
                "reused_tokens": 0, "replayed_tokens": 0, "recomputed_tokens": 10, "recomputed_layer_tokens": 40,
                "dense_layer_tokens": 440, "kv_bytes": 5, "state_bytes": 3, "ttft_s": 0.5, "build_s": 0.25,
            })  # fmt: skip
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(HybridKVError, match="no run.json says which model"):
        export_kva(out)
    paths = export_kva(out, model="some/checkpoint-dir")
    assert (out / "kva" / "anchors_checkpoint-dir.json") in paths
    anchors = json.loads((out / "kva" / "anchors_checkpoint-dir.json").read_text())
    rescored = rescore(rows, lambda row: kvsharearena.f1_raw(row["prediction"], row["golds"]))
    ours = {r["method"]: r for r in summarise(rescored)["rows"]}
    assert ours["full"]["score"] > ours["no-context"]["score"]  # the gap is defined
    for method in answers:
        doc = json.loads((out / "kva" / f"{method}_re_hotpotqa.json").read_text())
        assert_kva_result(doc)
        assert doc["summary"]["pgr"] == ours[method]["pgr"] is not None
        assert their_pgr(doc, anchors) == round(ours[method]["pgr"], 4)
        item = doc["results"][0]
        assert (item["recomputed_layer_tokens"], item["dense_payload_layer_tokens"], item["kv_bytes"]) == (0, 400, 8)
        assert item["ttft_ms"] == 500.0 and item["aux"]["build_ms"] == 250.0
    assert anchors["tracks"]["re"]["hotpotqa"]["oracle"] == {
        "h1": 1.0, "h2": kvsharearena.f1_raw("Analytical", samples[1].golds)
    }  # fmt: skip
    (out / "results.jsonl").write_text(json.dumps({**rows[0], "workload": "ruler"}) + "\n")
    with pytest.raises(HybridKVError, match="holds ruler rows; --format kva exports --workload kvsharearena runs"):
        export_kva(out, model="x")
