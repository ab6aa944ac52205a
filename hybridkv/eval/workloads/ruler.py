"""RULER (Hsieh et al., 2024): the 13 synthetic long-context tasks, generated for any tokenizer
and target length.

The tasks, their configurations (NVIDIA/RULER `scripts/synthetic.yaml`), prompt templates and
answer prefixes (`scripts/data/synthetic/constants.py`) and tokens to generate follow the official
generators. Each prompt is RULER's `template + answer_prefix` with the base (no chat) model
template, split at the query: `Sample.context` is everything before the question (instructions,
few-shot example, haystack) and `Sample.question` is the rest, so `context + question` is exactly
the prompt RULER would feed. A haystack is grown (binary search on its size) until
`len(tokenizer.encode(context + question)) + TOKENS_TO_GENERATE[task] <= length`, as large as that
allows.

No network and no datasets are needed for the 11 `LOCAL_TASKS`. Where the official generators read
files, this module uses built-in text instead:

- The essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery) is NOT
  Paul Graham's essays: it is a pseudo-essay of grammatical sentences built from the word list
  below by a fixed-seed generator. Like the essays it is one fixed text that every sample reads
  from its start, whatever the seed; it holds no digits and no hyphens, so no needle key or value
  can occur in it by accident.
- The noise haystack is RULER's own: "The grass is green. The sky is blue. The sun is yellow.
  Here we go. There and back again." repeated, one copy per line.
- Needle keys are adjective-noun pairs from the built-in lists (RULER uses the `wonderwords`
  lists); uuids are version-4 UUIDs built from the seeded generator; numbers have 7 digits.
- cwe draws its words from the built-in nouns, adjectives and verbs (RULER: `wonderwords`), and
  beyond those from seeded pseudo-words (RULER: a large English word list).
- qa_1 / qa_2 need SQuAD (v2 dev json, v1.1 also read) and HotpotQA (dev distractor json): pass a
  file or a folder holding one as `data_path`. Without it `generate` raises `MissingDataError`,
  whose message says the task is skipped and why.

Other deviations from the official generators, all to keep every sample well defined:

- Each sample draws from its own generator seeded by (task, seed, index), not by the length: the
  same seed gives the same keys, values and depths at every length, only the haystack grows.
  RULER's fixed-seed shuffles (`random.Random(seed).shuffle`) use that per-sample generator too.
- The haystack size is searched for every sample (RULER searches once, on the first sample, then
  steps down when a sample overflows); the noise haystack is sized in sentences, so its last line
  may hold only the first few of the five sentences, for a tighter fit; fwe searches its word
  count instead of stepping up by a 32nd of the length.
- Keys and values are distinct within a sample, no key is a substring of another real key, and
  no distractor of the needle haystack shares a key or a value with a real needle; RULER relies
  on collisions being unlikely.
- Needles inserted at the same place stand next to each other; RULER's essay insertion leaves an
  empty segment (a double space) there. In the noise and needle haystacks a needle's place is a
  uniform fraction of the lines (RULER: a sample of distinct line indices).
- vt's in-context example is drawn with fresh 3-letter names and value (RULER draws it once with
  value 12345 and substitutes strings into it per sample); it is sized to 500 tokens as in RULER.
- cwe uses RULER's long setting (30/3 repeats, a 40-word example) from 4096 tokens on and the
  short one (6/1, a 20-word example) below; where the long one cannot fit the budget at all (a
  byte-level tokenizer packs about one character per token) the short one is used instead.
- fwe's three answers must occur strictly more often than the fourth coded word; at the edge of
  a floor rounding the word count is lowered by a few words until they do.
- qa questions are taken in file order, as RULER does; asking for more samples than the file has
  answerable questions is an error.
- `remove_newline_tab` and model chat templates are not applied here.
"""

from __future__ import annotations

import functools
import json
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.scoring import RULER_TASK_ORDER
from hybridkv.eval.workloads import Sample

TASKS = RULER_TASK_ORDER
DATA_TASKS = ("qa_1", "qa_2")
LOCAL_TASKS = tuple(t for t in TASKS if t not in DATA_TASKS)

# RULER's tokens_to_generate per task family: the answer budget kept free below `length`.
_FAMILY_TOKENS = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
    "qa": 32,
}


def _niah_config(haystack: str, keys: str, values: str, nk: int = 1, nv: int = 1, nq: int = 1) -> dict:
    return {"family": "niah", "haystack": haystack, "k": keys, "v": values, "nk": nk, "nv": nv, "nq": nq}


