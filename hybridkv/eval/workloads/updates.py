"""`updates`: records set and set again later in a long text; the question asks for one record's
current value, the one set last.

Documents revise what they state (a changelog, a chat where a figure is corrected, a variable
reassigned), and the latest statement wins. A model whose attention layers carry no positional
encoding (GLM-5.3-Flash's MLA, Nemotron-H's attention) cannot tell a later statement from an earlier
one by attention alone: which setting came last is known through its linear layers' states. So this
is the workload where a recovered state is at stake even when the attention KV is exact, the case
between "answer read from attention" and "answer read from states" (docs/models.md).

The wording is the training task's (`hybridkv.train.data.updates`), in RULER's phrasing; the keys
are the arena's adjective-noun pairs, the values 7-digit numbers, the haystacks RULER's noise lines
and the built-in essay, all disjoint from the training stream's keys and text
(tests/test_train.py checks that no key, setting or answer of these samples occurs there).

Each sample holds 1-4 records; the asked one is set 2-4 times, the others 1-3 times, each setting at
an independent uniform depth. `meta["settings"]` lists every setting with its character offset;
`meta["answer_offset"]` is where the asked record's latest setting starts, from which the arena
records how far it lies before the context's end (the needle-in-tail split of tail-replay);
`meta["stale"]` are the asked record's earlier values, so an answer giving one of them is an answer
that lost the order, not the record.

`updates-chat` is the same records in a conversation, the shape a chat assistant's traffic has: the
haystack is cut into user turns, each answered by a one-line assistant turn, the settings sit inside
the user turns, and the question is the next user turn, asked after all of them. The setting and
question sentences are `updates`' own, so a model trained on `updates` reads them; what it has not
seen is the turn structure around them.
"""

from __future__ import annotations

import random

from hybridkv.eval.scoring import string_match_all
from hybridkv.eval.workloads.base import Sample, Workload
from hybridkv.eval.workloads.essay import essay_words, sentences
from hybridkv.eval.workloads.ruler_build import Draft, fit, insert, join, noise_lines
from hybridkv.eval.workloads.ruler_tasks import draw_value

TASKS = ("updates", "updates-chat")
TOKENS_TO_GENERATE = {"updates": 32, "updates-chat": 32}
HAYSTACKS = ("noise", "essay")
HEAD = (
    "Special magic numbers are set within the following text, and some are set again later; the latest setting "
    "counts. I will quiz you about the current numbers afterwards.\n"
)
SETTING = "The special magic number for {key} is set to {value}."
QUESTION = "\nWhat is the current special magic number for {key}? The current special magic number for {key} is"
CHAT_HEAD = (
    "A conversation between a user and an assistant. The user sets special magic numbers in some turns, and sets "
    "some again in later turns; the latest setting counts.\n\n"
)
CHAT_TURN = "User: {text}\nAssistant: {reply}"
CHAT_REPLIES = ("Noted.", "Understood.", "Got it.", "Thanks, noted.", "All right.")
CHAT_QUESTION = (
    "\n\nUser: What is the current special magic number for {key}?\nAssistant: The current special magic number "
    "for {key} is"
)
SENTENCES_PER_TURN = 4


def _records(rng: random.Random) -> tuple[list[tuple[str, str]], str]:
    """(key, value) settings in the order they are placed, and the asked key (records[0]'s)."""
    taken: set[str] = set()
    keys = [draw_value("words", rng, taken) for _ in range(rng.randint(1, 4))]
    settings = []
    for index, key in enumerate(keys):
        count = rng.randint(2, 4) if index == 0 else rng.randint(1, 3)
        settings += [(key, draw_value("numbers", rng, taken, keys)) for _ in range(count)]
    return settings, keys[0]


def _chat(items: list[str], rng: random.Random, start: int) -> tuple[str, list[int]]:
    """The items cut into user turns of SENTENCES_PER_TURN, each answered by an assistant reply drawn
    from CHAT_REPLIES (one draw per turn, from `rng`: the same seed gives the same replies), and
    each item's offset (plus start)."""
    turns, offsets, pos = [], [], start
    for first in range(0, len(items), SENTENCES_PER_TURN):
        pos += len("User: ")
        text, where = join(items[first : first + SENTENCES_PER_TURN], " ", pos)
        offsets += where
        turn = CHAT_TURN.format(text=text, reply=rng.choice(CHAT_REPLIES))
        turns.append(turn)
        pos += len(turn) - len("User: ") + 2  # the blank line between turns
    return "\n\n".join(turns), offsets


def _plan(rng: random.Random, task: str):
    settings, asked = _records(rng)
    fractions = sorted(rng.random() for _ in settings)  # one depth each; a record's settings keep their order
    haystack = rng.choice(HAYSTACKS)
    texts = [SETTING.format(key=key, value=value) for key, value in settings]
    chat = task == "updates-chat"
    replies_seed = rng.random()  # every size k draws the same replies
    head, question = (CHAT_HEAD, CHAT_QUESTION) if chat else (HEAD, QUESTION)

    def build(k: int) -> Draft:
        units = sentences(essay_words(k)) if haystack == "essay" else noise_lines(k)
        positions = [int(f * len(units)) for f in fractions]
        items, where = insert(units, list(zip(positions, texts, strict=True)))
        if chat:
            body, offsets = _chat(items, random.Random(replies_seed), len(head))
        else:
            body, offsets = join(items, " " if haystack == "essay" else "\n", len(head))
        placed = [
            {"key": key, "value": value, "text": text, "offset": offsets[where[i]], "depth": fractions[i]}
            for i, ((key, value), text) in enumerate(zip(settings, texts, strict=True))
        ]
        mine = [s for s in placed if s["key"] == asked]
        meta = {
            "haystack": haystack,
            "settings": placed,
            "query_keys": [asked],
            "stale": [s["value"] for s in mine[:-1]],
            "answer_offset": mine[-1]["offset"],
            "answer_depth": mine[-1]["depth"],
        }
        return Draft(head + body, question.format(key=asked), [mine[-1]["value"]], meta)

    return build


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """`n` samples, each prompt (context + question + answer budget) within `length` tokens. A sample's
    records, depths and haystack come from its own generator seeded by (seed, index), so the same seed
    gives the same records at every length; only the haystack grows."""
    if task not in TASKS:
        raise ValueError(f"unknown updates task {task!r}; known: {', '.join(TASKS)}")
    to_generate = TOKENS_TO_GENERATE[task]
    samples, guess = [], None
    for index in range(n):
        build = _plan(random.Random(f"hybridkv-updates|{task}|{seed}|{index}"), task)
        draft, prompt_tokens, k = fit(task, build, tokenizer, length - to_generate, to_generate, 1, guess)
        guess = k
        samples.append(
            Sample(
                id=f"{task}-{length}-{index}",
                task=task,
                length=length,
                context=draft.context,
                question=draft.question,
                golds=draft.golds,
                meta={
                    **draft.meta,
                    "seed": seed,
                    "index": index,
                    "size": k,
                    "prompt_tokens": prompt_tokens,
                    "context_tokens": len(tokenizer.encode(draft.context)),
                    "tokens_to_generate": to_generate,
                },
            )
        )
    return samples


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    """1.0 when the answer holds the latest setting (RULER's string_match_all on one gold) and none of
    the record's earlier ones: an answer listing every value it saw has not told which came last."""
    if any(value in prediction for value in (meta or {}).get("stale", ())):
        return 0.0
    return string_match_all(prediction, golds)


WORKLOAD = Workload(name="updates", tasks=TASKS, default_tasks=("updates",), generate=generate, score=score)
