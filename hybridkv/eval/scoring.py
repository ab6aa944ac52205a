"""Task scores recomputed from stored predictions: RULER and LongBench v1 (brief §4).

Pure Python, no torch. Every function scores ONE sample and returns a float in [0, 1]; the
official scripts report the mean × 100 per task, which the caller does if it wants to.

Sources reimplemented here (read, not copied):

* RULER — NVIDIA/RULER ``scripts/eval/synthetic/constants.py`` and ``scripts/eval/evaluate.py``:
  a gold counts when ``gold.lower() in prediction.lower()``; ``string_match_all`` is the
  fraction of golds found, ``string_match_part`` is 1 if any gold is found (the qa tasks). The
  prediction is first stripped, its control characters ``[\\x00-\\x1f]`` turned into newlines,
  and stripped again (``postprocess_pred``).
* LongBench v1 — THUDM/LongBench ``LongBench/metrics.py`` and ``LongBench/eval.py``, plus the
  two libraries it calls: the ``rouge`` package 1.0.1 (pltrdy/rouge) and ``fuzzywuzzy`` 0.18
  without python-Levenshtein (LongBench's requirements do not list it, so ``fuzz.ratio`` runs
  on ``difflib.SequenceMatcher``).

Deliberate differences from the official LongBench code, each because a dependency is absent:

* **Chinese tokenisation.** The official ``qa_f1_zh_score`` and ``rouge_zh_score`` segment with
  jieba, which is not available here. We tokenise Chinese at the character level instead
  (every character is a token, after the official per-token Chinese normalisation). For text
  that is all Han characters this gives character-level F1 / ROUGE-L, which is usually a little
  higher than jieba's word-level score; a run of Latin letters or digits becomes one token per
  character rather than one word. Scores on multifieldqa_zh, dureader and vcsum are therefore
  comparable across methods within hybridkv, but not digit-for-digit with published numbers.
* **ROUGE-L** is reimplemented to reproduce the ``rouge`` package's ``rouge-l`` "f" exactly,
  including its quirks (see ``rouge_score``), with one exception: the package rebuilds the LCS
  recursively, so a sentence pair whose word counts add up to roughly 1,000 or more raises
  RecursionError, which LongBench's bare ``except`` turns into a score of 0. We rebuild the LCS
  iteratively and score such pairs properly.
* **code_sim** uses ``difflib.SequenceMatcher`` directly (what fuzzywuzzy falls back to); with
  python-Levenshtein installed fuzzywuzzy would use a Levenshtein-based ratio, which can differ.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

# --------------------------------------------------------------------------------------------
# RULER
# --------------------------------------------------------------------------------------------

# The 13 RULER tasks in RULER's order (the workload generator uses this list too).
RULER_TASK_ORDER = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
RULER_TASKS = frozenset(RULER_TASK_ORDER)
RULER_PART_TASKS = frozenset({"qa_1", "qa_2"})
RULER_ALL_TASKS = RULER_TASKS - RULER_PART_TASKS

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip again."""
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


def _ruler_hits(prediction: str, golds: Sequence[str]) -> list[bool]:
    if isinstance(golds, str) or len(golds) == 0:
        raise ValueError("RULER scoring needs a non-empty list of gold strings")
    lowered = prediction.lower()
    return [gold.lower() in lowered for gold in golds]


def string_match_all(prediction: str, golds: Sequence[str]) -> float:
    """Fraction of the golds that occur in the prediction, case-insensitively (substring match)."""
    hits = _ruler_hits(prediction, golds)
    return sum(hits) / len(hits)


