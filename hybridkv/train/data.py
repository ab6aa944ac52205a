"""Training data for the built-in tiny models, generated offline from text every Python install has.

Natural text: the Python reference topics that ship with the interpreter (`pydoc_data.topics`)
and the docstrings and source lines of the standard library. Long-context tasks are written in
the shapes the arena measures (needle retrieval with one or several keys, values and queries;
variable tracking; passages followed by a question), but by this module's own generators, over
its own haystacks and its own key and value vocabularies:

- keys are words taken from the standard library's docstrings, never a word of the arena's
  word lists (`hybridkv.eval.workloads.words`), so no arena needle can occur in training;
- the essay haystack is reference prose, not the arena's pseudo-essay; the noise haystack repeats
  sentences of this module's own, not RULER's "The grass is green..." lines;
- every example is drawn from a generator seeded by (seed, stream, step, index), so a run is
  reproducible and resumes at any step without replaying the data before it.

`tests/test_train.py` checks that no arena sample's needle, key or answer occurs in the stream.

Every example is exactly `length` byte tokens. Its `answers` spans mark the tokens after each
question that the model must produce (the last answer ends with a newline and the end of
sequence); the trainer weighs them separately from the language-model loss on the rest.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.models.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
EOS = 2


@dataclass(frozen=True)
class Example:
    tokens: list[int]  # exactly the requested length
    answers: tuple[tuple[int, int], ...]  # [start, end) token spans the model must produce after a question
    task: str


# ---------------------------------------------------------------------------------------------
# Text found on the machine


def _ascii(text: str) -> str:
    return text.encode("ascii", errors="ignore").decode()


@functools.cache
def prose() -> str:
    """Reference prose: pydoc topics, then stdlib docstrings, paragraphs separated by blank lines."""
    from pydoc_data.topics import topics

    parts = [topics[name] for name in sorted(topics)]
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    parts.append(doc)
    return _ascii("\n\n".join(parts))


@functools.cache
def code() -> str:
    return _ascii("\n\n".join(path.read_text(encoding="utf-8", errors="ignore") for path in _stdlib_files()[:400]))


@functools.cache
def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    return files


@functools.cache
def key_words() -> tuple[str, ...]:
    """Words for needle keys and values: from the prose, minus every word of the arena's lists."""
    from hybridkv.eval.workloads import words

    arena = set().union(words.ADJECTIVES, words.NOUNS, words.VERBS, words.ADVERBS, words.PREPOSITIONS)
    counts = Counter(re.findall(r"\b[a-z]{4,10}\b", prose()))
    return tuple(sorted({word for word, n in counts.items() if n >= 3} - arena))


# Sentences for the repeated-noise haystack: this module's own, five per sample.
NOISE_SENTENCES = (
    "The road is long.",
    "The lamp is lit.",
    "The bread is warm.",
    "The river runs east.",
    "The door is shut.",
    "The field is wide.",
    "The stone is cold.",
    "Birds sing at dawn.",
    "We walk on.",
    "Time moves slowly.",
    "The tea is hot.",
    "Rain falls softly.",
    "The wall is tall.",
    "Over hill and dale.",
    "Onward we go.",
    "The bell rings twice.",
)


# ---------------------------------------------------------------------------------------------
# Pieces


