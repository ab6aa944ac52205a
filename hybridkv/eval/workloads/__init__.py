"""Task workloads for the arena, each generated (or read) as a list of `Sample`s.

Each workload module declares one `Workload` (`base.py`: its tasks, the default ones, `generate`
and `score`) and `WORKLOADS` below registers it by name; adding a workload is one module and
one entry there.

- `ruler`: the 13 RULER tasks, generated here for any tokenizer and target length.
- `longbench`: LongBench v1's 21 datasets read from a local copy, with the official templates.
- `prefix`: long shared documents with several diverging questions each (prefix reuse).
- `multi-turn`: conversations whose every turn extends the last; each turn hits the previous prompt.
- `rag`: retrieved passages, each encoded on its own, concatenated into a new prompt.
- `agent-reports`: sub-agents' reports, each encoded when it was written, gathered for a question
  that needs two of them.
- `updates`: records set and set again later, the current (latest) one asked: the order a NoPE
  attention layer can only learn from the linear layers' states.
- `kvsharearena`: KVShareArena's frozen querysets (LongBench subsets cut into their declared chunks,
  and agents' question-blind reports) read from a local copy, scored by its F1; `hybridkv arena
  export --format kva` writes the answers back as its result files (`hybridkv.eval.kva`).
- `words`, `essay`: the built-in word lists (package data in `data/`) and the fixed pseudo-essay
  written from them, which the generated workloads draw keys and haystacks from.
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

from hybridkv.errors import HybridKVError
from hybridkv.eval.workloads import agent_reports, kvsharearena, longbench, multi_turn, prefix, rag, ruler, updates
from hybridkv.eval.workloads.base import Sample, Workload, largest_fitting, place_sentence

WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        ruler.WORKLOAD,
        longbench.WORKLOAD,
        prefix.WORKLOAD,
        multi_turn.WORKLOAD,
        rag.WORKLOAD,
        agent_reports.WORKLOAD,
        kvsharearena.WORKLOAD,
        updates.WORKLOAD,
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise HybridKVError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def score_row(row: dict) -> float:
    """Score a stored prediction with its workload's official metric."""
    return get_workload(row["workload"]).score(row["task"], row["prediction"], row["golds"], row.get("score_meta"))


__all__ = ["WORKLOADS", "Sample", "Workload", "get_workload", "largest_fitting", "place_sentence", "score_row"]
