"""Task workloads for the arena, each generated (or read) as a list of `Sample`s.

- `ruler`: the 13 RULER tasks, generated here for any tokenizer and target length.
- `longbench`: LongBench v1's 21 datasets read from a local copy, with the official templates.
- `prefix`: long shared documents with several diverging questions each (prefix reuse).
- `multi-turn`: conversations whose every turn extends the last; each turn hits the previous prompt.
- `rag`: retrieved passages, each encoded on its own, concatenated into a new prompt.
- `agent-reports`: sub-agents' reports, each encoded when it was written, gathered for a question
  that needs two of them.
- `kvsharearena`: KVShareArena's frozen querysets (LongBench subsets cut into their declared chunks,
  and agents' question-blind reports) read from a local copy, scored by its F1; `hybridkv arena
  export --format kva` writes the answers back as its result files (`hybridkv.eval.kva`).
- `frozen`: write samples to JSONL with a sha256 checksum and read them back verified, so a run
  is reproducible from the exact prompts it scored.

A `Sample` splits a prompt in two: `context` is the question-blind document a method may cache
ahead of time, `question` is what follows it (the query and the answer prefix). The full prompt
is always `context + question`.

The position-independent workloads (`rag`, `agent-reports`, `kvsharearena`) also set `chunks`: the
context cut into the pieces that were encoded separately (`"".join(chunks) == context`). The runner tokenises
each piece alone and hands a method one cache per piece, the way a serving engine meets them; a
prefix-reuse method can only use the first (the shared instructions) and recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Callable
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
    chunks: list[str] = field(default_factory=list)  # position-independent pieces of `context`, or none

    def segments(self) -> list[str]:
        """The separately cached pieces of the context: its chunks, or the whole context."""
        return self.chunks or [self.context]


WORKLOADS = ("ruler", "longbench", "prefix", "multi-turn", "rag", "agent-reports", "kvsharearena")


def largest_fitting(fits: Callable[[int], bool], high: int) -> int:
    """The largest size in [0, high] for which `fits` holds (0 if none), assuming it holds up to
    some size and fails beyond it: a binary search on a haystack's size."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def place_sentence(words: list[str], sentence: str, depth: float) -> str:
    """`words` joined as text with `sentence` put at the sentence boundary nearest `depth` (0–1)."""
    bounds = [0] + [i + 1 for i, word in enumerate(words) if word.endswith(".")]
    cut = min(bounds, key=lambda b: abs(b - depth * len(words)))
    return " ".join([*words[:cut], sentence, *words[cut:]])


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


__all__ = ["WORKLOADS", "Sample", "largest_fitting", "place_sentence", "score_row", "workload_module"]
