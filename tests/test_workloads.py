"""The workload registry and the built-in text the generated workloads are written from: every
registered workload is a `Workload` under its own name, an unknown name is one clear line, the
word lists ship as package data and hold what the generators rely on, and the generated samples
are pinned byte for byte."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.eval.workloads import WORKLOADS, Workload, essay, get_workload, ruler, score_row, words
from hybridkv.models.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "hybridkv" / "eval" / "workloads" / "data"


def test_registry_names_each_workload_by_its_own_name():
    names = ["ruler", "longbench", "prefix", "multi-turn", "rag", "agent-reports", "kvsharearena", "updates"]
    assert list(WORKLOADS) == names
    for name, workload in WORKLOADS.items():
        assert isinstance(workload, Workload) and workload.name == name and get_workload(name) is workload
        assert workload.tasks and set(workload.default_tasks) <= set(workload.tasks)
        assert callable(workload.generate) and callable(workload.score)
    assert get_workload("ruler").default_tasks == ruler.LOCAL_TASKS and "qa_1" not in ruler.LOCAL_TASKS
    assert get_workload("longbench").default_tasks == get_workload("longbench").tasks


def test_unknown_workload_is_one_line_naming_the_known_ones():
    with pytest.raises(HybridKVError) as err:
        get_workload("rulers")
    message = str(err.value)
    assert "\n" not in message and "unknown workload 'rulers'" in message
    assert all(name in message for name in WORKLOADS)


def test_score_row_uses_the_rows_workload():
    row = {"workload": "ruler", "task": "niah_single_1", "prediction": "It is 1234567.", "golds": ["1234567"]}
    assert score_row(row) == 1.0 and score_row({**row, "prediction": "no idea"}) == 0.0
    with pytest.raises(HybridKVError, match="unknown workload"):
        score_row({**row, "workload": "nope"})


def test_word_lists_ship_as_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["hybridkv.eval.workloads"]
    files = sorted(DATA.iterdir())
    shipped = [path for path in files if any(fnmatch(path.relative_to(DATA.parent).as_posix(), p) for p in patterns)]
    assert files and shipped == files
    assert {path.stem for path in files} == {
        "adjectives", "nouns", "verbs", "adverbs", "prepositions",
        "determiners", "subjects", "modals", "subordinators", "starters",
    }  # fmt: skip


def test_word_lists_hold_what_the_generators_rely_on():
    for name in ("adjectives", "nouns", "verbs", "adverbs", "prepositions"):
        entries = words.wordlist(name)
        assert len(entries) > 25 and len(set(entries)) == len(entries), f"{name}: empty or repeated entries"
        assert all(re.fullmatch(r"[a-z]+", w) for w in entries), f"{name}: one lowercase word each"
    # Keys are adjective-noun pairs: plenty of distinct ones. cwe's long setting needs 50 words.
    assert len(words.ADJECTIVES) * len(words.NOUNS) > 50_000 and len(words.WORDS) > 500
    for entries in (essay.DETERMINERS, essay.SUBJECTS, essay.MODALS, essay.SUBORDINATORS, essay.STARTERS):
        assert entries and all(re.fullmatch(r"[A-Za-z ]+,?", w) for w in entries)
    assert essay.DETERMINERS.count("the") == 3, "repeated entries weight the draw"


# sha256 over every sample's fields (JSON, sorted keys), one line each, for the shipped byte
# tokenizer. An intended change to a generator, a word list or the essay changes it: then update it.
PINNED = "e8776c7372dbbcd7c24909e4f037bc7237524c21e781bcba427b52e090849d0e"


def _digest(samples) -> str:
    lines = [json.dumps(dataclasses.asdict(s), sort_keys=True) for s in samples]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_generated_samples_are_pinned():
    tok = ByteTokenizer()
    samples = [s for task in ruler.LOCAL_TASKS for s in ruler.generate(task, 2048, 2, tok, seed=11)]
    for name, length in (("prefix", 2048), ("multi-turn", 2048), ("rag", 4096), ("agent-reports", 4096)):
        workload = get_workload(name)
        samples += workload.generate(workload.tasks[0], length, 2, tok, 11)
    assert _digest(samples) == PINNED
