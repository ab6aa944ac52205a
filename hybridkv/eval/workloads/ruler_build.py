"""Assembling RULER prompts: what a task's generator is given and returns, the noise haystack,
needles put between haystack units, and the fit that grows a haystack to a token budget.

A generator (`ruler_tasks`, `ruler_qa`) turns a `Job` into a `Plan`: `build(k)` drafts the
sample with a haystack of size k (lines, sentences, words or documents), and `fit` finds the
largest k whose prompt fits the budget.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.errors import HybridKVError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NOISE_SENTENCES = tuple(s + "." for s in NOISE.rstrip(".").split(". "))


@dataclass
class Draft:
    """One sample's prompt, split at the query, with its answers and metadata."""

    context: str
    question: str
    golds: list[str]
    meta: dict


@dataclass
class Job:
    """What a generator gets for one sample."""

    task: str
    cfg: dict  # the task's row of ruler.CONFIG
    seed: str  # the sample's own seed, f"ruler|{task}|{seed}|{index}"
    rng: random.Random  # seeded by it
    tokenizer: object
    length: int  # the target length: prompt plus tokens to generate
    budget: int  # prompt tokens allowed: the length less the tokens to generate
    tokens_to_generate: int
    state: dict  # carried from sample to sample of one call: fit guesses, cwe's setting
    index: int = 0
    data: object = None  # qa's documents and questions


@dataclass
class Plan:
    """How to draft a sample at any haystack size k >= `smallest`; `valid(k)`, when given, must
    also hold for the size used (the fit steps down until it does)."""

    build: Callable[[int], Draft]
    smallest: int
    valid: Callable[[int], bool] | None = None


def noise_lines(num_sentences: int) -> list[str]:
    """RULER's noise haystack, one copy per line, the last copy cut after num_sentences."""
    full, rest = divmod(num_sentences, len(_NOISE_SENTENCES))
    lines = [NOISE] * full
    if rest:
        lines.append(" ".join(_NOISE_SENTENCES[:rest]))
    return lines


def insert(units: list[str], inserts: list[tuple[int, str]]) -> tuple[list[str], list[int]]:
    """Put each (position, text) before units[position] (position == len(units): at the end),
    inserts at one position keeping their order. Returns the items and each insert's index."""
    order = sorted(range(len(inserts)), key=lambda i: inserts[i][0])
    items: list[str] = []
    where = [0] * len(inserts)
    j = 0
    for u, unit in enumerate(units + [None]):
        while j < len(order) and inserts[order[j]][0] <= u:
            where[order[j]] = len(items)
            items.append(inserts[order[j]][1])
            j += 1
        if unit is not None:
            items.append(unit)
    return items, where


def join(items: list[str], sep: str, start: int) -> tuple[str, list[int]]:
    """items joined by sep, and each item's offset (plus start)."""
    offsets, pos = [], start
    for item in items:
        offsets.append(pos)
        pos += len(item) + len(sep)
    return sep.join(items), offsets


def draw_distinct(draw: Callable[[], str], taken: set[str]) -> str:
    """The first value `draw` gives that is not in `taken` (added to it)."""
    while True:
        value = draw()
        if value not in taken:
            taken.add(value)
            return value


def fit(
    task: str,
    build: Callable[[int], Draft],
    tokenizer,
    budget: int,
    tokens_to_generate: int,
    lo: int,
    guess: int | None,
) -> tuple[Draft, int, int]:
    """The draft of the largest size k >= lo whose prompt fits `budget` tokens (token count is
    taken to grow with k), its token count and k. Gallops from `guess`, then bisects."""
    memo: dict[int, tuple[Draft, int]] = {}

    def tokens(k: int) -> int:
        if k not in memo:
            draft = build(k)
            memo[k] = (draft, len(tokenizer.encode(draft.context + draft.question)))
        return memo[k][1]

    if tokens(lo) > budget:
        raise HybridKVError(
            f"{task}: {budget + tokens_to_generate} tokens is too short for this tokenizer; the smallest prompt "
            f"takes {tokens(lo)} tokens plus {tokens_to_generate} to generate"
        )
    if guess is None:
        probe = 64
        per_unit = max((tokens(lo + probe) - tokens(lo)) / probe, 1e-3)
        guess = lo + int((budget - tokens(lo)) / per_unit)
    good, bad = _bracket(tokens, budget, lo, max(lo, guess))
    while bad - good > 1:
        mid = (good + bad) // 2
        if tokens(mid) <= budget:
            good = mid
        else:
            bad = mid
    return memo[good][0], memo[good][1], good


def _bracket(tokens: Callable[[int], int], budget: int, lo: int, k: int) -> tuple[int, int]:
    """Sizes good < bad with tokens(good) <= budget and tokens(bad) > budget (tokens(lo) fits),
    galloping from k in steps that double."""
    step = max(1, k // 200)
    good = lo
    if tokens(k) <= budget:
        good = k
        while tokens(good + step) <= budget:
            good += step
            step *= 2
        return good, good + step
    bad = k
    while bad - step > lo:
        if tokens(bad - step) <= budget:
            good = bad - step
            break
        bad -= step
        step *= 2
    return good, bad


__all__ = ["NOISE", "Draft", "Job", "Plan", "draw_distinct", "fit", "insert", "join", "noise_lines"]
