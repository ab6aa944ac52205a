"""`agent-reports`: sub-agents' reports gathered into one prompt, for a question that needs two.

An orchestrator splits a survey of K regions among K sub-agents. Each agent's report was written
— and its KV computed — in that agent's own context, so the orchestrator's prompt meets the reports
as separately encoded chunks: a fixed header, the reports in agent order, then a question asking
for the figures of two regions. The two answers sit in two different chunks, so a method must
carry information from both (multi-hop across chunks); every other report holds a figure of the
same kind for another region, a distractor.

Reports belong to one sample (unlike `rag`'s passages, which recur); each holds about
`REPORT_TOKENS` tokens: a heading, the agent's steps, its finding at a seeded depth in
pseudo-essay notes, and a status line. K grows with the length (5 at 4K with the byte tokenizer).
"""

from __future__ import annotations

import random

from hybridkv.errors import HybridKVError
from hybridkv.eval.scoring import string_match_all
from hybridkv.eval.workloads.base import Sample, Workload, largest_fitting, place_sentence
from hybridkv.eval.workloads.essay import essay_passage
from hybridkv.eval.workloads.words import ADJECTIVES, NOUNS

TASKS = ("agent-reports",)
# The answer names the second region again before its figure (about 75 byte tokens in all).
TOKENS_TO_GENERATE = {"agent-reports": 80}
REPORT_TOKENS = 768
HEADER = (
    "You are the orchestrator. Your sub-agents each surveyed one region and sent the reports below. "
    "Answer from the reports; give only the numbers.\n\n"
)
_REPORT = "Report from agent {agent} on {region}\nSteps: {steps}\nNotes: {notes}\nStatus: complete.\n\n"
_FINDING = "Finding: the surveyed population of {region} is {value}."
_STEPS = (
    "searched the {a} archive",
    "read the {a} registry",
    "interviewed the {a} office",
    "cross-checked the {a} census",
    "visited the {a} depot",
)
# The answer restates each region before its figure: the second figure is then a lookup of a
# region just written, as the first is, not a recall of a name a dozen tokens back ("The
# populations of A and B are 1 and" left our tiny models repeating the first figure).
_QUESTION = (
    "Question: What is the surveyed population of {first}, and the surveyed population of {second}?\n"
    "Answer: The surveyed population of {first} is"
)


def _report(agent: int, region: str, value: str, steps: str, words: list[str], depth: float) -> str:
    notes = place_sentence(words, _FINDING.format(region=region, value=value), depth)
    return _REPORT.format(agent=agent, region=region, steps=steps, notes=notes)


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """`n` orchestrator prompts of K reports each; chunks tokenised one by one, then the question,
    plus the answer fit `length` tokens."""
    if task != "agent-reports":
        raise HybridKVError(f"unknown agent-reports task {task!r}; one of {', '.join(TASKS)}")
    budget = length - TOKENS_TO_GENERATE[task]
    header_tokens = len(tokenizer.encode(HEADER))
    reports = (budget - header_tokens) // REPORT_TOKENS
    if reports < 3:  # two answers and at least one distractor
        raise HybridKVError(f"agent-reports: {length} tokens cannot hold three reports of ~{REPORT_TOKENS} tokens")
    return [_sample(index, length, seed, reports, budget - header_tokens, tokenizer) for index in range(n)]


def _sample(index: int, length: int, seed: int, reports: int, room: int, tokenizer) -> Sample:
    """Sample `index`: `reports` reports filled so that they and the question take `room` tokens at most."""
    rng = random.Random(f"hybridkv-agent-reports-{seed}-{length}-{index}")
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], reports)
    regions = [f"{a.capitalize()} {b.capitalize()}" for a, b in pairs]
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), reports)]
    steps = [
        ", ".join(step.format(a=rng.choice(NOUNS)) for step in rng.sample(_STEPS, 3)).capitalize() + "."
        for _ in range(reports)
    ]
    depths = [rng.random() for _ in range(reports)]
    offset = rng.randrange(0, 5_000)  # where this sample's notes start in the essay

    def build(words: int) -> list[str]:
        return [
            _report(k + 1, regions[k], values[k], steps[k], essay_passage(offset + k * words, words), depths[k])
            for k in range(reports)
        ]

    first, second = sorted(rng.sample(range(reports), 2))
    question = _QUESTION.format(first=regions[first], second=regions[second])
    room -= len(tokenizer.encode(question))
    words = largest_fitting(lambda w: sum(len(tokenizer.encode(r)) for r in build(w)) <= room, REPORT_TOKENS)
    if words == 0:
        raise HybridKVError(f"agent-reports: {length} tokens cannot hold {reports} reports and a question")
    chunks = [HEADER, *build(words)]
    return Sample(
        id=f"agent-reports-{length}-{index}",
        task="agent-reports",
        length=length,
        context="".join(chunks),
        question=question,
        golds=[values[first], values[second]],
        chunks=chunks,
        meta={
            "gold_chunks": [1 + first, 1 + second],
            "report_words": words,
            "context_tokens": sum(len(tokenizer.encode(c)) for c in chunks),
            "tokens_to_generate": TOKENS_TO_GENERATE["agent-reports"],
        },
    )


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    return string_match_all(prediction, golds)


WORKLOAD = Workload(name="agent-reports", tasks=TASKS, default_tasks=TASKS, generate=generate, score=score)
