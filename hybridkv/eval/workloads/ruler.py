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
  Paul Graham's essays: it is a pseudo-essay of grammatical sentences built from the built-in word
  lists by a fixed-seed generator (`essay`, the lists in `words`). Like the essays it is one fixed
  text that every sample reads from its start, whatever the seed; it holds no digits and no
  hyphens, so no needle key or value can occur in it by accident.
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

This module holds the task table and the public functions; the generators are `ruler_tasks`
(niah, vt, cwe, fwe) and `ruler_qa` (qa), assembled and fitted by `ruler_build`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hybridkv.errors import HybridKVError
from hybridkv.eval.scoring import RULER_TASK_ORDER
from hybridkv.eval.workloads.base import Sample, Workload
from hybridkv.eval.workloads.essay import essay_passage, essay_words
from hybridkv.eval.workloads.ruler_build import NOISE, Job, Plan, fit
from hybridkv.eval.workloads.ruler_qa import DATA_FILES, DATASETS, qa, qa_data
from hybridkv.eval.workloads.ruler_tasks import DEPTHS, VT_INTRO, cwe, fwe, niah, vt, vt_question
from hybridkv.eval.workloads.words import ADJECTIVES, ADVERBS, NOUNS, PREPOSITIONS, VERBS, WORDS

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
_GENERATORS: dict[str, Callable[[Job], Plan]] = {
    "niah": niah,
    "variable_tracking": vt,
    "common_words_extraction": cwe,
    "freq_words_extraction": fwe,
    "qa": qa,
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
    ttg = TOKENS_TO_GENERATE[task]
    budget = length - ttg
    if budget <= 0:
        raise HybridKVError(f"{task}: length {length} leaves no room for the prompt ({ttg} tokens to generate)")
    data = qa_data(task, cfg["dataset"], data_path, n) if cfg["family"] == "qa" else None
    state: dict = {}  # carried from sample to sample: fit guesses, cwe's setting
    samples = []
    for index in range(n):
        sample_seed = f"ruler|{task}|{seed}|{index}"
        rng = random.Random(sample_seed)
        job = Job(task, cfg, sample_seed, rng, tokenizer, length, budget, ttg, state, index, data)
        samples.append(_sample(job, seed))
    return samples


def _sample(job: Job, seed: int) -> Sample:
    """One sample: its task's plan at the largest haystack size that fits the budget."""
    plan = _GENERATORS[job.cfg["family"]](job)
    lo, guess = plan.smallest, job.state.get("k")
    draft, prompt_tokens, k = fit(job.task, plan.build, job.tokenizer, job.budget, job.tokens_to_generate, lo, guess)
    if plan.valid is not None and not plan.valid(k):
        while k > lo and not plan.valid(k):
            k -= 1
        draft = plan.build(k)
        prompt_tokens = len(job.tokenizer.encode(draft.context + draft.question))
    job.state["k"] = k
    meta = dict(draft.meta)
    meta.update(
        {
            "seed": seed,
            "index": job.index,
            "size": k,
            "prompt_tokens": prompt_tokens,
            "context_tokens": len(job.tokenizer.encode(draft.context)),
            "budget": job.budget,
            "tokens_to_generate": job.tokens_to_generate,
            "metric": METRICS[job.task],
        }
    )
    return Sample(
        id=f"{job.task}-{job.length}-{job.index}",
        task=job.task,
        length=job.length,
        context=draft.context,
        question=draft.question,
        golds=draft.golds,
        meta=meta,
    )


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    """RULER's official per-sample score (string_match_all, or string_match_part for qa)."""
    from hybridkv.eval.scoring import score_ruler

    return score_ruler(task, prediction, golds)


WORKLOAD = Workload(name="ruler", tasks=TASKS, default_tasks=LOCAL_TASKS, generate=generate, score=score)

__all__ = [
    "ADJECTIVES",
    "ADVERBS",
    "CONFIG",
    "DATASETS",
    "DATA_FILES",
    "DATA_TASKS",
    "DEPTHS",
    "LOCAL_TASKS",
    "METRICS",
    "NOISE",
    "NOUNS",
    "PREPOSITIONS",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "VERBS",
    "VT_INTRO",
    "WORDS",
    "WORKLOAD",
    "Sample",
    "essay_passage",
    "essay_words",
    "generate",
    "score",
    "vt_question",
]