# scripts/synthetic.yaml (haystack type, needle key / value types, numbers of keys, values, queries)
CONFIG: dict[str, dict] = {
    "niah_single_1": _niah_config("noise", "words", "numbers"),
    "niah_single_2": _niah_config("essay", "words", "numbers"),
    "niah_single_3": _niah_config("essay", "words", "uuids"),
    "niah_multikey_1": _niah_config("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah_config("needle", "words", "numbers"),
    "niah_multikey_3": _niah_config("needle", "uuids", "uuids"),
    "niah_multivalue": _niah_config("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah_config("essay", "words", "numbers", nq=4),
    "vt": {"family": "variable_tracking", "haystack": "noise", "num_chains": 1, "num_hops": 4},
    "cwe": {"family": "common_words_extraction", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
    "fwe": {"family": "freq_words_extraction", "alpha": 2.0, "coded_wordlen": 6},
    "qa_1": {"family": "qa", "dataset": "squad"},
    "qa_2": {"family": "qa", "dataset": "hotpotqa"},
}
TOKENS_TO_GENERATE = {task: _FAMILY_TOKENS[cfg["family"]] for task, cfg in CONFIG.items()}
# RULER's scoring: every gold must be in the prediction, except qa (any gold).
METRICS = {task: "string_match_part" if task in DATA_TASKS else "string_match_all" for task in TASKS}

DATASETS = {"qa_1": "SQuAD (v2 dev json)", "qa_2": "HotpotQA (dev distractor json)"}
# File names looked for when data_path is a folder: RULER's, then the official downloads'.
DATA_FILES = {
    "qa_1": ("squad.json", "dev-v2.0.json", "dev-v1.1.json"),
    "qa_2": ("hotpotqa.json", "hotpot_dev_distractor_v1.json"),
}


# ---------------------------------------------------------------------------------------------
# Built-in text: a modest English word list, RULER's noise, and a fixed pseudo-essay.


def _wordlist(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ADJECTIVES = _wordlist(
    """able active actual ancient angry awake aware basic bitter black blue bold brave brief bright
    broad broken brown busy calm careful certain cheap chief civil clean clear clever close cold
    common complex cool correct crazy curious dark dead deep direct distant dry early easy electric
    empty equal exact expensive fair false familiar famous fast fat final fine firm flat foreign
    formal free fresh friendly full funny general gentle giant glad golden good grand gray great
    green happy hard healthy heavy high honest huge humble ideal important initial inner junior
    kind large late lazy legal light little live local lonely long loose loud lovely low lucky main
    major mental middle mild minor modern moral narrow native natural neat nervous new nice noble
    normal obvious odd open orange original outer patient perfect plain pleasant polite poor
    popular positive possible practical precious pretty private proper proud public pure purple
    quick quiet rapid rare raw ready real recent red regular relevant rich right rough round royal
    rural sad safe scared secret serious sharp short shy silent silly simple single slow small smart
    smooth soft solid special stable steady steep strange strict strong sudden sweet swift tall
    thick thin tidy tight tiny tough true typical ugly unique upper urban useful usual vast violet
    visible vital warm weak wealthy weird wet white whole wide wild wise wooden yellow young"""
)
NOUNS = _wordlist(
    """account actor address advice age air airport animal apple area argument army art article
    artist attempt attention audience author baby bag ball bank bar basket bath beach bear bed bell
    bird blade board boat body bone book border bottle bottom box bread bridge brother budget
    building cabin cake camera camp car card career castle cat cattle cell chair chance channel
    chapter cheese chest chicken child choice church circle city class climate clock cloud coast
    coat coffee college color company computer concept contract corner cotton country course
    cousin crowd culture cup customer daughter day deal debate decision desk detail device diamond
    dinner director disease doctor dog door dragon drawer dress driver eagle earth economy editor
    effect egg energy engine event example exercise factory family farm father feather feeling field
    film finger fire fish flag floor flower forest fork fox friend fruit game garden gate gift girl
    glass goal government grass group guitar hair hall hammer harbor hat heart hill history hole
    horse hospital hotel house idea image island jacket job journey judge kettle kitchen knife
    ladder lake lamp language lawyer leader letter library lion machine magazine manager map market
    meal meat memory menu message metal method mirror moment money monkey moon morning mother
    mountain mouse movie museum music nation nature nest network newspaper night noise ocean office
    oil onion owner page painter paper parent park party passenger pattern pencil pepper person
    phone piano picture pilot planet plate player pocket poem poet police pond potato power
    president price prison problem process product program project queen question rabbit radio
    rain reader record river road rock roof room rope rule salad salt school science screen sea
    season shadow sheep ship shirt shoe shop signal silver singer sister skill sky snake snow society
    soldier song soup space speaker spirit spoon square stage star station stone store storm story
    street student sugar summer sun system table tail teacher team theory thread ticket tiger tongue
    tool tower town toy tree truck uncle union valley village violin voice wall war water wave
    weather wheel window wind wine winter wolf woman wood world writer year"""
)
VERBS = _wordlist(
    """accept admire allow answer arrange attack avoid bake borrow build burn buy call carry catch
    change check choose climb collect compare complete consider contain cook copy count cover create
    cross cut decide defend deliver describe design destroy develop discover divide draw drink drive
    drop earn enjoy enter explain explore face fill find finish fix follow forget gather grab grow
    guide handle hear help hide hold hunt improve include invite join jump kick knock know lead learn
    leave lend lift like listen lose love make manage mark measure meet melt miss mix move need
    notice offer order paint pass pay pick place plan play pour prefer prepare press print protect
    provide pull push reach read receive remember repair repeat replace report rescue return ride
    roll rush save search see sell send serve share shut sing solve sort speak spend start steal stop
    study support surprise take teach tell test thank throw touch trace trade travel trust try turn
    understand use visit wait walk want wash wear win wish write"""
)
ADVERBS = _wordlist(
    """often rarely quickly slowly always never usually sometimes quietly carefully easily clearly
    gently simply barely nearly really truly mostly gladly proudly boldly calmly freely openly deeply
    widely finally suddenly eventually seldom naturally honestly"""
)
PREPOSITIONS = _wordlist(
    """about above across after against along among around before behind below beneath beside between
    beyond during for from inside into near outside over past through toward under upon with within
    without"""
)
_DETERMINERS = ("the", "the", "the", "a", "a", "every", "each", "this", "that", "one", "no", "any", "our", "their")
_SUBJECTS = (
    "we",
    "you",
    "they",
    "people",
    "most people",
    "good writers",
    "young founders",
    "many investors",
    "smart students",
    "some readers",
)
_MODALS = ("can", "will", "should", "might", "must", "could", "would")
_SUBORDINATORS = ("because", "although", "when", "while", "if", "unless", "since", "once", "before", "after")
_STARTERS = (
    "In practice,",
    "Of course,",
    "In other words,",
    "For example,",
    "Still,",
    "Even so,",
    "As a rule,",
    "At first,",
    "In the end,",
    "Usually,",
)
# The word list cwe counts from and the essay is written in.
WORDS = tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS)))

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NOISE_SENTENCES = tuple(s + "." for s in NOISE.rstrip(".").split(". "))

# RULER's needle depths: 40 points from 0 to 100 percent.
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _essay_sentence(rng: random.Random) -> list[str]:
    """One sentence of the pseudo-essay, as words (the last ends with a full stop)."""
    pick = rng.choice

    def det() -> str:
        return pick(_DETERMINERS)

    def verbs() -> str:
        return _third_person(pick(VERBS))

    adj, noun, verb, adv, prep = ADJECTIVES, NOUNS, VERBS, ADVERBS, PREPOSITIONS
    form = rng.randrange(12)
    if form == 0:
        text = f"{det()} {pick(adj)} {pick(noun)} {verbs()} {det()} {pick(noun)}"
    elif form == 1:
        text = (
            f"{pick(_SUBJECTS)} {pick(_MODALS)} {pick(verb)} {det()} {pick(adj)} {pick(noun)} {pick(prep)} "
            f"{det()} {pick(noun)}"
        )
    elif form == 2:
        text = (
            f"{pick(_SUBORDINATORS)} {det()} {pick(noun)} {verbs()} {pick(adv)}, {pick(_SUBJECTS)} "
            f"{pick(_MODALS)} {pick(verb)} {det()} {pick(noun)}"
        )
    elif form == 3:
        text = f"it is {pick(adj)} to {pick(verb)} {det()} {pick(noun)} {pick(prep)} {det()} {pick(noun)}"
    elif form == 4:
        text = (
            f"{pick(_STARTERS)} {pick(_SUBJECTS)} {pick(verb)} {det()} {pick(noun)} and {pick(verb)} {det()} "
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
        text = f"{pick(_SUBJECTS)} {pick(adv)} {pick(verb)} that {det()} {pick(noun)} {verbs()} {det()} {pick(noun)}"
    elif form == 9:
        text = f"the {pick(noun)} of {det()} {pick(noun)} is {pick(adv)} {pick(adj)}"
    elif form == 10:
        text = f"what matters most is {det()} {pick(adj)} {pick(noun)} {pick(prep)} {det()} {pick(noun)}"
    else:
        text = f"{pick(_STARTERS)} the best {pick(noun)} is {det()} {pick(noun)} that {verbs()} {det()} {pick(noun)}"
    words = text.split()
    for i in range(len(words) - 1):  # a -> an before a vowel
        if words[i] == "a" and words[i + 1][0] in "aeiou":
            words[i] = "an"
    words[0] = words[0][0].upper() + words[0][1:]
    words[-1] += "."
    return words


class _Stream:
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
_ESSAY = _Stream(lambda: _essay_sentence(_ESSAY_RNG))


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


def _sentences(words: list[str]) -> list[str]:
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


def _noise_lines(num_sentences: int) -> list[str]:
    """RULER's noise haystack, one copy per line, the last copy cut after num_sentences."""
    full, rest = divmod(num_sentences, len(_NOISE_SENTENCES))
    lines = [NOISE] * full
    if rest:
        lines.append(" ".join(_NOISE_SENTENCES[:rest]))
    return lines


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.randint(2, 4)
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(syllables))


def _zeta(alpha: float, terms: int = 2000) -> float:
    """Riemann zeta for alpha > 1 (RULER: scipy.special.zeta), Euler-Maclaurin tail."""
    head = sum(k**-alpha for k in range(1, terms))
    n = float(terms)
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12


# ---------------------------------------------------------------------------------------------
# Assembly and fitting.


@dataclass
class _Draft:
    context: str
    question: str
    golds: list[str]
    meta: dict


def _insert(units: list[str], inserts: list[tuple[int, str]]) -> tuple[list[str], list[int]]:
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


def _join(items: list[str], sep: str, start: int) -> tuple[str, list[int]]:
    """items joined by sep, and each item's offset (plus start)."""
    offsets, pos = [], start
    for item in items:
        offsets.append(pos)
        pos += len(item) + len(sep)
    return sep.join(items), offsets


def _fit(
    task: str,
    length: int,
    build: Callable[[int], _Draft],
    tokenizer,
    budget: int,
    lo: int,
    guess: int | None,
) -> tuple[_Draft, int, int]:
    """The draft of the largest size k >= lo whose prompt fits `budget` tokens (token count is
    taken to grow with k), its token count and k. Gallops from `guess`, then bisects."""
    memo: dict[int, tuple[_Draft, int]] = {}

    def tokens(k: int) -> int:
        if k not in memo:
            draft = build(k)
            memo[k] = (draft, len(tokenizer.encode(draft.context + draft.question)))
        return memo[k][1]

    if tokens(lo) > budget:
        raise HybridKVError(
            f"{task}: {length} tokens is too short for this tokenizer; the smallest prompt takes "
            f"{tokens(lo)} tokens plus {TOKENS_TO_GENERATE[task]} to generate"
        )
    if guess is None:
        probe = 64
        per_unit = max((tokens(lo + probe) - tokens(lo)) / probe, 1e-3)
        guess = lo + int((budget - tokens(lo)) / per_unit)
    k = max(lo, guess)
    step = max(1, k // 200)
    good = lo
    if tokens(k) <= budget:
        good = k
        while tokens(good + step) <= budget:
            good += step
            step *= 2
        bad = good + step
    else:
        bad = k
        while bad - step > lo:
            if tokens(bad - step) <= budget:
                good = bad - step
                break
            bad -= step
            step *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if tokens(mid) <= budget:
            good = mid
        else:
            bad = mid
    return memo[good][0], memo[good][1], good


# ---------------------------------------------------------------------------------------------
# niah


def _draw_value(kind: str, rng: random.Random, taken: set[str], keys: list[str] = ()) -> str:
    """A fresh number / adjective-noun word / uuid, not in `taken`; with `keys`, also neither a
    substring nor a superstring of any of them."""
    for _ in range(10_000):
        if kind == "numbers":
            value = str(rng.randint(10**6, 10**7 - 1))
        elif kind == "words":
            value = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        elif kind == "uuids":
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            raise ValueError(kind)
        if value in taken or any(value in k or k in value for k in keys):
            continue
        taken.add(value)
        return value
    raise HybridKVError(f"ran out of distinct {kind} for needles: the length is too large for the built-in word list")


def _niah(cfg: dict, rng: random.Random, sample_seed: str) -> tuple[Callable[[int], _Draft], int]:
    type_k, type_v, haystack = cfg["k"], cfg["v"], cfg["haystack"]
    num_v, num_q = cfg["nv"], cfg["nq"]
    num_k = max(cfg["nk"], num_q)
    taken: set[str] = set()
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[tuple[str, str]] = []  # (key, value)
    for _ in range(num_k):
        keys.append(_draw_value(type_k, rng, taken, keys))
        values.append([])
        for _ in range(num_v):
            values[-1].append(_draw_value(type_v, rng, taken))
            needles.append((keys[-1], values[-1][-1]))
    rng.shuffle(needles)
    query_index = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in query_index]
    golds = [v for i in query_index for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    def needle_text(key: str, value: str) -> str:
        return f"One of the special magic {type_v} for {key} is: {value}."

    texts = [needle_text(k, v) for k, v in needles]
    # RULER's template, made singular when one value is asked for.
    single = num_q * num_v == 1
    noun = type_v[:-1] if single else type_v
    preamble = (
        f"{'A' if single else 'Some'} special magic {noun} {'is' if single else 'are'} hidden within the following "
        f"text. Make sure to memorize it. I will quiz you about the {noun} afterwards.\n"
    )
    ask = "What is the" if single else "What are all the"
    answer_prefix = f" The special magic {noun} for {query} mentioned in the provided text {'is' if single else 'are'}"
    question = f"\n{ask} special magic {noun} for {query} mentioned in the provided text?{answer_prefix}"

    if haystack == "essay":
        depth_percents = sorted(rng.sample(DEPTHS, len(needles)))
        fractions = None
    else:
        depth_percents = None
        fractions = sorted(rng.random() for _ in needles)
    if haystack == "needle":
        d_rng = random.Random(f"{sample_seed}|distractors")

        def distractor() -> list[str]:
            key = _draw_value(type_k, d_rng, taken, keys)
            return [needle_text(key, _draw_value(type_v, d_rng, taken))]

        distractors = _Stream(distractor)

    def build(k: int) -> _Draft:
        if haystack == "essay":
            units = _sentences(essay_words(k))
            positions = [int(len(units) * (d / 100)) for d in depth_percents]
            sep = " "
        else:
            units = _noise_lines(k) if haystack == "noise" else distractors.take(k)
            positions = [int(f * len(units)) for f in fractions]
            sep = "\n"
        items, where = _insert(units, list(zip(positions, texts, strict=True)))
        body, offsets = _join(items, sep, len(preamble))
        needle_meta = []
        for i, ((key, value), text) in enumerate(zip(needles, texts, strict=True)):
            entry = {
                "key": key,
                "value": value,
                "text": text,
                "offset": offsets[where[i]],
                "unit_index": positions[i],
                "depth": positions[i] / len(units) if units else 0.0,
            }
            if depth_percents is not None:
                entry["depth_percent"] = depth_percents[i]
            needle_meta.append(entry)
        meta = {
            "haystack": haystack,
            "haystack_offset": len(preamble),
            "num_units": len(units),
            "needles": needle_meta,
            "depths": [n["depth"] for n in needle_meta],
            "offsets": [n["offset"] for n in needle_meta],
            "query_keys": queries,
            "answer_prefix": answer_prefix,
        }
        return _Draft(preamble + body, question, list(golds), meta)

    return build, 1


# ---------------------------------------------------------------------------------------------
# vt: variable tracking

VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def vt_question(value: str, num_v: int) -> tuple[str, str]:
    answer_prefix = (
        f" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        f"assigned the value {value}, they are: "
    )
    return f"\nQuestion: Find all variables that are assigned the value {value} in the text above.{answer_prefix}", (
        answer_prefix
    )


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int, taken: set[str]):
    """Chains of `VAR X = value`, `VAR Y = VAR X `, ... (RULER's lines, trailing space included)."""
    names: list[list[str]] = []
    chains: list[list[str]] = []
    for _ in range(num_chains):
        these = []
        while len(these) < num_hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
            if name not in taken:
                taken.add(name)
                these.append(name)
        value = _draw_distinct(lambda: str(rng.randint(10000, 99999)), taken)
        names.append(these)
        links = [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)]
        chains.append([f"VAR {these[0]} = {value}", *links])
    return names, chains


