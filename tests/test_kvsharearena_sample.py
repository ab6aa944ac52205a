"""KVShareArena's real querysets: the first lines of its qasper, multifieldqa_en and hotpotqa files
and of its hotpotqa agent reports, byte-exact, in shared/kvsharearena-sample beside the repository
(see its SOURCE.md). Every expectation is read from the raw lines here with `json.loads`, never
from what the code under test returned; the export is checked by the rules of KVShareArena's
`kva validate` (kvsharearena/schema.py and cli.py), restated below.

The folder is test data from a public repository and is never copied into the project. Without it
these tests fail rather than skip: CI always has it."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from pathlib import Path

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.eval.arena import read_rows
from hybridkv.eval.kva import problems
from hybridkv.eval.workloads import kvsharearena
from hybridkv.eval.workloads.frozen import load_frozen
from hybridkv.eval.workloads.longbench import PROMPTS
from hybridkv.models.tokenizer import ByteTokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "kvsharearena-sample"
QUERYSET = SAMPLE / "data" / "queryset"
REPORTS = "agent_reports/hotpotqa_notes.jsonl"
TASKS = ("re-qasper", "re-multifieldqa_en", "re-hotpotqa", "ar-hotpotqa")
LENGTH = 60_000  # above the byte length of every sample's prompt and answer (hotpotqa line 1: 56K bytes)
MODEL = "random-nemotron-h"


def lines(relative: str) -> list[dict]:
    """The raw records of a sample file, one per line, parsed here and nowhere else."""
    text = (QUERYSET / relative).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line]


@pytest.fixture(scope="module")
def raw() -> dict[str, list[dict]]:
    if not QUERYSET.is_dir():
        pytest.fail(f"{QUERYSET} is missing: these tests read KVShareArena's real lines from shared/ beside the repo")
    out = {subset: lines(f"{subset}_n100.jsonl") for subset in kvsharearena.SUBSETS}
    out["notes"] = lines(REPORTS)
    return out


def head_of(subset: str) -> str:
    """LongBench's template up to the context: the arena's first cached piece."""
    return PROMPTS[subset].split("{context}")[0]


def first_difference(a: str, b: str) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_the_sample_is_the_one_source_md_describes(raw):
    listed = re.findall(r"^([0-9a-f]{64})  (\S+)$", (SAMPLE / "SOURCE.md").read_text(), flags=re.M)
    assert len(listed) == 5
    for digest, relative in listed:
        assert hashlib.sha256((SAMPLE / relative).read_bytes()).hexdigest() == digest, relative
    assert not (QUERYSET / "sha256.json").exists()  # whole-file hashes cannot vouch for a few lines
    assert [len(raw[s]) for s in ("qasper", "multifieldqa_en", "hotpotqa", "notes")] == [2, 2, 1, 1]
    # The one line whose context is not its chunks joined: a 512-token boundary inside "Λ".
    line = raw["multifieldqa_en"][1]
    assert line["_id"].startswith("425c85c8") and line["n_chunks"] == len(line["chunks"]) == 22
    assert line["chunks"][13].endswith("\ufffd") and line["chunks"][14].startswith("\ufffd")  # chunks 14 and 15
    joined = "".join(line["chunks"])
    at = first_difference(joined, line["context"])
    assert (line["context"][at], joined[at : at + 2]) == ("Λ", "\ufffd\ufffd")
    clean = [r for s in kvsharearena.SUBSETS for r in raw[s] if r is not line]
    assert all("".join(r["chunks"]) == r["context"] for r in clean)


@pytest.mark.parametrize("data", [SAMPLE, QUERYSET], ids=["sample folder", "its data/queryset"])
def test_every_real_line_is_its_declared_chunks_behind_the_longbench_head(raw, data):
    tokenizer = ByteTokenizer()
    for task in TASKS:
        track, subset = task.split("-", 1)
        head, tail = PROMPTS[subset].split("{context}")
        samples = kvsharearena.generate(task, LENGTH, 100, tokenizer, data_path=str(data))
        records = raw["notes"] if track == "ar" else raw[subset]
        assert [s.meta["_id"] for s in samples] == [r["_id"] for r in records]
        golds = {r["_id"]: r["answers"] for r in raw[subset]}
        file = QUERYSET / f"{subset}_n100.jsonl"
        for index, (sample, record) in enumerate(zip(samples, records, strict=True)):
            assert sample.golds == golds[record["_id"]]
            assert sample.question == tail.format(input=record["input"])
            if track == "re":
                cached = record["chunks"]
                assert sample.meta["line"] == index + 1
                # the prompt is the chunks, where the context is something else
                assert (sample.context == head + record["context"]) == ("".join(cached) == record["context"])
            else:
                cached = [note["note_text"] + kvsharearena.NOTE_SEPARATOR for note in record["notes"]]
                assert [note["passage_idx"] for note in record["notes"]] == list(range(len(cached)))
                assert sample.meta["reports_sha256"] == hashlib.sha256((QUERYSET / REPORTS).read_bytes()).hexdigest()
            # what the arena tokenises and caches piece by piece
            assert sample.segments() == sample.chunks == [head, *cached]
            assert sample.context == head + "".join(cached)
            assert sample.meta["context_tokens"] == sum(len(c.encode("utf-8")) for c in [head, *cached])
            assert sample.meta["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
            assert sample.meta["manifest_checked"] is False
    line2 = kvsharearena.generate("re-multifieldqa_en", LENGTH, 2, tokenizer, data_path=str(data))[1]
    assert len(line2.chunks) == 1 + 22 and line2.chunks[14].endswith("\ufffd")


def test_a_context_that_is_not_its_chunks_is_reported_once_for_that_line_only(raw, caplog, monkeypatch):
    monkeypatch.setattr(kvsharearena, "_REPORTED", set())  # what earlier tests reported is not this test's
    caplog.set_level(logging.WARNING, logger="hybridkv.eval")
    for task in ("re-qasper", "re-hotpotqa", "ar-hotpotqa"):
        kvsharearena.load(task, SAMPLE)
    assert caplog.records == []
    for n in (1, None, 2):  # a run reads the file once per length; n=1 still reads line 2
        kvsharearena.load("re-multifieldqa_en", SAMPLE, n)
    (record,) = caplog.records
    line = raw["multifieldqa_en"][1]
    at = first_difference("".join(line["chunks"]), line["context"])
    message = record.getMessage()
    assert record.levelno == logging.WARNING and "\n" not in message
    assert message.startswith(f"{QUERYSET / 'multifieldqa_en_n100.jsonl'}:2: ")
    assert "22 chunks" in message and f"at character {at}" in message


@pytest.mark.parametrize(
    "name, expected",
    [
        ("not json", "not a JSON line"),
        ("no chunks", "no 'chunks' field"),
        ("answers a string", "'answers' is a str"),
        ("chunks not strings", "'chunks' is not a non-empty list of strings"),
        ("n_chunks wrong", "declares n_chunks 21 but holds 22"),
        ("duplicate _id", "_id 'fe952dfd723c9b88f1ed4665679b7a13987729fa1c37b0e3' again"),
    ],
)
def test_a_malformed_real_line_is_still_refused_with_its_file_and_line(
    raw, tmp_path, caplog, monkeypatch, name, expected
):
    monkeypatch.setattr(kvsharearena, "_REPORTED", set())
    caplog.set_level(logging.WARNING, logger="hybridkv.eval")
    folder = tmp_path / "queryset"
    folder.mkdir()
    path = folder / "multifieldqa_en_n100.jsonl"
    first, second = (QUERYSET / path.name).read_text(encoding="utf-8").split("\n")[:2]
    broken = copy.deepcopy(raw["multifieldqa_en"][1])  # the line whose context differs from its chunks
    if name == "no chunks":
        del broken["chunks"]
    elif name == "answers a string":
        broken["answers"] = broken["answers"][0]
    elif name == "chunks not strings":
        broken["chunks"][3] = None
    elif name == "n_chunks wrong":
        broken["n_chunks"] = 21
    elif name == "duplicate _id":
        broken["_id"] = raw["multifieldqa_en"][0]["_id"]
    text = second[:-1] if name == "not json" else json.dumps(broken, ensure_ascii=False)
    path.write_text(f"{first}\n{text}\n", encoding="utf-8")
    with pytest.raises(HybridKVError, match=f"^{re.escape(str(path))}:2: .*{re.escape(expected)}") as err:
        kvsharearena.generate("re-multifieldqa_en", LENGTH, 1, ByteTokenizer(), data_path=str(folder))
    assert "\n" not in str(err.value)
    assert caplog.records == []  # a refused file reports nothing else


# ---------------------------------------------------------------------------------------------
# KVShareArena's `kva validate`, restated from its rules: schema "kva.result.v1"; summary keys
# method, track, subset, model, n, backend, versions, git_rev; results a list of summary.n rows;
# len(results) == 100 unless --allow_partial; no _id twice; with the queryset at hand (unless
# --no_queryset) the _id set equals that of the first 100 lines of <summary.subset>_n100.jsonl,
# for the ar track too; each row has _id, pred, f1_raw, the three cost fields, ttft_ms and golds;
# the cost fields, when not None, are numbers >= 0; method_card keys name, provenance, backend,
# versions, cost_notes, training_data; provenance official, port or reference.

SUMMARY_KEYS = ("method", "track", "subset", "model", "n", "backend", "versions", "git_rev")
ITEM_KEYS = ("_id", "pred", "f1_raw", "recomputed_layer_tokens", "dense_payload_layer_tokens", "kv_bytes", "ttft_ms",
             "golds")  # fmt: skip
CARD_KEYS = ("name", "provenance", "backend", "versions", "cost_notes", "training_data")
COSTS = ("recomputed_layer_tokens", "dense_payload_layer_tokens", "kv_bytes")


def kva_validate(doc: dict, frozen_ids: list[str] | None, expect_n: int | None) -> list[str]:
    found = []
    if doc.get("schema") != "kva.result.v1":
        found.append("schema")
    summary = doc.get("summary") or {}
    found += [f"summary.{k}" for k in SUMMARY_KEYS if k not in summary]
    rows = doc.get("results")
    if not isinstance(rows, list):
        found.append("results")
        rows = []
    if summary.get("n") != len(rows):
        found.append("summary.n")
    if expect_n is not None and len(rows) != expect_n:
        found.append("frozen N")
    ids = [row.get("_id") for row in rows]
    if len(set(ids)) != len(ids):
        found.append("duplicate _id")
    if frozen_ids is not None and set(ids) != set(frozen_ids):
        found.append("_id set")
    for index, row in enumerate(rows):
        found += [f"results[{index}].{k}" for k in ITEM_KEYS if k not in row]
        for key in COSTS:
            value = row.get(key)
            if value is not None and (not isinstance(value, int | float) or value < 0):
                found.append(f"results[{index}].{key}")
    card = doc.get("method_card") or {}
    found += [f"method_card.{k}" for k in CARD_KEYS if k not in card]
    if card.get("provenance") not in ("official", "port", "reference"):
        found.append("provenance")
    return found


def frozen_ids(subset: str) -> list[str]:
    """What `kva validate --data_dir SAMPLE` compares against: its load_queryset's first 100 lines."""
    return [record["_id"] for record in lines(f"{subset}_n100.jsonl")[:100]]