def _haystack(kind: str, size: int, rng: random.Random) -> list[str]:
    """Units (sentences or lines) of about `size` characters in all; joined with spaces or newlines."""
    if size <= 0:
        return []
    if kind == "noise":
        line = " ".join(rng.sample(NOISE_SENTENCES, 5))
        return [line] * (size // (len(line) + 1) + 1)
    source = prose() if kind == "prose" else code()
    start = rng.randrange(0, len(source) - size - 1)
    text = re.sub(r"\s+", " ", source[start : start + size + 200]) if kind == "prose" else source[start:]
    units = re.split(r"(?<=[.!?]) ", text) if kind == "prose" else text.split("\n")
    out, total = [], 0
    for unit in units:
        if total >= size:
            break
        out.append(unit)
        total += len(unit) + 1
    return out


def _fill(units: list[str], sep: str, size: int) -> str:
    text = sep.join(units)
    return text[:size] if len(text) >= size else text + " " * (size - len(text))


def _word(rng: random.Random) -> str:
    return rng.choice(key_words())


def _value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        digits = rng.choice((7, 7, 7, 6, 8, 5, 9))
        return str(rng.randrange(10 ** (digits - 1), 10**digits))
    if kind == "words":
        return f"{_word(rng)}-{_word(rng)}"
    hexdigits = f"{rng.getrandbits(128):032x}"
    hexdigits = hexdigits[:12] + "4" + hexdigits[13:16] + rng.choice("89ab") + hexdigits[17:]
    return "-".join((hexdigits[:8], hexdigits[8:12], hexdigits[12:16], hexdigits[16:20], hexdigits[20:]))


def _key(kind: str, rng: random.Random) -> str:
    return _value("uuids", rng) if kind == "uuids" else f"{_word(rng)}-{_word(rng)}"


def _distinct(draw: Callable[[], str], taken: set[str]) -> str:
    while True:
        item = draw()
        if item not in taken and not any(item in t or t in item for t in taken):
            taken.add(item)
            return item


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _assemble(
    task: str,
    head: str,
    body_units: list[str],
    inserts: list[tuple[float, str]],
    sep: str,
    tail: list[tuple[str, str]],
    length: int,
) -> Example | None:
    """head + body (haystack with inserts at fractions) + (question, answer) pairs, then EOS;
    exactly `length` tokens. Each answer (the last with its EOS) is an answer span."""
    fixed = sum(len(q) + len(a) for q, a in tail) + len(head) + 1 + sum(len(text) + len(sep) for _, text in inserts)
    size = length - fixed
    if size < 0:
        return None
    body = _fill(body_units, sep, size) if body_units else " " * size
    # Cut at unit boundaries nearest each fraction, so inserts stand between whole units.
    cuts = []
    for fraction, text in sorted(inserts):
        at = int(fraction * len(body))
        boundary = body.rfind(". ", 0, at) + 1 if sep == " " else body.rfind(sep, 0, at)
        cuts.append((boundary + 1 if boundary > 0 else 0, text))
    pieces, last = [], 0
    for at, text in cuts:
        pieces.append(body[last:at])
        pieces.append(text + sep)
        last = at
    pieces.append(body[last:])
    text = head + "".join(pieces)
    spans = []
    for question, answer in tail:
        text += question
        spans.append((len(text), len(text) + len(answer)))
        text += answer
    tokens = TOKENIZER.encode(text) + [EOS]
    spans[-1] = (spans[-1][0], length)
    assert len(tokens) == length, (len(tokens), length)
    return Example(tokens, tuple(spans), task)


# ---------------------------------------------------------------------------------------------
# Tasks


def niah(rng: random.Random, length: int) -> Example | None:
    """Needles '<special magic value> for <key> is: <value>.' in a haystack, then a question."""
    haystack = rng.choice(("prose", "prose", "noise", "needles", "code"))
    type_k = rng.choice(("words", "words", "words", "uuids"))
    type_v = rng.choice(("numbers", "numbers", "numbers", "words", "uuids"))
    shape = rng.choice(("single", "single", "multikey", "multivalue", "multiquery"))
    num_k, num_v, num_q = 1, 1, 1
    if shape == "multikey":
        num_k = rng.randint(2, 5)
    elif shape == "multivalue":
        num_v = rng.randint(2, 4)
    elif shape == "multiquery":
        num_q = rng.randint(2, 4)
        num_k = num_q + rng.randint(0, 2)
    taken: set[str] = set()
    keys = [_distinct(lambda: _key(type_k, rng), taken) for _ in range(num_k)]
    values = [[_distinct(lambda: _value(type_v, rng), taken) for _ in range(num_v)] for _ in keys]
    asked = rng.sample(range(num_k), num_q)
    golds = [v for i in asked for v in values[i]]
    single = len(golds) == 1
    noun = type_v[:-1] if single else type_v

    def needle(key: str, value: str) -> str:
        return f"One of the special magic {type_v} for {key} is: {value}."

    needles = [(rng.random(), needle(k, v)) for k, vs in zip(keys, values, strict=True) for v in vs]
    # Golds in the order their needles stand in the text: the order a reader would list them.
    place = {text: fraction for fraction, text in needles}
    golds.sort(key=lambda v: min(place[needle(k, v)] for k in keys if needle(k, v) in place))
    head = (
        f"{'A' if single else 'Some'} special magic {noun} {'is' if single else 'are'} hidden within the following "
        f"text. Make sure to memorize it. I will quiz you about the {noun} afterwards.\n"
    )
    query = _listing([keys[i] for i in asked])
    ask = "What is the" if single else "What are all the"
    question = (
        f"\n{ask} special magic {noun} for {query} mentioned in the provided text? The special magic {noun} "
        f"for {query} mentioned in the provided text {'is' if single else 'are'}"
    )
    answer = f" {_listing(golds)}.\n"
    sep = "\n" if haystack in ("noise", "needles", "code") else " "
    if haystack == "needles":
        units = []
        while sum(len(u) + 1 for u in units) < length:
            units.append(
                needle(_distinct(lambda: _key(type_k, rng), taken), _distinct(lambda: _value(type_v, rng), taken))
            )
    else:
        units = _haystack(haystack, length, rng)
    return _assemble(f"niah_{shape}", head, units, needles, sep, [(question, answer)], length)


def updates(rng: random.Random, length: int) -> Example | None:
    """A record set and later set again, two to four times, among other records; the question asks
    for the value now, i.e. the last one set. Documents revise what they state (a changelog, a chat
    where a figure is corrected, a variable reassigned), and the latest statement wins. GLM-5.3-Flash's
    NoPE MLA layers cannot tell a later statement from an earlier one by themselves: their sense of
    order comes only from the KDA layers' states, so this is the skill a zeroed state should cost."""
    type_k = rng.choice(("words", "words", "uuids"))
    type_v = rng.choice(("numbers", "numbers", "words"))
    noun = type_v[:-1]
    taken: set[str] = set()
    keys = [_distinct(lambda: _key(type_k, rng), taken) for _ in range(rng.randint(1, 4))]
    inserts = []
    for key in keys:
        settings = [_distinct(lambda: _value(type_v, rng), taken) for _ in range(rng.randint(2, 4))]
        fractions = sorted(rng.random() for _ in settings)
        inserts += [
            (f, f"The special magic {noun} for {key} is set to {v}.") for f, v in zip(fractions, settings, strict=True)
        ]
        if key == keys[0]:
            gold = settings[-1]
    head = (
        f"Special magic {type_v} are set within the following text, and some are set again later; the latest "
        f"setting counts. I will quiz you about the current {type_v} afterwards.\n"
    )
    question = (
        f"\nWhat is the current special magic {noun} for {keys[0]}? The current special magic {noun} for {keys[0]} is"
    )
    haystack = rng.choice(("prose", "noise", "code"))
    sep = " " if haystack == "prose" else "\n"
    return _assemble(
        "updates", head, _haystack(haystack, length, rng), inserts, sep, [(question, f" {gold}.\n")], length
    )


def recall(rng: random.Random, length: int) -> Example | None:
    """Many needles, then one short question and answer per needle, in shuffled order: dense
    supervision for the lookup every needle task needs; the last question is the full one.
    Half of them have no haystack at all and as many needles as fit: the drill that gets a
    freshly initialised model past the long plateau before retrieval forms."""
    type_k = rng.choice(("words", "words", "uuids"))
    type_v = rng.choice(("numbers", "numbers", "words", "uuids"))
    dense = rng.random() < 0.5
    count = max(2, min(48, (length - 160) // 130)) if dense else max(2, min(24, length // 220))
    taken: set[str] = set()
    keys = [_distinct(lambda: _key(type_k, rng), taken) for _ in range(count)]
    values = [_distinct(lambda: _value(type_v, rng), taken) for _ in keys]
    noun = type_v[:-1]
    needles = [
        (rng.random(), f"One of the special magic {type_v} for {k} is: {v}.") for k, v in zip(keys, values, strict=True)
    ]
    head = (
        f"Some special magic {type_v} are hidden within the following text. Make sure to memorize them. "
        f"I will quiz you about the {type_v} afterwards.\n"
    )
    order = rng.sample(range(count), count)
    tail = [(f"\nThe special magic {noun} for {keys[i]} is", f" {values[i]}.") for i in order[:-1]]
    last = order[-1]
    if dense:
        tail.append((f"\nThe special magic {noun} for {keys[last]} is", f" {values[last]}.\n"))
    else:
        tail.append(
            (
                f"\nWhat is the special magic {noun} for {keys[last]} mentioned in the provided text? The special "
                f"magic {noun} for {keys[last]} mentioned in the provided text is",
                f" {values[last]}.\n",
            )
        )
    haystack = rng.choice(("prose", "noise", "code"))
    sep = " " if haystack == "prose" else "\n"
    units = [] if dense else _haystack(haystack, length, rng)
    return _assemble("recall", head, units, needles, "\n" if dense else sep, tail, length)


def variable_tracking(rng: random.Random, length: int) -> Example | None:
    """Chains 'VAR B = VAR A' from 'VAR A = <value>' in repeated noise; name every variable of one value."""

    def chains(name_len: int, hops: int, count: int, taken: set[str]) -> list[list[str]]:
        out = []
        for _ in range(count):
            names = [
                _distinct(lambda: "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=name_len)), taken)
                for _ in range(hops + 1)
            ]
            out.append(names)
        return out

    def prompt_parts(names_per_chain: list[list[str]], values: list[str]):
        inserts = []
        for names, value in zip(names_per_chain, values, strict=True):
            fractions = sorted(rng.random() for _ in names)
            lines = [f"VAR {names[0]} = {value}"] + [
                f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(len(names) - 1)
            ]
            inserts += list(zip(fractions, lines, strict=True))
        return inserts

    from hybridkv.eval.workloads.ruler_tasks import VT_INTRO as intro  # the arena's own wording
    from hybridkv.eval.workloads.ruler_tasks import vt_question

    def question(value: str, count: int) -> str:
        return vt_question(value, count)[0]

    taken: set[str] = set()
    hops = rng.randint(1, 5)
    count = rng.choice((1, 1, 2))
    names = chains(5, hops, count, taken)
    values = [_distinct(lambda: str(rng.randrange(10000, 100000)), taken) for _ in names]
    noise = _haystack("noise", length, rng)
    head = intro
    if rng.random() < 0.5 and length >= 1024:
        # An in-context example in front, as the arena's prompts have.
        ex_names = chains(3, rng.randint(1, 4), 1, taken)
        ex_value = _distinct(lambda: str(rng.randrange(10000, 100000)), taken)
        ex_lines = [f"VAR {ex_names[0][0]} = {ex_value}"] + [
            f"VAR {ex_names[0][j + 1]} = VAR {ex_names[0][j]} " for j in range(len(ex_names[0]) - 1)
        ]
        ex_body = "\n".join(noise[:3] + ex_lines[:1] + noise[:2] + ex_lines[1:] + noise[:2])
        head = intro + ex_body + question(ex_value, len(ex_names[0])) + " " + " ".join(ex_names[0]) + "\n\n" + intro
    inserts = prompt_parts(names, values)
    answer = " ".join(names[0]) + "\n"
    return _assemble("vt", head, noise, inserts, "\n", [(question(values[0], len(names[0])), answer)], length)


def passages(rng: random.Random, length: int) -> Example | None:
    """Separately written passages, each with a title and one fact; a question about one fact."""
    taken: set[str] = set()
    count = rng.randint(3, 8)
    titles = [_distinct(lambda: _word(rng).capitalize() + " " + _word(rng).capitalize(), taken) for _ in range(count)]
    facts = [_distinct(lambda: _value(rng.choice(("numbers", "words")), rng), taken) for _ in range(count)]
    per = max(length // count - 120, 40)
    docs = []
    for title, fact in zip(titles, facts, strict=True):
        text = _fill(_haystack("prose", per, rng), " ", per)
        cut = rng.randrange(0, max(len(text) - 1, 1))
        cut = max(text.rfind(" ", 0, cut), 0)
        text = text[:cut] + f" The record code of {title} is {fact}." + text[cut:]
        docs.append(f"Document: {title}\n{text}\n\n")
    target = rng.randrange(count)
    question = f"Question: What is the record code of {titles[target]}? Answer: The record code of {titles[target]} is"
    answer = f" {facts[target]}.\n"
    head = "Read the documents below and answer the question.\n\n"
    fixed = len(head) + len(question) + len(answer) + 1
    body = "".join(docs)
    if fixed + len(body) > length:
        return None
    body = body + " " * (length - fixed - len(body))
    prompt = head + body + question
    tokens = TOKENIZER.encode(prompt) + TOKENIZER.encode(answer) + [EOS]
    return Example(tokens, ((len(prompt), length),), "passages")


# Attributes a `documents` fact can state; each document of an example states the same one.
ATTRIBUTES = (
    "record code",
    "registration number",
    "serial number",
    "catalogue number",
    "surveyed population",
    "postal code",
    "account number",
    "permit number",
)


def documents(rng: random.Random, length: int, two_titles: float = 0.3, restated: bool = False) -> Example | None:
    """2 to 16 separately written documents (at most one per 200 tokens, of unequal lengths that
    fill the example), every one stating the same kind of fact about its own title, then a question
    about one or two of them: the shape of the arena's `rag`
    and `agent-reports` workloads (their phrasing, this module's titles, values and prose). With a
    fact of the same kind in every document, the answer needs the title matched, not the first
    number found; a two-title question needs facts from two documents. `restated` asks it as the
    arena's `agent-reports` does, the answer naming each title again before its fact; without it,
    the phrasing the shipped checkpoints were trained on ("The Xs of A and B are")."""
    count = rng.randint(2, max(2, min(16, length // 200)))
    attr = rng.choice(ATTRIBUTES)
    numbers = rng.random() < 0.8
    taken: set[str] = set()
    titles = [_distinct(lambda: _word(rng).capitalize() + " " + _word(rng).capitalize(), taken) for _ in range(count)]
    facts = [_distinct(lambda: _value("numbers" if numbers else "words", rng), taken) for _ in range(count)]
    style = rng.choice(("document", "passage", "report"))
    asked = sorted(rng.sample(range(count), 2 if count > 2 and rng.random() < two_titles else 1))
    head = rng.choice(
        (
            "Read the documents below and answer the question.\n\n",
            "Answer the question using the passages below. Give only the answer.\n\n",
            "Your assistants each wrote one report below. Answer from the reports.\n\n",
        )
    )
    if len(asked) == 1:
        title = titles[asked[0]]
        question = f"Question: What is the {attr} of {title}?\nAnswer: The {attr} of {title} is"
        answer = f" {facts[asked[0]]}.\n"
    else:
        (first, second), (v1, v2) = [titles[i] for i in asked], [facts[i] for i in asked]
        if restated:
            question = f"Question: What is the {attr} of {first}, and the {attr} of {second}?\n"
            question += f"Answer: The {attr} of {first} is"
            answer = f" {v1}, and the {attr} of {second} is {v2}.\n"
        else:
            question = (
                f"Question: What {attr}s are given for {first} and for {second}?\n"
                f"Answer: The {attr}s of {first} and {second} are"
            )
            answer = f" {v1} and {v2}.\n"

    def frame(index: int, body: str) -> str:
        if style == "document":
            return f"Document: {titles[index]}\n{body}\n\n"
        if style == "passage":
            return f"Passage: {titles[index]}\n{body}\n\n"
        return f"Report {index + 1} on {titles[index]}\nNotes: {body}\nStatus: complete.\n\n"

    fact_texts = [
        (f"Finding: the {attr} of {t} is {v}." if style == "report" else f"The {attr} of {t} is {v}.")
        for t, v in zip(titles, facts, strict=True)
    ]
    fixed = len(head) + len(question) + len(answer) + 1 + sum(len(frame(i, f)) + 1 for i, f in enumerate(fact_texts))
    room = length - fixed
    if room < 40 * count:
        return None
    shares = [rng.uniform(0.5, 1.5) for _ in range(count)]
    sizes = [int(room * s / sum(shares)) for s in shares]
    sizes[-1] += room - sum(sizes)
    docs = []
    for index, (size, fact) in enumerate(zip(sizes, fact_texts, strict=True)):
        text = _fill(_haystack("prose", size, rng), " ", size)
        cut = max(text.rfind(" ", 0, rng.randrange(0, size)), 0)
        docs.append(frame(index, text[:cut] + " " + fact + text[cut:]))
    prompt = head + "".join(docs) + question
    tokens = TOKENIZER.encode(prompt) + TOKENIZER.encode(answer) + [EOS]
    assert len(tokens) == length, (len(tokens), length)
    return Example(tokens, ((len(prompt), length),), "documents")


def copy(rng: random.Random, length: int) -> Example | None:
    """A random passage written out again two to four times: every copy after the first is an
    answer span. In-context copying (an induction head) is what every retrieval task builds on,
    and natural text alone grows it far too slowly for a CPU's budget."""
    size = rng.randint(24, max(25, min(400, length // 3)))
    kind = rng.choice(("chars", "words", "prose"))
    if kind == "chars":
        alphabet = rng.choice(("0123456789", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-"))
        passage = "".join(rng.choice(alphabet) for _ in range(size))
    elif kind == "words":
        passage = " ".join(_word(rng) for _ in range(size // 7 + 1))[:size]
    else:
        start = rng.randrange(0, len(prose()) - size)
        passage = re.sub(r"\s+", " ", prose()[start : start + size])
    copies = rng.randint(2, 4)
    head = "Copy the passage exactly.\n"
    tail = [(f"\nCopy {n}: ", passage) for n in range(2, copies + 1)]
    tail[-1] = (tail[-1][0], passage + "\n")
    body = [f"Passage: {passage}"]
    fixed = len(head) + len(body[0]) + sum(len(q) + len(a) for q, a in tail) + 1
    if fixed > length:
        return None
    filler = _haystack("prose", length - fixed, rng)
    return _assemble("copy", head, body + filler, [], "\n", tail, length)


def pairs(rng: random.Random, length: int) -> Example | None:
    """Compact 'key: value' records, then every key asked again ('key:' -> ' value') in shuffled
    order: associative recall in its plainest form, as dense as a short example allows. At 128-256
    tokens it is the quickest way this repository found for a fresh model to grow the
    key-matching and copying attention that every needle task needs."""
    type_k = rng.choice(("words", "letters"))
    type_v = rng.choice(("numbers", "numbers", "words"))
    taken: set[str] = set()

    def key() -> str:
        if type_k == "words":
            return f"{_word(rng)}-{_word(rng)}"
        return "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=rng.randint(3, 6)))

    def value() -> str:
        if type_v == "numbers":
            digits = rng.randint(3, 8)
            return str(rng.randrange(10 ** (digits - 1), 10**digits))
        return _word(rng)

    head = "Records:\n"
    records: list[tuple[str, str]] = []
    used = len(head) + 1
    while True:
        k, v = _distinct(key, taken), _distinct(value, taken)
        cost = 2 * (len(k) + len(v) + 3) + 2
        if used + cost > length:
            break
        records.append((k, v))
        used += cost
    if len(records) < 2:
        return None
    body = [f"{k}: {v}" for k, v in records]
    order = rng.sample(range(len(records)), len(records))
    tail = [(f"\n{records[i][0]}:", f" {records[i][1]}") for i in order]
    tail[0] = ("\nQueries:" + tail[0][0], tail[0][1])
    tail[-1] = (tail[-1][0], tail[-1][1] + "\n")
    return _assemble("pairs", head + "\n".join(body), [], [], "\n", tail, length)


def natural(rng: random.Random, length: int) -> Example:
    """A contiguous stretch of reference prose or library source: plain language modelling."""
    source = prose() if rng.random() < 0.7 else code()
    start = rng.randrange(0, len(source) - length)
    tokens = TOKENIZER.encode(source[start : start + length])
    return Example(tokens, (), "natural")


Generator = Callable[[random.Random, int], Example | None]

TASKS: dict[str, tuple[float, Generator]] = {
    "niah": (0.25, niah),
    "recall": (0.3, recall),
    "copy": (0.15, copy),
    "vt": (0.1, variable_tracking),
    "passages": (0.05, passages),
    "natural": (0.15, natural),
    # Also the short-example warm-up on its own (`hybridkv train --tasks pairs,copy`).
    "pairs": (0.15, pairs),
    # Not in the default mix (weight 0: the default stream stays what the shipped models saw);
    # name it with a weight, e.g. `--tasks documents:0.35,niah:0.25,...`.
    "documents": (0.0, documents),
    # The same documents, with a question about two titles whenever there are three documents or
    # more, asked as `agent-reports` asks (two facts from two documents, each title restated).
    "two-documents": (0.0, functools.partial(documents, two_titles=1.0, restated=True)),
    # A record set again later, the latest setting asked (named with a weight, like documents).
    "updates": (0.0, updates),
}


def task_table(specs: tuple[str, ...]) -> dict[str, tuple[float, Generator]] | None:
    """`NAME` or `NAME:WEIGHT` entries (a bare name keeps its default weight); () is the default mix."""
    table = {}
    for spec in specs:
        name, _, weight = spec.partition(":")
        if name not in TASKS:
            raise HybridKVError(f"unknown training task {name!r}; known: {', '.join(TASKS)}")
        try:
            share = float(weight) if weight else TASKS[name][0]
        except ValueError:
            raise HybridKVError(f"--tasks: weight of {name!r} is not a number: {weight!r}") from None
        if share <= 0:
            raise HybridKVError(f"--tasks: give {name!r} a positive weight, e.g. {name}:0.3")
        table[name] = (share, TASKS[name][1])
    return table or None


def example(seed: int, stream: str, step: int, index: int, length: int, tasks: dict | None = None) -> Example:
    """Example `index` of step `step`: a pure function of its arguments."""
    rng = random.Random(f"hybridkv-train|{seed}|{stream}|{step}|{index}")
    table = tasks or TASKS
    names = list(table)
    while True:
        name = rng.choices(names, weights=[table[n][0] for n in names])[0]
        drawn = table[name][1](rng, length)
        if drawn is not None:
            return drawn