def _draw_distinct(draw: Callable[[], str], taken: set[str]) -> str:
    while True:
        value = draw()
        if value not in taken:
            taken.add(value)
            return value


def _vt_body(chains: list[list[str]], fractions: list[list[float]], k: int, start: int):
    """The noise haystack with the chains inserted in order (RULER: sorted random line indices,
    the j-th link at index + j). Returns the text and each link's offset and line index."""
    items = [(line, None) for line in _noise_lines(k)]
    for c, chain in enumerate(chains):
        positions = [int(f * len(items)) for f in fractions[c]]
        for j in reversed(range(len(chain))):  # from the last, so earlier positions stay valid
            items.insert(positions[j], (chain[j], (c, j)))
    text, offsets = _join([t for t, _ in items], "\n", start)
    links = {tag: (offsets[i], i) for i, (_, tag) in enumerate(items) if tag is not None}
    return text, links, len(items)


def _vt(task: str, cfg: dict, rng: random.Random, tokenizer, state: dict) -> tuple[Callable[[int], _Draft], int]:
    num_chains, num_hops = cfg["num_chains"], cfg["num_hops"]
    taken: set[str] = set()
    names, chains = _vt_chains(rng, num_chains, num_hops, 5, taken)
    fractions = [sorted(rng.random() for _ in chain) for chain in chains]
    value = chains[0][0].split("=")[-1].strip()
    question, answer_prefix = vt_question(value, num_hops + 1)

    # The in-context example: 3-letter names, at most 10 hops, its whole prompt within 500 tokens.
    icl_hops = min(10, num_hops)
    icl_names, icl_chains = _vt_chains(rng, num_chains, icl_hops, 3, taken)
    icl_fractions = [sorted(rng.random() for _ in chain) for chain in icl_chains]
    icl_value = icl_chains[0][0].split("=")[-1].strip()
    icl_question, _ = vt_question(icl_value, icl_hops + 1)

    def build_icl(k: int) -> _Draft:
        body, _, _ = _vt_body(icl_chains, icl_fractions, k, 0)
        return _Draft(VT_INTRO + body, icl_question, [], {})

    icl, _, icl_k = _fit(task, 500 + TOKENS_TO_GENERATE[task], build_icl, tokenizer, 500, 1, state.get("icl_k"))
    state["icl_k"] = icl_k
    icl_text = icl.context + icl.question + " " + " ".join(icl_names[0]) + "\n"
    preamble = icl_text + "\n" + VT_INTRO
    icl_tokens = len(tokenizer.encode(icl_text))

    def build(k: int) -> _Draft:
        body, links, num_lines = _vt_body(chains, fractions, k, len(preamble))
        meta = {
            "haystack": "noise",
            "haystack_offset": len(preamble),
            "num_units": num_lines - sum(len(chain) for chain in chains),
            "chains": [
                [{"text": link, "offset": links[(c, j)][0], "line": links[(c, j)][1]} for j, link in enumerate(chain)]
                for c, chain in enumerate(chains)
            ],
            "value": value,
            "depths": [links[(0, j)][1] / num_lines for j in range(len(chains[0]))],
            "offsets": [links[(0, j)][0] for j in range(len(chains[0]))],
            "icl_tokens": icl_tokens,
            "answer_prefix": answer_prefix,
        }
        return _Draft(preamble + body, question, list(names[0]), meta)

    return build, 1


