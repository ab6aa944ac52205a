"""RULER's qa tasks: qa_1 (SQuAD) and qa_2 (HotpotQA) read from a local file, each question's
documents hidden among the file's other documents."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.workloads.ruler_build import Draft, Job, Plan, join

DATASETS = {"qa_1": "SQuAD (v2 dev json)", "qa_2": "HotpotQA (dev distractor json)"}
# File names looked for when data_path is a folder: RULER's, then the official downloads'.
DATA_FILES = {
    "qa_1": ("squad.json", "dev-v2.0.json", "dev-v1.1.json"),
    "qa_2": ("hotpotqa.json", "hotpot_dev_distractor_v1.json"),
}

_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
_QA_PREAMBLE = f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n"
_QA_ANSWER_PREFIX = " Answer:"


@dataclass(frozen=True)
class QAData:
    docs: tuple[str, ...]
    qas: tuple[dict, ...]  # query, outputs, context (doc ids), more_context (doc ids)


def qa_data(task: str, dataset: str, data_path: str | None, n: int) -> QAData:
    """The documents and answerable questions of `task`'s file (read once per file version);
    MissingDataError without one, HybridKVError when it has fewer than n questions."""
    path = _resolve_data(task, data_path)
    stat = path.stat()
    data = _load_qa(str(path.resolve()), dataset, (stat.st_mtime_ns, stat.st_size))
    if n > len(data.qas):
        raise HybridKVError(f"{task}: {path} has {len(data.qas)} answerable questions, {n} samples asked for")
    return data


def _resolve_data(task: str, data_path: str | None) -> Path:
    need = f"{task} skipped: needs --data PATH with {DATASETS[task]}"
    if data_path is None:
        raise MissingDataError(need)
    path = Path(data_path)
    if path.is_dir():
        for name in DATA_FILES[task]:
            if (path / name).is_file():
                return path / name
        raise MissingDataError(f"{need}; {path} holds none of {', '.join(DATA_FILES[task])}")
    if not path.is_file():
        raise MissingDataError(f"{need}; {path} does not exist")
    return path


@functools.lru_cache(maxsize=4)
def _load_qa(path: str, dataset: str, _stamp: tuple) -> QAData:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HybridKVError(f"{path}: not readable as JSON ({err})") from err
    is_squad = isinstance(data, dict) and isinstance(data.get("data"), list)
    is_hotpot = isinstance(data, list) and all(isinstance(d, dict) and "context" in d for d in data[:5])
    task = "qa_1" if dataset == "squad" else "qa_2"
    if (dataset == "squad" and not is_squad) or (dataset == "hotpotqa" and not is_hotpot):
        raise MissingDataError(f"{task} skipped: needs --data PATH with {DATASETS[task]}; {path} is not one")
    try:
        if dataset == "squad":
            return _read_squad(data)
        return _read_hotpotqa(data)
    except (KeyError, TypeError, ValueError) as err:
        raise HybridKVError(f"{path}: malformed {DATASETS[task]} ({type(err).__name__}: {err})") from err


def _read_squad(data: dict) -> QAData:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = index[p["context"]]
            for qa in p["qas"]:
                if qa.get("is_impossible", False) or not qa["answers"]:
                    continue
                qas.append(
                    {
                        "query": qa["question"],
                        "outputs": [a["text"] for a in qa["answers"]],
                        "context": [own],
                        "more_context": [i for i in article if i != own],
                    }
                )
    return QAData(tuple(docs), tuple(qas))


def _read_hotpotqa(data: list) -> QAData:
    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({doc(t, p) for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[doc(t, p)] for t, p in d["context"]],
            "more_context": [],
        }
        for d in data
    ]
    return QAData(tuple(docs), tuple(qas))


def qa(job: Job) -> Plan:
    """Question `job.index` of `job.data`: its own documents first, then its article's (SQuAD),
    then the file's others in a seeded order, as many as fit, shuffled together."""
    data: QAData = job.data
    item = data.qas[job.index]
    own = list(dict.fromkeys(item["context"]))
    more = [i for i in item["more_context"] if i not in own]
    job.rng.shuffle(more)
    skip = set(own) | set(more)
    others = [i for i in range(len(data.docs)) if i not in skip]
    job.rng.shuffle(others)
    extra = more + others
    question = f"\n\n{_QA_INSTRUCTION}\n\nQuestion: {item['query']}{_QA_ANSWER_PREFIX}"

    def build(k: int) -> Draft:
        if k < len(data.docs):
            chosen = own + extra[: k - len(own)]
        else:  # more documents than the file has: repeat them all (RULER)
            chosen = (list(range(len(data.docs))) * (k // len(data.docs) + 1))[:k]
        random.Random(f"{job.seed}|shuffle").shuffle(chosen)
        items = [f"Document {i + 1}:\n{data.docs[d]}" for i, d in enumerate(chosen)]
        body, offsets = join(items, "\n\n", len(_QA_PREAMBLE))
        gold_positions = [i for i, d in enumerate(chosen) if d in own]
        meta = {
            "num_docs": k,
            "question_index": job.index,
            "gold_docs": gold_positions,
            "depths": [i / len(chosen) for i in gold_positions],
            "offsets": [offsets[i] for i in gold_positions],
            "haystack_offset": len(_QA_PREAMBLE),
            "answer_prefix": _QA_ANSWER_PREFIX,
        }
        return Draft(_QA_PREAMBLE + body, question, list(item["outputs"]), meta)

    return Plan(build, len(own))


__all__ = ["DATASETS", "DATA_FILES", "QAData", "qa", "qa_data"]
