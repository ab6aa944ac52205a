"""`prefix`: one long shared document, then diverging questions — the prefix-reuse case.

Each document is a seeded pseudo-essay (RULER's essay haystack) holding K key → number facts at
evenly spread depths; every fact becomes one sample whose `context` is the whole document and
whose `question` asks for that fact. Samples of one document share the context exactly, so the
document is cached once and each question hits it at its full length — the system-prompt /
long-document pattern at 8K, 16K or 32K tokens.
"""

from __future__ import annotations

import random

from hybridkv.eval.scoring import string_match_all
from hybridkv.eval.workloads.base import Sample, Workload, largest_fitting
from hybridkv.eval.workloads.essay import essay_words
from hybridkv.eval.workloads.words import ADJECTIVES, NOUNS

TASKS = ("prefix",)
FACTS_PER_DOCUMENT = 8
TOKENS_TO_GENERATE = {"prefix": 16}
_FACT = "One of the special magic numbers for {key} is: {value}."
_QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)


def _document(words: list[str], facts: list[tuple[str, str]]) -> str:
    step = len(words) // (len(facts) + 1)
    pieces, start = [], 0
    for index, (key, value) in enumerate(facts, start=1):
        pieces += [" ".join(words[start : index * step]), _FACT.format(key=key, value=value)]
        start = index * step
    pieces.append(" ".join(words[start:]))
    return "Read the document below; questions about it follow.\n\n" + " ".join(p for p in pieces if p)


def _fitted_document(facts: list[tuple[str, str]], budget: int, tokenizer) -> str:
    """The document with the most essay words that still fits `budget` tokens (words are ≥ 1 token)."""
    words = largest_fitting(lambda w: len(tokenizer.encode(_document(essay_words(w), facts))) <= budget, budget)
    return _document(essay_words(words), facts)


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """`n` questions on ceil(n / 8) documents, each prompt (document + question + answer) ≤ `length` tokens."""
    if task != "prefix":
        raise ValueError(f"unknown prefix task {task!r}")
    samples: list[Sample] = []
    for doc in range(-(-n // FACTS_PER_DOCUMENT)):
        rng = random.Random(f"hybridkv-prefix-{seed}-{length}-{doc}")
        keys = rng.sample([f"{a}-{b}" for a in ADJECTIVES[:60] for b in NOUNS[:60]], FACTS_PER_DOCUMENT)
        facts = [(key, str(rng.randrange(1_000_000, 10_000_000))) for key in keys]
        longest_question = max(len(tokenizer.encode(_QUESTION.format(key=key))) for key in keys)
        budget = length - TOKENS_TO_GENERATE["prefix"] - longest_question
        context = _fitted_document(facts, budget, tokenizer)
        context_tokens = len(tokenizer.encode(context))
        if context_tokens > budget:
            raise ValueError(f"prefix: {length} tokens cannot hold {FACTS_PER_DOCUMENT} facts and a question")
        for index, (key, value) in enumerate(facts):
            if len(samples) == n:
                break
            samples.append(
                Sample(
                    id=f"prefix-{length}-{doc}-{index}",
                    task="prefix",
                    length=length,
                    context=context,
                    question=_QUESTION.format(key=key),
                    golds=[value],
                    meta={
                        "document": doc,
                        "fact": index,
                        "context_tokens": context_tokens,
                        "tokens_to_generate": TOKENS_TO_GENERATE["prefix"],
                    },  # fmt: skip
                )
            )
    return samples


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    return string_match_all(prediction, golds)


WORKLOAD = Workload(name="prefix", tasks=TASKS, default_tasks=TASKS, generate=generate, score=score)
