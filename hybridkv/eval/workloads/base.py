"""What a workload is: the `Sample`s it makes and the `Workload` record the registry holds, with
the helpers the generated workloads share."""

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


@dataclass(frozen=True)
class Workload:
    """A workload the arena runs: its tasks, how to make their samples, how to score an answer.

    name           what `--workload` and a result row's `workload` field call it.
    tasks          every task it has (`--tasks` picks among them).
    default_tasks  the tasks run when `--tasks` is not given: those it can make without downloaded
                   data, or all of them for a workload whose every task reads `--data` (each one
                   missing is reported and skipped).
    generate       (task, length, n, tokenizer, seed, data_path) -> n `Sample`s of `task` fitted to
                   `length` tokens (prompt plus tokens to generate), deterministic in its arguments;
                   `data_path` is `--data` (or None), and a task whose data is not there raises
                   `hybridkv.errors.MissingDataError`, which the arena reports, then runs the
                   other tasks.
    score          (task, prediction, golds, meta) -> the task's official score of one answer (1.0
                   for a full match); `meta` is the result row's `score_meta` (or None).
    """

    name: str
    tasks: tuple[str, ...]
    default_tasks: tuple[str, ...]
    generate: Callable[..., list[Sample]]
    score: Callable[[str, str, list[str], dict | None], float]


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


__all__ = ["Sample", "Workload", "largest_fitting", "place_sentence"]