def arena(argv: list[str]) -> None:
    from hybridkv.cli import main

    assert main(["arena", *argv]) == 0


@pytest.fixture(scope="module")
def exported(raw, tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """Every line of the four files run (no-context: the model reads the question only, so the
    run stays cheap while every row, sample and export is real) and exported; the run folder and
    the exported documents by task."""
    out = tmp_path_factory.mktemp("kva-sample") / "run"
    arena(["run", "--workload", "kvsharearena", "--data", str(SAMPLE), "--tasks", ",".join(TASKS), "--lengths",
           str(LENGTH), "--samples", "100", "--methods", "no-context", "--model", MODEL, "--max-new-tokens", "2",
           "--out", str(out), "--no-progress"])  # fmt: skip
    arena(["export", "--format", "kva", str(out)])
    docs = {
        task: json.loads((out / "kva" / f"no-context_{task.replace('-', '_', 1)}.json").read_text()) for task in TASKS
    }
    return out, docs


def test_the_export_of_every_real_line_passes_kvsharearenas_validate(raw, exported):
    out, docs = exported
    rows = {row["id"]: row for row in read_rows(out / "results.jsonl")}
    for task, doc in docs.items():
        track, subset = task.split("-", 1)
        records = raw["notes"] if track == "ar" else raw[subset]
        # `kva validate --allow_partial --data_dir SAMPLE`: every line of the file is in the export
        assert kva_validate(doc, frozen_ids(subset), expect_n=None) == []
        assert kva_validate(doc, frozen_ids(subset), expect_n=100) == ["frozen N"]  # the release holds 100
        assert problems(doc) == []
        summary = doc["summary"]
        assert (summary["track"], summary["subset"], summary["n"]) == (track, subset, len(records))
        assert (
            summary["queryset"]["sha256"]
            == hashlib.sha256((QUERYSET / f"{subset}_n100.jsonl").read_bytes()).hexdigest()
        )
        assert summary["queryset"]["manifest_checked"] is False
        golds = {r["_id"]: r["answers"] for r in raw[subset]}
        head = head_of(subset)
        for item, record in zip(doc["results"], records, strict=True):
            cached = record["chunks"] if track == "re" else [n["note_text"] + "\n\n" for n in record["notes"]]
            assert item["_id"] == record["_id"] and item["golds"] == golds[record["_id"]]
            assert item["n_chunks"] == len(cached) == record.get("n_chunks", record.get("n_notes"))
            row = rows[item["aux"]["hybridkv_id"]]
            # the arena tokenised the head and each declared chunk (one byte, one token)
            assert row["chunks"] == 1 + len(cached)
            assert row["context_tokens"] == sum(len(c.encode("utf-8")) for c in [head, *cached])
            assert kvsharearena.f1_raw(item["pred"], item["golds"]) == item["f1_raw"]
    # multifieldqa_en line 2: its 22 chunks, not its context, were the prompt
    line2 = docs["re-multifieldqa_en"]["results"][1]["aux"]
    context = raw["multifieldqa_en"][1]["context"]
    assert line2["chunks"] == 23 and line2["context_tokens"] != len((head_of("multifieldqa_en") + context).encode())


@pytest.mark.parametrize(
    "mutation",
    ["schema", "summary key", "n", "results not a list", "duplicate _id", "item key", "golds", "negative cost",
     "card key", "provenance"],
)  # fmt: skip
def test_hybridkvs_check_refuses_what_kvsharearenas_validate_refuses(exported, mutation):
    doc = copy.deepcopy(exported[1]["re-qasper"])
    rows = doc["results"]
    if mutation == "schema":
        doc["schema"] = "kva.result.v0"
    elif mutation == "summary key":
        del doc["summary"]["git_rev"]
    elif mutation == "n":
        doc["summary"]["n"] = 3
    elif mutation == "results not a list":
        doc["results"] = {"0": rows[0]}
    elif mutation == "duplicate _id":
        rows[1]["_id"] = rows[0]["_id"]
    elif mutation == "item key":
        del rows[1]["ttft_ms"]
    elif mutation == "golds":
        del rows[0]["golds"]
    elif mutation == "negative cost":
        rows[0]["kv_bytes"] = -1
    elif mutation == "card key":
        del doc["method_card"]["cost_notes"]
    elif mutation == "provenance":
        doc["method_card"]["provenance"] = "ours"
    assert kva_validate(doc, None, None) != [] and problems(doc) != []


def test_samples_1_on_multifieldqa_en_runs_and_its_export_is_a_partial_result(raw, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(kvsharearena, "_REPORTED", set())
    caplog.set_level(logging.WARNING, logger="hybridkv.eval")
    out = tmp_path / "run"
    arena(["run", "--workload", "kvsharearena", "--data", str(SAMPLE), "--tasks", "re-multifieldqa_en", "--lengths",
           str(LENGTH), "--samples", "1", "--methods", "no-context", "--model", MODEL, "--max-new-tokens", "2",
           "--out", str(out), "--no-progress"])  # fmt: skip
    # line 2 was read (and reported), not refused, though only line 1 is run
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [f"{QUERYSET / 'multifieldqa_en_n100.jsonl'}:2"]
    first = raw["multifieldqa_en"][0]
    (sample,) = load_frozen(out / "samples.jsonl")
    assert sample.meta["_id"] == first["_id"] and sample.golds == first["answers"]
    assert sample.chunks == [head_of("multifieldqa_en"), *first["chunks"]]
    (row,) = read_rows(out / "results.jsonl")
    assert row["id"] == sample.id and row["golds"] == first["answers"] and row["chunks"] == 1 + 7
    arena(["export", "--format", "kva", str(out), "--to", str(tmp_path / "kva")])
    doc = json.loads((tmp_path / "kva" / "no-context_re_multifieldqa_en.json").read_text())
    assert [item["_id"] for item in doc["results"]] == [first["_id"]]
    # `kva validate --allow_partial --no_queryset` takes it; with the queryset at hand, KVShareArena
    # compares the _id set with all its first 100 lines, and a partial run holds fewer
    assert kva_validate(doc, None, expect_n=None) == [] and problems(doc) == []
    assert kva_validate(doc, frozen_ids("multifieldqa_en"), expect_n=None) == ["_id set"]
