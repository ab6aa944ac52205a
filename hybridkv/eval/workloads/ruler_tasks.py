"""RULER's synthetic task generators: needle in a haystack (niah), variable tracking (vt), common
and frequent words extraction (cwe, fwe). Each turns a `Job` into a `Plan` (see `ruler_build`);
the prompts' wording follows RULER's templates, the deviations are listed in `ruler`.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.errors import HybridKVError
from hybridkv.eval.workloads.essay import Stream, essay_words, sentences
from hybridkv.eval.workloads.ruler_build import Draft, Job, Plan, draw_distinct, fit, insert, join, noise_lines
from hybridkv.eval.workloads.words import ADJECTIVES, NOUNS, WORDS

# RULER's needle depths: 40 points from 0 to 100 percent.
DEPTHS = tuple(round(100 * i / 39) for i in range(40))

# ---------------------------------------------------------------------------------------------
# niah


def draw_value(kind: str, rng: random.Random, taken: set[str], keys: list[str] = ()) -> str:
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


@dataclass
class _Needles:
    keys: list[str]
    needles: list[tuple[str, str]]  # (key, value), in the order they are placed
    queries: list[str]  # the keys asked for
    golds: list[str]  # their values
    taken: set[str]  # every key and value drawn (distractors draw others)


def _draw_needles(cfg: dict, rng: random.Random) -> _Needles:
    num_v, num_q = cfg["nv"], cfg["nq"]
    num_k = max(cfg["nk"], num_q)
    taken: set[str] = set()
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[tuple[str, str]] = []
    for _ in range(num_k):
        keys.append(draw_value(cfg["k"], rng, taken, keys))
        values.append([])
        for _ in range(num_v):
            values[-1].append(draw_value(cfg["v"], rng, taken))
            needles.append((keys[-1], values[-1][-1]))
    rng.shuffle(needles)
    query_index = rng.sample(range(num_k), num_q)
    golds = [v for i in query_index for v in values[i]]
    return _Needles(keys, needles, [keys[i] for i in query_index], golds, taken)


def _needle_text(type_v: str, key: str, value: str) -> str:
    return f"One of the special magic {type_v} for {key} is: {value}."


def _niah_wording(type_v: str, queries: list[str], single: bool) -> tuple[str, str, str]:
    """RULER's template (made singular when one value is asked for): the preamble, the question
    and its answer prefix."""
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    noun = type_v[:-1] if single else type_v
    preamble = (
        f"{'A' if single else 'Some'} special magic {noun} {'is' if single else 'are'} hidden within the following "
        f"text. Make sure to memorize it. I will quiz you about the {noun} afterwards.\n"
    )
    ask = "What is the" if single else "What are all the"
    answer_prefix = f" The special magic {noun} for {query} mentioned in the provided text {'is' if single else 'are'}"
    return (
        preamble,
        f"\n{ask} special magic {noun} for {query} mentioned in the provided text?{answer_prefix}",
        (answer_prefix),
    )


def _haystack_units(cfg: dict, drawn: _Needles, sample_seed: str) -> Callable[[int], list[str]]:
    """The haystack's first k units: essay sentences, noise lines or distractor needles."""
    if cfg["haystack"] == "essay":
        return lambda k: sentences(essay_words(k))
    if cfg["haystack"] == "noise":
        return noise_lines
    d_rng = random.Random(f"{sample_seed}|distractors")

    def distractor() -> list[str]:
        key = draw_value(cfg["k"], d_rng, drawn.taken, drawn.keys)
        return [_needle_text(cfg["v"], key, draw_value(cfg["v"], d_rng, drawn.taken))]

    return Stream(distractor).take


