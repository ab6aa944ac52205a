"""`rag`: retrieved passages, each encoded on its own, concatenated into a new prompt.

Each (length, seed) has a seeded corpus of passages. A passage is about one named place (an
adjective-noun title) and states its one fact, "The registration number of {title} is {value}.",
at a seeded depth in pseudo-essay text. A sample retrieves K passages — the one that answers its
question and K - 1 others from the same corpus, in seeded order — behind a fixed instruction
header, and asks for the number. So every passage recurs across samples at different places:
what position-independent reuse (EPIC, CacheBlend, LinearKV) exploits. A passage's text carries no
index or position, so its cache is the same wherever it lands.

`Sample.chunks` is [header, passage, ..., passage]; only the header is a prefix shared by every
prompt. Passages hold about `PASSAGE_TOKENS` tokens each and K grows with the length (7 at 4K,
63 at 32K with the byte tokenizer).

`rag-shared` is the shared-context case on the same corpus: one retrieved set of K passages is
asked K questions, one per passage, so K samples share their context exactly (the document
cached once, every question a hit on it at its full length, as in `prefix`). Its facts are the
same titled passages as `rag`'s, one fact per passage.
"""

from __future__ import annotations

import random

from hybridkv.errors import HybridKVError
from hybridkv.eval.scoring import string_match_all
from hybridkv.eval.workloads.base import Sample, Workload, largest_fitting, place_sentence
from hybridkv.eval.workloads.essay import essay_passage
from hybridkv.eval.workloads.words import ADJECTIVES, NOUNS

TASKS = ("rag", "rag-shared")
TOKENS_TO_GENERATE = {"rag": 16, "rag-shared": 16}
PASSAGE_TOKENS = 512
CORPUS_FACTOR = 4  # the corpus holds 4 × K passages, so each recurs in about K × n / corpus samples
HEADER = "Answer the question using the passages below. Give only the number.\n\n"
_FACT = "The registration number of {title} is {value}."
_QUESTION = "Question: What is the registration number of {title}?\nAnswer: The registration number of {title} is"


def _corpus(rng: random.Random, size: int) -> list[tuple[str, str, float]]:
    """(title, value, depth of the fact) per passage; titles and values are distinct."""
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], size)
    values = rng.sample(range(1_000_000, 10_000_000), size)
    titles = [f"{a.capitalize()} {b.capitalize()}" for a, b in pairs]
    return [(title, str(value), rng.random()) for title, value in zip(titles, values, strict=True)]


def _passage(index: int, words: int, title: str, value: str, depth: float) -> str:
    """Passage `index` of the corpus: its own slice of the essay with the fact at `depth`."""
    body = place_sentence(essay_passage(index * words, words), _FACT.format(title=title, value=value), depth)
    return f"Passage: {title}\n{body}\n\n"


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """`n` questions, each over K passages of one seeded corpus; every prompt (chunks tokenised
    one by one, then the question) plus the answer fits `length` tokens. `rag` draws a new set of
    passages for every question; `rag-shared` asks every passage of a set in turn (ceil(n / K) sets)."""
    if task not in TASKS:
        raise HybridKVError(f"unknown rag task {task!r}; one of {', '.join(TASKS)}")
    budget = length - TOKENS_TO_GENERATE[task]
    header_tokens = len(tokenizer.encode(HEADER))
    passages_per_prompt = (budget - header_tokens) // PASSAGE_TOKENS
    if passages_per_prompt < 2:
        raise HybridKVError(f"rag: {length} tokens cannot hold two passages of ~{PASSAGE_TOKENS} tokens")
    rng = random.Random(f"hybridkv-rag-{seed}-{length}")
    corpus = _corpus(rng, CORPUS_FACTOR * passages_per_prompt)
    longest_question = max(len(tokenizer.encode(_QUESTION.format(title=title))) for title, _, _ in corpus)

    def tokens(words: int) -> list[int]:  # tokens of every passage at `words` essay words each
        return [len(tokenizer.encode(_passage(i, words, *fact))) for i, fact in enumerate(corpus)]

    # Passage sizes differ a little (titles, numbers, the tokenizer): the K largest must fit.
    room = budget - header_tokens - longest_question

    def fits(words: int) -> bool:
        return sum(sorted(tokens(words))[-passages_per_prompt:]) <= room

    words = largest_fitting(fits, PASSAGE_TOKENS)
    if words == 0:
        raise HybridKVError(f"rag: {length} tokens cannot hold {passages_per_prompt} passages and a question")
    passages = [_passage(i, words, *fact) for i, fact in enumerate(corpus)]

    def sample(sample_id: str, chosen: list[int], gold: int, extra: dict) -> Sample:
        title, value, _ = corpus[gold]
        chunks = [HEADER, *(passages[i] for i in chosen)]
        return Sample(
            id=sample_id,
            task=task,
            length=length,
            context="".join(chunks),
            question=_QUESTION.format(title=title),
            golds=[value],
            chunks=chunks,
            meta={
                "passages": chosen,
                "gold_chunk": 1 + chosen.index(gold),
                "passage_words": words,
                "context_tokens": sum(len(tokenizer.encode(c)) for c in chunks),
                "tokens_to_generate": TOKENS_TO_GENERATE[task],
                **extra,
            },
        )

    samples = []
    if task == "rag":
        for index in range(n):
            sample_rng = random.Random(f"hybridkv-rag-{seed}-{length}-{index}")
            gold = index % len(corpus)  # every passage answers a question before any answers two
            chosen = sample_rng.sample([i for i in range(len(corpus)) if i != gold], passages_per_prompt - 1)
            chosen.insert(sample_rng.randrange(passages_per_prompt), gold)
            samples.append(sample(f"rag-{length}-{index}", chosen, gold, {}))
        return samples
    for group in range(-(-n // passages_per_prompt)):
        group_rng = random.Random(f"hybridkv-rag-shared-{seed}-{length}-{group}")
        chosen = group_rng.sample(range(len(corpus)), passages_per_prompt)
        for place, gold in enumerate(chosen[: n - len(samples)]):
            samples.append(sample(f"rag-shared-{length}-{group}-{place}", chosen, gold, {"context_group": group}))
    return samples


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    return string_match_all(prediction, golds)


WORKLOAD = Workload(name="rag", tasks=TASKS, default_tasks=("rag",), generate=generate, score=score)
