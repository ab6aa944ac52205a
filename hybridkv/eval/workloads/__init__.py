"""Task workloads for the arena, each generated (or read) as a list of `Sample`s.

- `ruler`: the 13 RULER tasks, generated here for any tokenizer and target length.
- `longbench`: LongBench v1's 21 datasets read from a local copy, with the official templates.
- `prefix`: long shared documents with several diverging questions each (prefix reuse).
- `multi-turn`: conversations whose every turn extends the last; each turn hits the previous prompt.
- `frozen`: write samples to JSONL with a sha256 checksum and read them back verified, so a run
  is reproducible from the exact prompts it scored.

A `Sample` splits a prompt in two: `context` is the question-blind document a method may cache
ahead of time, `question` is what follows it (the query and the answer prefix). The full prompt
is always `context + question`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    id: str  # stable: f"{task}-{length}-{index}"
    task: str
    length: int  # target length in tokens (prompt + tokens to generate)
    context: str  # the document: the cacheable, question-blind part
    question: str  # what follows the context: the query, with the answer prefix
    golds: list[str]
    meta: dict = field(default_factory=dict)  # needle depths, offsets, token counts, ...


WORKLOADS = ("ruler", "longbench", "prefix", "multi-turn")


def workload_module(name: str):
    """The module of a workload: `generate(task, length, n, tokenizer, seed, data_path)`, `score(...)`,
    `TASKS`, and the tasks it can make without local data."""
    import importlib

    from hybridkv.errors import HybridKVError

    if name not in WORKLOADS:
        raise HybridKVError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return importlib.import_module(f"hybridkv.eval.workloads.{name.replace('-', '_')}")


def score_row(row: dict) -> float:
    """Score a stored prediction with its workload's official metric."""
    return workload_module(row["workload"]).score(row["task"], row["prediction"], row["golds"], row.get("score_meta"))


__all__ = ["WORKLOADS", "Sample", "score_row", "workload_module"]