def string_match_part(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if any gold occurs in the prediction, case-insensitively, else 0.0 (RULER's qa tasks)."""
    return 1.0 if any(_ruler_hits(prediction, golds)) else 0.0


def score_ruler(task: str, prediction: str, golds: Sequence[str]) -> float:
    """One RULER sample: post-processed prediction, ``string_match_part`` for qa_1/qa_2,
    ``string_match_all`` for the 11 others."""
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {sorted(RULER_TASKS)}")
    metric = string_match_part if task in RULER_PART_TASKS else string_match_all
    return metric(ruler_postprocess(prediction), golds)


# --------------------------------------------------------------------------------------------
# LongBench v1: normalisation and token F1
# --------------------------------------------------------------------------------------------

_ASCII_PUNCTUATION = frozenset(string.punctuation)
# The Chinese punctuation set of LongBench's normalize_zh_answer, character for character.
_CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: E501 (the official set, one line)
_ZH_PUNCTUATION = _ASCII_PUNCTUATION | frozenset(_CN_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD English normalisation, in the official order: lowercase, drop ASCII
    punctuation, replace the words a/an/the by a space, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """LongBench Chinese normalisation: lowercase, drop ASCII and Chinese punctuation, delete
    all whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def token_f1(prediction_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Multiset token F1; 0 when nothing is shared (so also when either side is empty)."""
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, gold: str, **_: object) -> float:
    """Token F1 between the English-normalised prediction and gold (whitespace tokens)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def _zh_tokens(text: str) -> list[str]:
    # Official: jieba words, each normalised, empties dropped. Here: characters instead of
    # jieba words (jieba is unavailable), with the same per-token normalisation.
    tokens = (normalize_zh_answer(ch) for ch in text)
    return [token for token in tokens if token]


def qa_f1_zh_score(prediction: str, gold: str, **_: object) -> float:
    """Chinese token F1 — CHARACTER-level, not jieba words as in the official metric.

    jieba is not available, so each character is a token; each is normalised as the official
    code normalises jieba tokens (lowercase, Chinese/ASCII punctuation and whitespace removed)
    and empty tokens are dropped. See the module docstring for how this compares.
    """
    return token_f1(_zh_tokens(prediction), _zh_tokens(gold))


# --------------------------------------------------------------------------------------------
# LongBench v1: ROUGE-L as the `rouge` package computes it
# --------------------------------------------------------------------------------------------


def _rouge_sentences(text: str) -> list[str]:
    # The package splits on "." only, keeps pieces that are non-empty BEFORE whitespace is
    # collapsed (so a whitespace-only piece survives as ""), and collapses whitespace.
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _lcs_words(reference: list[str], candidate: list[str]) -> set[str]:
    """The words of one LCS of two word lists, rebuilt as the package rebuilds it (ties go
    towards a shorter candidate prefix), as a set."""
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        word = reference[i - 1]
        above, here = table[i - 1], table[i]
        for j in range(1, cols + 1):
            if word == candidate[j - 1]:
                here[j] = above[j - 1] + 1
            else:
                here[j] = max(above[j], here[j - 1])
    words: set[str] = set()
    i, j = rows, cols
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            words.add(reference[i - 1])
            i -= 1
            j -= 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_score(prediction: str, gold: str, **_: object) -> float:
    """ROUGE-L F as LongBench gets it from ``Rouge().get_scores(...)["rouge-l"]["f"]``.

    That is the ``rouge`` package's summary-level ROUGE-L with its default ``exclusive=True``,
    which is NOT the textbook token ROUGE-L:

    * both texts are split into sentences on "." only; words are split on single spaces after
      whitespace is collapsed; no lowercasing, no other punctuation handling;
    * m and n are the numbers of DISTINCT words in the gold and the prediction;
    * the overlap is the number of distinct words in the union, over every (gold sentence,
      predicted sentence) pair, of the words of one LCS of the pair;
    * F = 2PR / (P + R + 1e-8) with R = overlap / m and P = overlap / n — so identical texts
      score 0.999999995, not 1;
    * a text with no sentence (empty, or only dots) makes the package raise, which LongBench
      turns into 0.0.

    Difference: we never hit the package's RecursionError on very long sentence pairs (the
    official score is then 0.0); see the module docstring.
    """
    pred_sentences = _rouge_sentences(prediction)
    gold_sentences = _rouge_sentences(gold)
    if not pred_sentences or not gold_sentences:
        return 0.0
    pred_split = [sentence.split(" ") for sentence in pred_sentences]
    gold_split = [sentence.split(" ") for sentence in gold_sentences]
    m = len({word for words in gold_split for word in words})
    n = len({word for words in pred_split for word in words})
    union: set[str] = set()
    for gold_words in gold_split:
        for pred_words in pred_split:
            union |= _lcs_words(gold_words, pred_words)
    recall = len(union) / m
    precision = len(union) / n
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def rouge_zh_score(prediction: str, gold: str, **_: object) -> float:
    """``rouge_score`` over space-joined CHARACTERS (the official joins jieba words instead)."""
    return rouge_score(" ".join(prediction), " ".join(gold))


# --------------------------------------------------------------------------------------------
# LongBench v1: classification, retrieval, count, code
# --------------------------------------------------------------------------------------------


def classification_score(prediction: str, gold: str, *, all_classes: Sequence[str] | None = None, **_: object) -> float:
    """LongBench's classification score (trec, lsht), quirks included.

    1. Matches: every class name that is a (case-sensitive) substring of the prediction, in the
       order of ``all_classes``.
    2. Matches that are substrings of the gold but not the gold itself are removed — by a loop
       that removes from the list it walks, so the match right after a removed one is never
       examined and stays. We reproduce that skip.
    3. 1 / len(matches) if the gold is among them, else 0.
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes")
    matches = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in gold and term != gold:
            matches.remove(term)  # first occurrence, as list.remove does in the official loop
        i += 1  # the official for-loop advances regardless, skipping the shifted-in element
    return 1.0 / len(matches) if gold in matches else 0.0


_DIGITS = re.compile(r"\d+")


def _fraction_equal(numbers: list[str], target: str) -> float:
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


def _retrieval(prediction: str, gold: str, pattern: re.Pattern[str]) -> float:
    found = pattern.findall(gold)
    if not found:
        raise ValueError(f"gold {gold!r} names no paragraph (pattern {pattern.pattern!r})")
    return _fraction_equal(_DIGITS.findall(prediction), found[0])


_PARAGRAPH_EN = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ZH = re.compile(r"段落(\d+)")


def retrieval_score(prediction: str, gold: str, **_: object) -> float:
    """Share of the numbers in the prediction that equal N of the gold's first "Paragraph N"
    (compared as digit strings, so "07" is not "7"); 0 when the prediction has no number."""
    return _retrieval(prediction, gold, _PARAGRAPH_EN)


def retrieval_zh_score(prediction: str, gold: str, **_: object) -> float:
    """As ``retrieval_score`` with the gold's first "段落N"."""
    return _retrieval(prediction, gold, _PARAGRAPH_ZH)


def count_score(prediction: str, gold: str | int, **_: object) -> float:
    """Share of the numbers in the prediction equal to the gold count (as digit strings)."""
    return _fraction_equal(_DIGITS.findall(prediction), str(gold))


def code_first_line(prediction: str) -> str:
    """The line LongBench compares for code: after leading newlines are stripped, the first line
    containing none of "`", "#", "//" anywhere (not only at its start); "" if there is none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` on its difflib path: 100 if equal (so also both empty), 0 if
    one is empty, else round(100 × SequenceMatcher(None, a, b).ratio()) — Python's round, as
    fuzzywuzzy's ``intr``. Order matters: difflib's ratio is not always symmetric."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, gold: str, **_: object) -> float:
    """``fuzz_ratio(code_first_line(prediction), gold) / 100`` (lcc, repobench-p)."""
    return fuzz_ratio(code_first_line(prediction), gold) / 100


# --------------------------------------------------------------------------------------------
# LongBench v1: per-dataset scoring as eval.py does it
# --------------------------------------------------------------------------------------------

Metric = Callable[..., float]

DATASET_METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

# eval.py keeps only the first line of the prediction for these (few-shot tasks whose models
# tend to continue with the next example).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def _base_dataset(dataset: str) -> str:
    if dataset in DATASET_METRIC:
        return dataset
    # LongBench-E files are named "<dataset>_e"; they are scored like the dataset itself.
    if dataset.endswith("_e") and dataset[:-2] in DATASET_METRIC:
        return dataset[:-2]
    raise ValueError(f"unknown LongBench dataset {dataset!r}; known: {sorted(DATASET_METRIC)}")


def score_longbench(
    dataset: str, prediction: str, golds: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One LongBench v1 sample as eval.py's ``scorer`` scores it, in [0, 1]: the first-line rule
    for trec/triviaqa/samsum/lsht, then the max of the dataset's metric over the golds (0 when
    there is no gold)."""
    dataset = _base_dataset(dataset)
    if isinstance(golds, str):
        raise TypeError("golds must be a list of strings, not one string")
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET_METRIC[dataset]
    score = 0.0
    for gold in golds:
        score = max(score, float(metric(prediction, gold, all_classes=all_classes)))
    return score