# ---------------------------------------------------------------------------------------------
# cwe: common words extraction

_CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
_CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?" + _CWE_ANSWER_PREFIX
# (example words, example repeats common/uncommon, repeats common/uncommon): RULER's long and short
_CWE_SETTINGS = {"long": (40, 10, 3, 30, 3), "short": (20, 3, 1, 6, 1)}


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe(cfg: dict, rng: random.Random, sample_seed: str, setting: str) -> tuple[Callable[[int], _Draft], int]:
    num_cw = cfg["num_cw"]
    ex_words, ex_rc, ex_ru, rc, ru = _CWE_SETTINGS[setting]
    if setting == "long":
        rc, ru = cfg["freq_cw"], cfg["freq_ucw"]

    def example(words: list[str], common_repeats: int, uncommon_repeats: int, shuffle_seed: str):
        common, uncommon = words[:num_cw], words[num_cw:]
        listed = common * common_repeats + uncommon * uncommon_repeats
        random.Random(shuffle_seed).shuffle(listed)
        return _numbered(listed), common

    shot_list, shot_answer = example(rng.sample(WORDS, ex_words), ex_rc, ex_ru, f"{sample_seed}|shot")
    shot = _CWE_TEMPLATE + shot_list + _CWE_QUESTION + " " + _numbered(shot_answer)
    preamble = shot + "\n" + _CWE_TEMPLATE
    order = list(WORDS)
    rng.shuffle(order)
    pseudo_rng = random.Random(f"{sample_seed}|pseudo")
    known = set(WORDS)

    def more_words() -> list[str]:
        if not order:
            return [_draw_distinct(lambda: _pseudo_word(pseudo_rng), known)]
        batch = order[:]
        order.clear()
        return batch

    pool = _Stream(more_words)

    def build(k: int) -> _Draft:
        listed, common = example(pool.take(k), rc, ru, f"{sample_seed}|list")
        meta = {
            "setting": setting,
            "freq_cw": rc,
            "freq_ucw": ru,
            "num_words": k,
            "haystack_offset": len(preamble),
            "answer_prefix": _CWE_ANSWER_PREFIX,
        }
        return _Draft(preamble + listed, _CWE_QUESTION, common, meta)

    return build, 2 * num_cw


