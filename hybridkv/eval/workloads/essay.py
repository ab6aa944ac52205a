"""The pseudo-essay: one fixed text of grammatical sentences written from the built-in word lists
by a fixed-seed generator (twelve sentence forms).

It stands in for Paul Graham's essays as a haystack: like them it is one fixed text read from its
start, whatever a sample's seed; it holds no digits and no hyphens (see `words`), so no needle key
or value can occur in it by accident.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hybridkv.eval.workloads.words import ADJECTIVES, ADVERBS, NOUNS, PREPOSITIONS, VERBS, wordlist

DETERMINERS = wordlist("determiners")
SUBJECTS = wordlist("subjects")
MODALS = wordlist("modals")
SUBORDINATORS = wordlist("subordinators")
STARTERS = wordlist("starters")


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def essay_sentence(rng: random.Random) -> list[str]:
    """One sentence of the pseudo-essay, as words (the last ends with a full stop)."""
    pick = rng.choice

    def det() -> str:
        return pick(DETERMINERS)

    def verbs() -> str:
        return _third_person(pick(VERBS))

    adj, noun, verb, adv, prep = ADJECTIVES, NOUNS, VERBS, ADVERBS, PREPOSITIONS
    form = rng.randrange(12)
    if form == 0:
        text = f"{det()} {pick(adj)} {pick(noun)} {verbs()} {det()} {pick(noun)}"
    elif form == 1:
        text = (
            f"{pick(SUBJECTS)} {pick(MODALS)} {pick(verb)} {det()} {pick(adj)} {pick(noun)} {pick(prep)} "
            f"{det()} {pick(noun)}"
        )
    elif form == 2:
        text = (
            f"{pick(SUBORDINATORS)} {det()} {pick(noun)} {verbs()} {pick(adv)}, {pick(SUBJECTS)} "
            f"{pick(MODALS)} {pick(verb)} {det()} {pick(noun)}"
        )
    elif form == 3:
        text = f"it is {pick(adj)} to {pick(verb)} {det()} {pick(noun)} {pick(prep)} {det()} {pick(noun)}"
    elif form == 4:
        text = (
            f"{pick(STARTERS)} {pick(SUBJECTS)} {pick(verb)} {det()} {pick(noun)} and {pick(verb)} {det()} "
            f"{pick(adj)} {pick(noun)}"
        )
    elif form == 5:
        text = f"there is a {pick(adj)} {pick(noun)} {pick(prep)} {det()} {pick(noun)}"
    elif form == 6:
        text = (
            f"{det()} {pick(noun)} {pick(prep)} {det()} {pick(noun)} {pick(adv)} {verbs()} {det()} "
            f"{pick(adj)} {pick(noun)}"
        )
    elif form == 7:
        text = f"that is why {det()} {pick(noun)} {verbs()} {det()} {pick(noun)} {pick(adv)}"
    elif form == 8:
        text = f"{pick(SUBJECTS)} {pick(adv)} {pick(verb)} that {det()} {pick(noun)} {verbs()} {det()} {pick(noun)}"
    elif form == 9:
        text = f"the {pick(noun)} of {det()} {pick(noun)} is {pick(adv)} {pick(adj)}"
    elif form == 10:
        text = f"what matters most is {det()} {pick(adj)} {pick(noun)} {pick(prep)} {det()} {pick(noun)}"
    else:
        text = f"{pick(STARTERS)} the best {pick(noun)} is {det()} {pick(noun)} that {verbs()} {det()} {pick(noun)}"
    return _punctuate(text.split())


def _punctuate(words: list[str]) -> list[str]:
    """`a` before a vowel made `an`, the first word capitalised, a full stop after the last."""
    for i in range(len(words) - 1):
        if words[i] == "a" and words[i + 1][0] in "aeiou":
            words[i] = "an"
    words[0] = words[0][0].upper() + words[0][1:]
    words[-1] += "."
    return words


class Stream:
    """A lazily extended list drawn in order from one generator: item i never depends on how
    many items were asked for before, so anything built from a prefix is a pure function of it."""

    def __init__(self, draw: Callable[[], list[str]]) -> None:
        self._draw = draw
        self.items: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self.items) < n:
            self.items.extend(self._draw())
        return self.items[:n]


_ESSAY_RNG = random.Random("hybridkv-ruler-essay")
_ESSAY = Stream(lambda: essay_sentence(_ESSAY_RNG))


def essay_words(n: int) -> list[str]:
    """The first n words of the fixed pseudo-essay (whitespace-split, punctuation attached)."""
    return _ESSAY.take(n)


def essay_passage(start: int, n: int) -> list[str]:
    """The whole sentences among the essay's words [start, start + n): a passage of it that
    neither starts nor ends mid-sentence (shorter than n words by the cut-off ends)."""
    words = essay_words(start + n)[start:]
    ends = [i + 1 for i, word in enumerate(words) if word.endswith(".")]
    first = 0 if start == 0 or essay_words(start)[-1].endswith(".") else (ends[0] if ends else len(words))
    return words[first : ends[-1]] if ends and ends[-1] > first else []


def sentences(words: list[str]) -> list[str]:
    """Words back into sentences (RULER: nltk's sent_tokenize); a cut-off last one stays."""
    out, current = [], []
    for word in words:
        current.append(word)
        if word.endswith("."):
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return out


__all__ = ["Stream", "essay_passage", "essay_sentence", "essay_words", "sentences"]
