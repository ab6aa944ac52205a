"""`multi-turn`: a conversation whose every turn extends the last one.

Each conversation is a seeded chat in which turn k states a new fact (a key → number), wrapped in
filler talk, and from the second turn on asks about a fact from an earlier turn. A sample is one
turn: its `context` is exactly the prompt of the previous turn — what an engine has cached when
the new turn arrives — and its `question` is what is new (the previous answer, the new user
message, the answer prefix). So every turn hits the previous turn's cache in full and recovers
from there; the matched prefix grows turn by turn up to `length` tokens.
"""

from __future__ import annotations

import random

from hybridkv.eval.scoring import string_match_all
from hybridkv.eval.workloads.base import Sample, Workload
from hybridkv.eval.workloads.essay import essay_words
from hybridkv.eval.workloads.words import ADJECTIVES, NOUNS

TASKS = ("multi-turn",)
TOKENS_TO_GENERATE = {"multi-turn": 16}
_SYSTEM = "System: You are a careful assistant. Remember every code the user gives you.\n"
_USER = "User: {talk} Please remember: the code for {key} is {value}.{ask}\n"
_ASK = " Also, what is the code for {key}?"
_ASSISTANT = "Assistant:"
_ANSWER = " The code for {key} is {value}.\n"


def _conversation(rng: random.Random, turns: int, words_per_turn: int) -> list[tuple[str, str, str | None]]:
    """(user message, assistant answer, gold) per turn; the first turn asks nothing."""
    keys = rng.sample([f"{a}-{b}" for a in ADJECTIVES[:50] for b in NOUNS[:50]], turns)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(turns)]
    offset = rng.randrange(0, 10_000)
    chat = []
    previous_ask = None
    for turn in range(turns):
        talk = " ".join(essay_words(offset + (turn + 1) * words_per_turn)[offset + turn * words_per_turn :])
        # Never the key the previous answer just repeated: the gold must come from the cached turns.
        choices = [k for k in range(turn) if k != previous_ask]
        asked = rng.choice(choices) if choices else None
        previous_ask = asked
        message = _USER.format(
            talk=talk.capitalize() + ".",
            key=keys[turn],
            value=values[turn],
            ask=_ASK.format(key=keys[asked]) if asked is not None else "",
        )
        answer = _ANSWER.format(key=keys[asked], value=values[asked]) if asked is not None else " Noted.\n"
        chat.append((message, answer, values[asked] if asked is not None else None))
    return chat


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """`n` turns (from the second on) of conversations whose last prompt stays within `length` tokens."""
    if task != "multi-turn":
        raise ValueError(f"unknown multi-turn task {task!r}")
    turns = 8
    budget = length - TOKENS_TO_GENERATE[task]
    samples: list[Sample] = []
    conversation = 0
    while len(samples) < n:
        rng = random.Random(f"hybridkv-multi-turn-{seed}-{length}-{conversation}")
        # words of filler per turn so that the whole conversation fills the budget (bytes ≈ 6 per word)
        words = max(4, budget // (turns * 7))
        while True:
            chat = _conversation(random.Random(rng.random()), turns, words)
            prompts, text = [], _SYSTEM
            for message, answer, _ in chat:
                text += message + _ASSISTANT
                prompts.append(text)
                text += answer
            if len(tokenizer.encode(prompts[-1])) <= budget or words == 4:
                break
            words = int(words * 0.9)
        if len(tokenizer.encode(prompts[-1])) > budget:
            raise ValueError(f"multi-turn: {length} tokens cannot hold {turns} turns")
        for turn in range(1, turns):
            if len(samples) == n:
                break
            previous = prompts[turn - 1]
            samples.append(
                Sample(
                    id=f"multi-turn-{length}-{conversation}-{turn}",
                    task="multi-turn",
                    length=length,
                    context=previous,
                    question=prompts[turn][len(previous) :],
                    golds=[chat[turn][2]],
                    meta={"conversation": conversation, "turn": turn, "tokens_to_generate": TOKENS_TO_GENERATE[task]},
                )
            )
        conversation += 1
    return samples


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    return string_match_all(prediction, golds)


WORKLOAD = Workload(name="multi-turn", tasks=TASKS, default_tasks=TASKS, generate=generate, score=score)