# ---------------------------------------------------------------------------------------------
# fwe: frequent words extraction

_FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
_FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
_FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?" + _FWE_ANSWER_PREFIX
)


def _fwe_counts(num_words: int, vocab_size: int, alpha: float) -> list[int]:
    z = _zeta(alpha)
    return [int(num_words * (k**-alpha) / z) for k in range(1, vocab_size + 1)]


def _fwe(
    task: str, cfg: dict, rng: random.Random, sample_seed: str, budget: int
) -> tuple[Callable[[int], _Draft], int, Callable[[int], bool]]:
    alpha, wordlen = cfg["alpha"], cfg["coded_wordlen"]
    vocab_size = budget // 50
    if vocab_size < 5:
        raise HybridKVError(f"{task}: the length is too short; fwe needs at least 5 coded words (250 tokens)")
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent is noise
    golds = ranked[1:4]

    def valid(n: int) -> bool:
        counts = _fwe_counts(n, vocab_size, alpha)
        return min(counts[1:4]) > counts[4]

    lo = 1
    while not valid(lo):
        lo += 1

    def build(k: int) -> _Draft:
        counts = _fwe_counts(k, vocab_size, alpha)
        words = [w for w, c in zip(ranked, counts, strict=True) for _ in range(c)]
        random.Random(f"{sample_seed}|shuffle").shuffle(words)
        meta = {
            "num_words": k,
            "vocab_size": vocab_size,
            "counts": dict(zip(ranked[:4], counts[:4], strict=True)),
            "haystack_offset": len(_FWE_TEMPLATE),
            "answer_prefix": _FWE_ANSWER_PREFIX,
        }
        return _Draft(_FWE_TEMPLATE + " ".join(words), _FWE_QUESTION, list(golds), meta)

    return build, lo, valid


