"""The built-in English word lists the generated workloads draw from, shipped as package data
(`data/<name>.txt`, one entry a line, `#` lines are comments).

A list's order is part of every generated sample (draws index into it), so the files are read as
they are: repeats kept, nothing sorted. They hold no digits and no hyphens, so a number or an
adjective-noun key cannot occur in text written from them by accident.
"""

from __future__ import annotations

from importlib.resources import files


def wordlist(name: str) -> tuple[str, ...]:
    """The entries of `data/<name>.txt` in file order (an entry may hold spaces or punctuation)."""
    text = (files("hybridkv.eval.workloads") / "data" / f"{name}.txt").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


ADJECTIVES = wordlist("adjectives")
NOUNS = wordlist("nouns")
VERBS = wordlist("verbs")
ADVERBS = wordlist("adverbs")
PREPOSITIONS = wordlist("prepositions")
# The word list cwe counts from and the essay is written in.
WORDS = tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS)))

__all__ = ["ADJECTIVES", "ADVERBS", "NOUNS", "PREPOSITIONS", "VERBS", "WORDS", "wordlist"]