def niah(job: Job) -> Plan:
    cfg, rng, haystack = job.cfg, job.rng, job.cfg["haystack"]
    drawn = _draw_needles(cfg, rng)
    texts = [_needle_text(cfg["v"], k, v) for k, v in drawn.needles]
    preamble, question, answer_prefix = _niah_wording(cfg["v"], drawn.queries, cfg["nq"] * cfg["nv"] == 1)
    if haystack == "essay":
        depth_percents, fractions = sorted(rng.sample(DEPTHS, len(texts))), None
    else:
        depth_percents, fractions = None, sorted(rng.random() for _ in texts)
    units_of = _haystack_units(cfg, drawn, job.seed)

    def build(k: int) -> Draft:
        units = units_of(k)
        if haystack == "essay":
            positions = [int(len(units) * (d / 100)) for d in depth_percents]
        else:
            positions = [int(f * len(units)) for f in fractions]
        items, where = insert(units, list(zip(positions, texts, strict=True)))
        body, offsets = join(items, " " if haystack == "essay" else "\n", len(preamble))
        needle_meta = []
        for i, ((key, value), text) in enumerate(zip(drawn.needles, texts, strict=True)):
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
            "query_keys": drawn.queries,
            "answer_prefix": answer_prefix,
        }
        return Draft(preamble + body, question, list(drawn.golds), meta)

    return Plan(build, 1)


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
        value = draw_distinct(lambda: str(rng.randint(10000, 99999)), taken)
        names.append(these)
        links = [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)]
        chains.append([f"VAR {these[0]} = {value}", *links])
    return names, chains


def _vt_body(chains: list[list[str]], fractions: list[list[float]], k: int, start: int):
    """The noise haystack with the chains inserted in order (RULER: sorted random line indices,
    the j-th link at index + j). Returns the text and each link's offset and line index."""
    items = [(line, None) for line in noise_lines(k)]
    for c, chain in enumerate(chains):
        positions = [int(f * len(items)) for f in fractions[c]]
        for j in reversed(range(len(chain))):  # from the last, so earlier positions stay valid
            items.insert(positions[j], (chain[j], (c, j)))
    text, offsets = join([t for t, _ in items], "\n", start)
    links = {tag: (offsets[i], i) for i, (_, tag) in enumerate(items) if tag is not None}
    return text, links, len(items)


def _vt_example(job: Job, taken: set[str]) -> str:
    """The in-context example, answered: 3-letter names, at most 10 hops, its prompt within 500 tokens."""
    num_chains, hops = job.cfg["num_chains"], min(10, job.cfg["num_hops"])
    names, chains = _vt_chains(job.rng, num_chains, hops, 3, taken)
    fractions = [sorted(job.rng.random() for _ in chain) for chain in chains]
    question, _ = vt_question(chains[0][0].split("=")[-1].strip(), hops + 1)

    def build(k: int) -> Draft:
        body, _, _ = _vt_body(chains, fractions, k, 0)
        return Draft(VT_INTRO + body, question, [], {})

    example, _, k = fit(job.task, build, job.tokenizer, 500, job.tokens_to_generate, 1, job.state.get("icl_k"))
    job.state["icl_k"] = k
    return example.context + example.question + " " + " ".join(names[0]) + "\n"


def vt(job: Job) -> Plan:
    num_chains, num_hops = job.cfg["num_chains"], job.cfg["num_hops"]
    taken: set[str] = set()
    names, chains = _vt_chains(job.rng, num_chains, num_hops, 5, taken)
    fractions = [sorted(job.rng.random() for _ in chain) for chain in chains]
    value = chains[0][0].split("=")[-1].strip()
    question, answer_prefix = vt_question(value, num_hops + 1)
    example = _vt_example(job, taken)
    preamble = example + "\n" + VT_INTRO
    icl_tokens = len(job.tokenizer.encode(example))

    def build(k: int) -> Draft:
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
        return Draft(preamble + body, question, list(names[0]), meta)

    return Plan(build, 1)


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


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.randint(2, 4)
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(syllables))