# ---------------------------------------------------------------------------------------------
# qa

_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
_QA_PREAMBLE = f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n"
_QA_ANSWER_PREFIX = " Answer:"


@dataclass(frozen=True)
class _QAData:
    docs: tuple[str, ...]
    qas: tuple[dict, ...]  # query, outputs, context (doc ids), more_context (doc ids)


def _resolve_data(task: str, data_path: str | None) -> Path:
    need = f"{task} skipped: needs --data PATH with {DATASETS[task]}"
    if data_path is None:
        raise MissingDataError(need)
    path = Path(data_path)
    if path.is_dir():
        for name in DATA_FILES[task]:
            if (path / name).is_file():
                return path / name
        raise MissingDataError(f"{need}; {path} holds none of {', '.join(DATA_FILES[task])}")
    if not path.is_file():
        raise MissingDataError(f"{need}; {path} does not exist")
    return path


@functools.lru_cache(maxsize=4)
def _load_qa(path: str, dataset: str, _stamp: tuple) -> _QAData:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HybridKVError(f"{path}: not readable as JSON ({err})") from err
    is_squad = isinstance(data, dict) and isinstance(data.get("data"), list)
    is_hotpot = isinstance(data, list) and all(isinstance(d, dict) and "context" in d for d in data[:5])
    task = "qa_1" if dataset == "squad" else "qa_2"
    if (dataset == "squad" and not is_squad) or (dataset == "hotpotqa" and not is_hotpot):
        raise MissingDataError(f"{task} skipped: needs --data PATH with {DATASETS[task]}; {path} is not one")
    try:
        if dataset == "squad":
            return _read_squad(data)
        return _read_hotpotqa(data)
    except (KeyError, TypeError, ValueError) as err:
        raise HybridKVError(f"{path}: malformed {DATASETS[task]} ({type(err).__name__}: {err})") from err


