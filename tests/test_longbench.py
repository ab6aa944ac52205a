"""LongBench v1 workload (hybridkv.eval.workloads.longbench): official templates and limits, the
question-blind context/question split, pred.py's middle truncation with the question kept whole,
the local data layouts, and scoring with the sample's class list.

Fixtures are small handmade JSONL records in tmp_path; nothing is downloaded, no model is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import types
import zipfile

import pytest

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.scoring import DATASET_METRIC
from hybridkv.eval.workloads import longbench as lb
from hybridkv.eval.workloads.frozen import freeze, load_frozen
from hybridkv.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()

# sha256 of json.dumps(obj, ensure_ascii=False, sort_keys=True) for THUDM/LongBench's
# LongBench/config/dataset2prompt.json and dataset2maxlen.json, computed from the official files.
PROMPTS_SHA256 = "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"
MAXLEN_SHA256 = "39a79d9491ead3dc8bcea6dbd8b963b29248eb4c344dde1e176b0a58b4e758a9"

# Datasets whose official template has no {input}: the question is the fixed instruction tail.
NO_INPUT = {"gov_report", "multi_news", "vcsum", "passage_count", "lcc"}


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def _record(dataset, i, context, input_, answers, all_classes=None, language="en"):
    return {
        "input": input_,
        "context": context,
        "answers": answers,
        "length": len((context + " " + input_).split()),
        "dataset": dataset,
        "language": language,
        "all_classes": all_classes,
        "_id": f"{dataset}-id-{i:03d}",
    }


TREC_CLASSES = ["Abbreviation", "Location", "Person", "Description"]

FIXTURES = {
    "hotpotqa": [
        _record(
            "hotpotqa",
            i,
            f"Passage 1:\nAlpha town {i} lies on the river.\nPassage 2:\nBeta was born in Alpha town {i}.",
            f"Where was Beta born ({i})?",
            [f"Alpha town {i}"],
        )
        for i in range(3)
    ],
    "trec": [
        _record(
            "trec",
            i,
            "Question: What is the capital of France?\nType: Location\nQuestion: Who wrote Hamlet?\nType: Person",
            f"Question: What does NASA {i} stand for?\nType:",
            ["Abbreviation"],
            all_classes=TREC_CLASSES,
        )
        for i in range(2)
    ],
    "passage_count": [
        _record("passage_count", i, f"Paragraph 1: one.\n\nParagraph 2: two {i}.\n\nParagraph 3: one.", "", [str(2)])
        for i in range(2)
    ],
    "lcc": [
        _record("lcc", i, f"def add(a, b):\n    return a + b\n\n\nx = add({i}, 2)\n", "", [f"y = add(x, {i})"])
        for i in range(2)
    ],
    "multifieldqa_zh": [
        _record(
            "multifieldqa_zh",
            i,
            f"北京是中国的首都。长城很长。第{i}段。",
            f"中国的首都是哪里？{i}",
            ["北京"],
            language="zh",
        )
        for i in range(2)
    ],
}


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def data_dir(tmp_path):
    for dataset, records in FIXTURES.items():
        _write_jsonl(tmp_path / f"{dataset}.jsonl", records)
    return tmp_path


# ---------------------------------------------------------------------------------------------
# Tables


def test_tables_are_the_official_ones():
    assert len(lb.DATASETS) == 21 and len(set(lb.DATASETS)) == 21
    assert tuple(lb.PROMPTS) == lb.DATASETS and set(lb.MAX_NEW_TOKENS) == set(lb.DATASETS)
    assert set(lb.DATASETS) == set(DATASET_METRIC)
    assert _sha(lb.PROMPTS) == PROMPTS_SHA256
    assert _sha(lb.MAX_NEW_TOKENS) == MAXLEN_SHA256
    assert (lb.MAX_NEW_TOKENS["hotpotqa"], lb.MAX_NEW_TOKENS["gov_report"], lb.MAX_NEW_TOKENS["trec"]) == (32, 512, 64)
    assert lb.TOKENS_TO_GENERATE is lb.MAX_NEW_TOKENS
    assert lb.METRICS["trec"] == "classification_score" and lb.METRICS["lcc"] == "code_sim_score"
    assert lb.METRICS["multifieldqa_zh"] == "qa_f1_zh_score" and lb.METRICS["passage_count"] == "count_score"
    assert len(lb.E_DATASETS) == 13 and all(d[:-2] in lb.DATASETS for d in lb.E_DATASETS)


@pytest.mark.parametrize("dataset", lb.DATASETS)
def test_every_template_puts_the_input_after_the_context(dataset):
    template = lb.PROMPTS[dataset]
    assert template.count("{context}") == 1
    head, tail = template.split("{context}")
    assert "{input}" not in head
    assert tail.count("{input}") == (0 if dataset in NO_INPUT else 1)


# ---------------------------------------------------------------------------------------------
# Rendering and the question-blind split


@pytest.mark.parametrize("dataset", sorted(FIXTURES))
def test_samples_render_the_official_prompt(data_dir, dataset):
    samples = lb.load(dataset, data_dir)
    records = FIXTURES[dataset]
    assert len(samples) == len(records)
    for i, (sample, record) in enumerate(zip(samples, records, strict=True)):
        assert sample.context + sample.question == lb.PROMPTS[dataset].format(**record)
        assert sample.context.endswith(record["context"])
        if record["input"]:
            assert record["input"] not in sample.context
            assert record["input"] in sample.question
        assert sample.id == f"longbench-{dataset}-{i}" and sample.task == dataset
        assert sample.golds == record["answers"]
        assert sample.length == record["length"]  # no tokenizer: LongBench's own length
        meta = sample.meta
        assert meta["_id"] == record["_id"] and meta["language"] == record["language"]
        assert meta["length"] == record["length"] and meta["all_classes"] == record["all_classes"]
        assert meta["tokens_to_generate"] == lb.MAX_NEW_TOKENS[dataset]
        assert meta["metric"] == DATASET_METRIC[dataset].__name__


def test_exact_text_of_one_sample(data_dir):
    sample = lb.load("hotpotqa", data_dir, n=1)[0]
    instruction = (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    )
    assert sample.context == (
        f"{instruction}\n\nThe following are given passages.\n"
        "Passage 1:\nAlpha town 0 lies on the river.\nPassage 2:\nBeta was born in Alpha town 0."
    )
    assert sample.question == f"\n\n{instruction}\n\nQuestion: Where was Beta born (0)?\nAnswer:"
    lcc = lb.load("lcc", data_dir, n=1)[0]
    assert lcc.context == "Please complete the code given below. \n" + FIXTURES["lcc"][0]["context"]
    assert lcc.question == "Next line of code:\n"


@pytest.mark.parametrize("dataset", lb.DATASETS)
def test_context_is_question_blind_for_every_dataset(tmp_path, dataset):
    record = _record(dataset, 0, "DOC-START the document DOC-END", "QUERY-MARK what is asked", ["x"], ["x"])
    _write_jsonl(tmp_path / f"{dataset}.jsonl", [record])
    (sample,) = lb.load(dataset, tmp_path, tokenizer=TOK)
    assert sample.context + sample.question == lb.PROMPTS[dataset].format(**record)
    assert sample.context.endswith("DOC-END") and "QUERY-MARK" not in sample.context
    assert ("QUERY-MARK" in sample.question) == (dataset not in NO_INPUT)
    # The context depends on the document only: another question leaves it byte for byte.
    assert lb.split_prompt(dataset, {**record, "input": "another"})[0] == sample.context
    assert sample.length == sample.meta["prompt_tokens"] == len(TOK.encode(sample.context + sample.question))
    assert sample.meta["context_tokens"] == len(TOK.encode(sample.context)) and sample.meta["truncation"] is None


# ---------------------------------------------------------------------------------------------
# n, ids, scoring, freezing


def test_n_limits_and_ids_are_stable(data_dir):
    assert [s.id for s in lb.load("hotpotqa", data_dir, n=2)] == ["longbench-hotpotqa-0", "longbench-hotpotqa-1"]
    assert lb.load("hotpotqa", data_dir, n=2) == lb.load("hotpotqa", data_dir, n=3)[:2]
    assert len(lb.load("hotpotqa", data_dir)) == 3
    assert len(lb.load("hotpotqa", data_dir, n=50)) == 3  # fewer records than asked: all of them
    assert lb.load("hotpotqa", data_dir, n=0) == []
    with pytest.raises(HybridKVError, match=">= 0"):
        lb.load("hotpotqa", data_dir, n=-1)
    ids = [s.id for d in FIXTURES for s in lb.load(d, data_dir)]
    assert len(ids) == len(set(ids)) == sum(len(r) for r in FIXTURES.values())


def test_score_uses_the_class_list_from_meta(data_dir):
    trec = lb.load("trec", data_dir, n=1)[0]
    assert trec.meta["all_classes"] == TREC_CLASSES
    assert lb.score("trec", " Abbreviation\nQuestion: next", trec.golds, trec.meta) == 1.0
    assert lb.score("trec", "Location", trec.golds, trec.meta) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        lb.score("trec", "Abbreviation", trec.golds)
    count = lb.load("passage_count", data_dir, n=1)[0]
    assert lb.score("passage_count", "There are 2 unique paragraphs.", count.golds, count.meta) == 1.0
    hotpot = lb.load("hotpotqa", data_dir, n=1)[0]
    assert lb.score("hotpotqa", "Alpha town 0", hotpot.golds, hotpot.meta) == 1.0


def test_samples_freeze_and_load_back(data_dir, tmp_path):
    samples = [s for d in FIXTURES for s in lb.load(d, data_dir, tokenizer=TOK, max_length=250)]
    freeze(samples, tmp_path / "frozen" / "samples.jsonl")
    assert load_frozen(tmp_path / "frozen" / "samples.jsonl") == samples


# ---------------------------------------------------------------------------------------------
# Truncation (ByteTokenizer: one token per UTF-8 byte)


def _long_record(dataset="hotpotqa", question="Which word is in the middle?", words=400):
    context = " ".join(f"w{i:04d}" for i in range(words))  # 5-byte words, each one unique
    return _record(dataset, 0, context, question, ["w0200"])


@pytest.mark.parametrize("max_length", [600, 601, 1000])
def test_truncation_is_pred_py_middle_cut_and_keeps_the_question(tmp_path, max_length):
    record = _long_record()
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [record])
    (sample,) = lb.load("hotpotqa", tmp_path, tokenizer=TOK, max_length=max_length)
    prompt = lb.PROMPTS["hotpotqa"].format(**record)  # ASCII: bytes are characters
    assert len(prompt) > max_length
    half = max_length // 2
    assert sample.context + sample.question == prompt[:half] + prompt[-half:]  # pred.py's prompt
    _, question = lb.split_prompt("hotpotqa", record)
    assert sample.question == question
    assert sample.context.startswith("Answer the question based on the given passages.")
    assert sample.context.endswith("w0399") and "w0200" not in sample.context  # the middle went
    assert len(TOK.encode(sample.context + sample.question)) == 2 * half <= max_length
    assert sample.length == max_length
    meta = sample.meta
    assert meta["truncation"] == "pred.py" and meta["prompt_tokens"] == 2 * half
    assert meta["full_prompt_tokens"] == len(prompt) and meta["max_length"] == max_length


def test_no_truncation_when_the_prompt_fits(tmp_path):
    record = _long_record(words=20)
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [record])
    (sample,) = lb.load("hotpotqa", tmp_path, tokenizer=TOK, max_length=4096)
    assert sample.context + sample.question == lb.PROMPTS["hotpotqa"].format(**record)
    assert sample.meta["truncation"] is None and sample.length == 4096
    assert sample.meta["prompt_tokens"] == sample.meta["full_prompt_tokens"] < 4096


def test_a_question_longer_than_half_cuts_only_the_context(tmp_path):
    question = "Question: " + " ".join(f"q{i:03d}" for i in range(80)) + "\nType:"  # ~416 bytes
    record = _long_record("trec", question=question)
    _write_jsonl(tmp_path / "trec.jsonl", [record])
    max_length = 600
    (sample,) = lb.load("trec", tmp_path, tokenizer=TOK, max_length=max_length)
    context, full_question = lb.split_prompt("trec", record)
    assert full_question.endswith(question) and len(full_question) > max_length // 2
    assert sample.question == full_question  # pred.py would have cut into it
    room = max_length - len(full_question)
    assert sample.context == context[:room]  # the prompt's start kept, as pred.py keeps it
    assert len(TOK.encode(sample.context + sample.question)) == max_length
    assert sample.meta["truncation"] == "context"
    with pytest.raises(HybridKVError, match="no room for the context"):
        lb.load("trec", tmp_path, tokenizer=TOK, max_length=len(full_question))


def test_truncation_of_chinese_text_keeps_the_question(tmp_path):
    context = "".join(f"第{i}句话在这里。" for i in range(200))
    record = _record("multifieldqa_zh", 0, context, "中国的首都是哪里？", ["北京"], language="zh")
    _write_jsonl(tmp_path / "multifieldqa_zh.jsonl", [record])
    max_length = 501
    (sample,) = lb.load("multifieldqa_zh", tmp_path, tokenizer=TOK, max_length=max_length)
    ids = TOK.encode(lb.PROMPTS["multifieldqa_zh"].format(**record))
    half = max_length // 2
    assert sample.context + sample.question == TOK.decode(ids[:half]) + TOK.decode(ids[-half:])
    assert sample.question == lb.split_prompt("multifieldqa_zh", record)[1]
    assert sample.context.startswith("阅读以下文字并用中文简短回答：") and sample.context.endswith("第199句话在这里。")
    # A cut inside a 3-byte character decodes to U+FFFD, as pred.py's decode does: at most a few
    # bytes over the budget.
    assert sample.meta["prompt_tokens"] <= max_length + 6


def test_generate_fits_prompt_and_answer_in_length(tmp_path):
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [_long_record()])
    (sample,) = lb.generate("hotpotqa", 512, 1, TOK, seed=3, data_path=str(tmp_path))
    assert sample.length == 512 and sample.meta["max_length"] == 512 - 32
    assert sample.meta["prompt_tokens"] + sample.meta["tokens_to_generate"] <= 512
    with pytest.raises(HybridKVError, match="no room"):
        lb.generate("gov_report", 512, 1, TOK, data_path=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Missing data and bad input


def test_missing_data_is_a_missing_data_error(tmp_path, data_dir):
    assert issubclass(MissingDataError, HybridKVError)
    with pytest.raises(MissingDataError, match="hotpotqa skipped: needs --data"):
        lb.load("hotpotqa", None)
    with pytest.raises(MissingDataError, match="does not exist"):
        lb.load("hotpotqa", tmp_path / "nowhere")
    with pytest.raises(MissingDataError, match=r"narrativeqa\.jsonl.*data\.zip"):
        lb.load("narrativeqa", data_dir)
    with pytest.raises(HybridKVError, match="unknown LongBench dataset"):
        lb.load("hotpot", data_dir)
    with pytest.raises(HybridKVError, match="needs a tokenizer"):
        lb.load("hotpotqa", data_dir, max_length=100)


def test_malformed_records_are_named(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text(json.dumps(FIXTURES["hotpotqa"][0]) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(HybridKVError, match=r"hotpotqa\.jsonl:2: not a JSON line"):
        lb.load("hotpotqa", tmp_path)
    _write_jsonl(path, [{**FIXTURES["hotpotqa"][0], "answers": "Alpha"}])
    with pytest.raises(HybridKVError, match="record 0: 'answers' is not a list"):
        lb.load("hotpotqa", tmp_path)
    _write_jsonl(path, [{k: v for k, v in FIXTURES["hotpotqa"][0].items() if k != "input"}])
    with pytest.raises(HybridKVError, match="no 'input' field"):
        lb.load("hotpotqa", tmp_path)


# ---------------------------------------------------------------------------------------------
# Layouts


def _zip(path, members):
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, records in members.items():
            zf.writestr(name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_layouts_data_folder_zip_file_and_hub_cache(tmp_path):
    records = FIXTURES["hotpotqa"]
    expected = [s.context + s.question for s in lb.load("hotpotqa", _write_jsonl(tmp_path / "f.jsonl", records))]
    assert len(expected) == 3

    def prompts(path):
        return [s.context + s.question for s in lb.load("hotpotqa", path)]

    _write_jsonl(tmp_path / "unzipped" / "data" / "hotpotqa.jsonl", records)
    assert prompts(tmp_path / "unzipped") == expected
    official = {"data/hotpotqa.jsonl": records, "data/hotpotqa_e.jsonl": records[:1], "__MACOSX/data/._x": []}
    _zip(tmp_path / "zipped" / "data.zip", official)
    assert prompts(tmp_path / "zipped") == expected
    assert prompts(tmp_path / "zipped" / "data.zip") == expected
    e_samples = lb.load("hotpotqa_e", tmp_path / "zipped")
    assert [s.id for s in e_samples] == ["longbench-hotpotqa_e-0"] and e_samples[0].task == "hotpotqa_e"
    assert e_samples[0].meta["tokens_to_generate"] == 32 and e_samples[0].context + e_samples[0].question == expected[0]

    hub = tmp_path / "hub"
    repo = hub / "datasets--THUDM--LongBench"
    _zip(repo / "snapshots" / "aaa" / "data.zip", {"data/hotpotqa.jsonl": records[:1]})  # an older snapshot
    _zip(repo / "snapshots" / "bbb" / "data.zip", official)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("bbb\n")
    assert prompts(hub) == expected and prompts(repo) == expected


def test_parquet_through_pyarrow(tmp_path, monkeypatch):
    files = tmp_path / "hotpotqa" / "test" / "0000.parquet"
    files.parent.mkdir(parents=True)
    files.write_bytes(b"PAR1")
    read = []

    def read_table(path):
        read.append(path)
        return types.SimpleNamespace(to_pylist=lambda: list(FIXTURES["hotpotqa"]))

    parquet = types.ModuleType("pyarrow.parquet")
    parquet.read_table = read_table
    pyarrow = types.ModuleType("pyarrow")
    pyarrow.parquet = parquet
    monkeypatch.setitem(sys.modules, "pyarrow", pyarrow)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    assert len(lb.load("hotpotqa", tmp_path)) == 3 and read == [str(files)]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # not installed
    with pytest.raises(MissingDataError, match="pyarrow"):
        lb.load("hotpotqa", tmp_path)


def test_save_to_disk_copy_through_datasets(tmp_path, monkeypatch):
    per_dataset = tmp_path / "saved" / "trec"
    per_dataset.mkdir(parents=True)
    (per_dataset / "dataset_dict.json").write_text('{"splits": ["test"]}')
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "state.json").write_text("{}")
    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda path: (
        {"test": list(FIXTURES["trec"])} if path.endswith("trec") else FIXTURES["trec"] + FIXTURES["hotpotqa"]
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert [s.id for s in lb.load("trec", tmp_path / "saved")] == ["longbench-trec-0", "longbench-trec-1"]
    hotpot = lb.load("hotpotqa", whole)  # one copy of several datasets: rows kept by their field
    assert [s.golds for s in hotpot] == [r["answers"] for r in FIXTURES["hotpotqa"]]
    with pytest.raises(MissingDataError, match="holds no lcc records"):
        lb.load("lcc", whole)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(MissingDataError, match="`datasets` package is not installed"):
        lb.load("trec", tmp_path / "saved")


def test_samples_are_plain_data(data_dir):
    sample = lb.load("trec", data_dir, n=1, tokenizer=TOK)[0]
    assert json.loads(json.dumps(dataclasses.asdict(sample))) == dataclasses.asdict(sample)