def _word_list(words: list[str], num_cw: int, common_repeats: int, uncommon_repeats: int, shuffle_seed: str):
    """The first num_cw words repeated common_repeats times, the rest uncommon_repeats times,
    shuffled and numbered; and the common words."""
    common, uncommon = words[:num_cw], words[num_cw:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(shuffle_seed).shuffle(listed)
    return _numbered(listed), common


def _word_pool(rng: random.Random, sample_seed: str) -> Stream:
    """The built-in words in a seeded order, then seeded pseudo-words none of them equals."""
    order = list(WORDS)
    rng.shuffle(order)
    pseudo_rng = random.Random(f"{sample_seed}|pseudo")
    known = set(WORDS)

    def more_words() -> list[str]:
        if not order:
            return [draw_distinct(lambda: _pseudo_word(pseudo_rng), known)]
        batch = order[:]
        order.clear()
        return batch

    return Stream(more_words)


def _cwe_plan(cfg: dict, rng: random.Random, sample_seed: str, setting: str) -> Plan:
    num_cw = cfg["num_cw"]
    ex_words, ex_rc, ex_ru, rc, ru = _CWE_SETTINGS[setting]
    if setting == "long":
        rc, ru = cfg["freq_cw"], cfg["freq_ucw"]
    shot_list, shot_answer = _word_list(rng.sample(WORDS, ex_words), num_cw, ex_rc, ex_ru, f"{sample_seed}|shot")
    shot = _CWE_TEMPLATE + shot_list + _CWE_QUESTION + " " + _numbered(shot_answer)
    preamble = shot + "\n" + _CWE_TEMPLATE
    pool = _word_pool(rng, sample_seed)

    def build(k: int) -> Draft:
        listed, common = _word_list(pool.take(k), num_cw, rc, ru, f"{sample_seed}|list")
        meta = {
            "setting": setting,
            "freq_cw": rc,
            "freq_ucw": ru,
            "num_words": k,
            "haystack_offset": len(preamble),
            "answer_prefix": _CWE_ANSWER_PREFIX,
        }
        return Draft(preamble + listed, _CWE_QUESTION, common, meta)

    return Plan(build, 2 * num_cw)


def cwe(job: Job) -> Plan:
    """RULER's long setting from 4096 tokens on, the short one below; the short one too where the
    long one cannot fit at all (then for the call's later samples as well)."""
    setting = job.state.get("cwe_setting", "long" if job.length >= 4096 else "short")
    plan = _cwe_plan(job.cfg, job.rng, job.seed, setting)
    if setting == "long":
        probe = plan.build(plan.smallest)
        if len(job.tokenizer.encode(probe.context + probe.question)) > job.budget:
            setting = "short"
            plan = _cwe_plan(job.cfg, random.Random(job.seed), job.seed, setting)
    job.state["cwe_setting"] = setting
    return plan


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


def _zeta(alpha: float, terms: int = 2000) -> float:
    """Riemann zeta for alpha > 1 (RULER: scipy.special.zeta), Euler-Maclaurin tail."""
    head = sum(k**-alpha for k in range(1, terms))
    n = float(terms)
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12


def _fwe_counts(num_words: int, vocab_size: int, alpha: float) -> list[int]:
    z = _zeta(alpha)
    return [int(num_words * (k**-alpha) / z) for k in range(1, vocab_size + 1)]


def fwe(job: Job) -> Plan:
    alpha, wordlen, rng = job.cfg["alpha"], job.cfg["coded_wordlen"], job.rng
    vocab_size = job.budget // 50
    if vocab_size < 5:
        raise HybridKVError(f"{job.task}: the length is too short; fwe needs at least 5 coded words (250 tokens)")
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

    def build(k: int) -> Draft:
        counts = _fwe_counts(k, vocab_size, alpha)
        words = [w for w, c in zip(ranked, counts, strict=True) for _ in range(c)]
        random.Random(f"{job.seed}|shuffle").shuffle(words)
        meta = {
            "num_words": k,
            "vocab_size": vocab_size,
            "counts": dict(zip(ranked[:4], counts[:4], strict=True)),
            "haystack_offset": len(_FWE_TEMPLATE),
            "answer_prefix": _FWE_ANSWER_PREFIX,
        }
        return Draft(_FWE_TEMPLATE + " ".join(words), _FWE_QUESTION, list(golds), meta)

    return Plan(build, lo, valid)


__all__ = ["DEPTHS", "VT_INTRO", "cwe", "draw_value", "fwe", "niah", "vt", "vt_question"]