def _read_squad(data: dict) -> _QAData:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = index[p["context"]]
            for qa in p["qas"]:
                if qa.get("is_impossible", False) or not qa["answers"]:
                    continue
                qas.append(
                    {
                        "query": qa["question"],
                        "outputs": [a["text"] for a in qa["answers"]],
                        "context": [own],
                        "more_context": [i for i in article if i != own],
                    }
                )
    return _QAData(tuple(docs), tuple(qas))


def _read_hotpotqa(data: list) -> _QAData:
    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({doc(t, p) for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[doc(t, p)] for t, p in d["context"]],
            "more_context": [],
        }
        for d in data
    ]
    return _QAData(tuple(docs), tuple(qas))


def _qa(data: _QAData, index: int, rng: random.Random, sample_seed: str) -> tuple[Callable[[int], _Draft], int]:
    qa = data.qas[index]
    own = list(dict.fromkeys(qa["context"]))
    more = [i for i in qa["more_context"] if i not in own]
    rng.shuffle(more)
    skip = set(own) | set(more)
    others = [i for i in range(len(data.docs)) if i not in skip]
    rng.shuffle(others)
    extra = more + others
    question = f"\n\n{_QA_INSTRUCTION}\n\nQuestion: {qa['query']}{_QA_ANSWER_PREFIX}"

    def build(k: int) -> _Draft:
        if k < len(data.docs):
            chosen = own + extra[: k - len(own)]
        else:  # more documents than the file has: repeat them all (RULER)
            chosen = (list(range(len(data.docs))) * (k // len(data.docs) + 1))[:k]
        random.Random(f"{sample_seed}|shuffle").shuffle(chosen)
        items = [f"Document {i + 1}:\n{data.docs[d]}" for i, d in enumerate(chosen)]
        body, offsets = _join(items, "\n\n", len(_QA_PREAMBLE))
        gold_positions = [i for i, d in enumerate(chosen) if d in own]
        meta = {
            "num_docs": k,
            "question_index": index,
            "gold_docs": gold_positions,
            "depths": [i / len(chosen) for i in gold_positions],
            "offsets": [offsets[i] for i in gold_positions],
            "haystack_offset": len(_QA_PREAMBLE),
            "answer_prefix": _QA_ANSWER_PREFIX,
        }
        return _Draft(_QA_PREAMBLE + body, question, list(qa["outputs"]), meta)

    return build, len(own)


# ---------------------------------------------------------------------------------------------


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """n samples of RULER `task` whose prompt (context + question) plus TOKENS_TO_GENERATE[task]
    fits `length` tokens of `tokenizer`, each haystack as large as that allows.

    Deterministic in (task, length, n, seed); sample i is the same whatever n is. qa_1 / qa_2 read
    `data_path` (a SQuAD / HotpotQA json, or a folder holding one, see DATA_FILES) and raise
    MissingDataError without it. Raises HybridKVError for an unknown task or a length too short.
    """
    if task not in CONFIG:
        raise HybridKVError(f"unknown RULER task {task!r}; one of {', '.join(TASKS)}")
    if n < 0:
        raise HybridKVError(f"{task}: the number of samples must be >= 0, not {n}")
    cfg = CONFIG[task]
    family = cfg["family"]
    ttg = TOKENS_TO_GENERATE[task]
    budget = length - ttg
    if budget <= 0:
        raise HybridKVError(f"{task}: length {length} leaves no room for the prompt ({ttg} tokens to generate)")
    data = None
    if family == "qa":
        path = _resolve_data(task, data_path)
        stat = path.stat()
        data = _load_qa(str(path.resolve()), cfg["dataset"], (stat.st_mtime_ns, stat.st_size))
        if n > len(data.qas):
            raise HybridKVError(f"{task}: {path} has {len(data.qas)} answerable questions, {n} samples asked for")

    samples = []
    state: dict = {}
    for index in range(n):
        sample_seed = f"ruler|{task}|{seed}|{index}"
        rng = random.Random(sample_seed)
        valid = None
        if family == "niah":
            build, lo = _niah(cfg, rng, sample_seed)
        elif family == "variable_tracking":
            build, lo = _vt(task, cfg, rng, tokenizer, state)
        elif family == "common_words_extraction":
            # RULER's long setting from 4096 tokens on; the short one where the long cannot fit.
            setting = state.get("cwe_setting", "long" if length >= 4096 else "short")
            build, lo = _cwe(cfg, rng, sample_seed, setting)
            if setting == "long":
                probe = build(lo)
                if len(tokenizer.encode(probe.context + probe.question)) > budget:
                    setting = "short"
                    build, lo = _cwe(cfg, random.Random(sample_seed), sample_seed, setting)
            state["cwe_setting"] = setting
        elif family == "freq_words_extraction":
            build, lo, valid = _fwe(task, cfg, rng, sample_seed, budget)
        else:
            build, lo = _qa(data, index, rng, sample_seed)
        draft, prompt_tokens, k = _fit(task, length, build, tokenizer, budget, lo, state.get("k"))
        if valid is not None and not valid(k):
            while k > lo and not valid(k):
                k -= 1
            draft = build(k)
            prompt_tokens = len(tokenizer.encode(draft.context + draft.question))
        state["k"] = k
        meta = dict(draft.meta)
        meta.update(
            {
                "seed": seed,
                "index": index,
                "size": k,
                "prompt_tokens": prompt_tokens,
                "context_tokens": len(tokenizer.encode(draft.context)),
                "budget": budget,
                "tokens_to_generate": ttg,
                "metric": METRICS[task],
            }
        )
        samples.append(
            Sample(
                id=f"{task}-{length}-{index}",
                task=task,
                length=length,
                context=draft.context,
                question=draft.question,
                golds=draft.golds,
                meta=meta,
            )
        )
    return samples


__all__ = [
    "CONFIG",
    "DATA_FILES",
    "DATA_TASKS",
    "DATASETS",
    "LOCAL_TASKS",
    "METRICS",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "Sample",
    "essay_passage",
    "essay_words",
    "generate",
]


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    """RULER's official per-sample score (string_match_all, or string_match_part for qa)."""
    from hybridkv.eval.scoring import score_ruler

    return score_ruler(task, prediction, golds)
