"""RULER workload generator (hybridkv.eval.workloads.ruler) and frozen JSONL (….frozen).

Every check recomputes what it verifies from the prompt text itself (needle places, chains,
word counts) rather than trusting the generator's metadata.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import pytest

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.workloads import Sample, ruler
from hybridkv.eval.workloads.frozen import checksum, freeze, load_frozen
from hybridkv.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
SEEDS = (0, 1, 7)
N = 3
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")


def _lengths(task: str) -> tuple[int, ...]:
    # cwe's smallest prompt (RULER's 20-word worked example plus 10 words x 6) needs ~1.8K bytes.
    return (2048, 4096) if task == "cwe" else (1024, 4096)


_CACHE: dict[tuple, list[Sample]] = {}


def _samples(task: str, length: int, seed: int, n: int = N) -> list[Sample]:
    key = (task, length, seed, n)
    if key not in _CACHE:
        _CACHE[key] = ruler.generate(task, length, n, TOK, seed=seed)
    return _CACHE[key]


LOCAL_CASES = [(t, length, seed) for t in ruler.LOCAL_TASKS for length in _lengths(t) for seed in SEEDS]


def test_task_lists():
    assert len(ruler.TASKS) == 13
    assert ruler.DATA_TASKS == ("qa_1", "qa_2")
    assert len(ruler.LOCAL_TASKS) == 11 and set(ruler.LOCAL_TASKS) | set(ruler.DATA_TASKS) == set(ruler.TASKS)
    assert ruler.TOKENS_TO_GENERATE["niah_single_1"] == 128
    assert ruler.TOKENS_TO_GENERATE["niah_multiquery"] == 128
    assert (ruler.TOKENS_TO_GENERATE["vt"], ruler.TOKENS_TO_GENERATE["cwe"]) == (30, 120)
    assert (ruler.TOKENS_TO_GENERATE["fwe"], ruler.TOKENS_TO_GENERATE["qa_1"], ruler.TOKENS_TO_GENERATE["qa_2"]) == (
        50,
        32,
        32,
    )
    assert ruler.METRICS["qa_2"] == "string_match_part" and ruler.METRICS["vt"] == "string_match_all"


# ---------------------------------------------------------------------------------------------
# Per-task checks: each returns nothing and asserts on one sample.


def _haystack(sample: Sample) -> str:
    return sample.context[sample.meta["haystack_offset"] :]


def _units_before(sample: Sample, offset: int, needle_texts: list[str]) -> int:
    """Haystack units (noise lines, distractor needles, essay sentences) before `offset`,
    counted from the text with the real needles taken out."""
    before = sample.context[sample.meta["haystack_offset"] : offset]
    if sample.meta["haystack"] == "essay":
        for text in needle_texts:
            before = before.replace(text, " ")
        words = before.split()
        return sum(w.endswith(".") for w in words) + (1 if words and not words[-1].endswith(".") else 0)
    lines = before.split("\n")
    assert lines[-1] == "", "a needle starts a line"
    return sum(1 for line in lines[:-1] if line not in needle_texts)


def check_niah(sample: Sample) -> None:
    cfg = ruler.CONFIG[sample.task]
    meta = sample.meta
    needles = meta["needles"]
    texts = [n["text"] for n in needles]
    assert len(needles) == max(cfg["nk"], cfg["nq"]) * cfg["nv"]
    hay = _haystack(sample)
    # The haystack is what the task says it is.
    if cfg["haystack"] == "noise":
        lines = [line for line in hay.split("\n") if line not in texts]
        assert all(ruler.NOISE.startswith(line) for line in lines) and lines[0] == ruler.NOISE
        assert all(line == ruler.NOISE for line in lines[:-1])
    elif cfg["haystack"] == "essay":
        stripped = hay
        for text in texts:
            stripped = stripped.replace(text, " ")
        assert not re.search(r"[0-9-]", stripped), "essay haystack must not hold digits or hyphens"
        assert " ".join(stripped.split()).startswith(" ".join(ruler.essay_words(20)))
    else:
        assert all(NEEDLE_RE.fullmatch(line) for line in hay.split("\n"))
    for needle in needles:
        key, value, offset = needle["key"], needle["value"], needle["offset"]
        assert needle["text"] == f"One of the special magic {cfg['v']} for {key} is: {value}."
        assert sample.context[offset : offset + len(needle["text"])] == needle["text"]
        assert sample.context.count(value) == 1, "each value is in the haystack exactly once"
        assert sample.context.count(f"for {key} is:") == cfg["nv"]
        assert _units_before(sample, offset, texts) == needle["unit_index"]
        assert needle["depth"] == pytest.approx(needle["unit_index"] / meta["num_units"])
        if cfg["haystack"] == "essay":
            assert needle["depth_percent"] in ruler.DEPTHS
            assert needle["unit_index"] == int(meta["num_units"] * (needle["depth_percent"] / 100))
        else:
            assert 0 <= needle["unit_index"] < meta["num_units"]
    assert meta["offsets"] == sorted(meta["offsets"]) == [n["offset"] for n in needles]
    # Every haystack unit is counted.
    if cfg["haystack"] == "essay":
        assert _units_before(sample, len(sample.context), texts) == meta["num_units"]
    else:
        assert len([line for line in hay.split("\n") if line not in texts]) == meta["num_units"]
    # The question asks for the queried keys; the golds are exactly their values.
    queries = meta["query_keys"]
    assert len(queries) == cfg["nq"] and len(set(queries)) == cfg["nq"]
    for q in queries:
        assert q in sample.question and q not in sample.context.replace(f"for {q} is:", "")
    by_key: dict[str, list[str]] = {}
    for needle in needles:
        by_key.setdefault(needle["key"], []).append(needle["value"])
    assert sorted(sample.golds) == sorted(v for q in queries for v in by_key[q])
    assert len(sample.golds) == cfg["nq"] * cfg["nv"]
    # Distractors (other real needles, and the needle haystack) never share a queried key or value.
    every = NEEDLE_RE.findall(sample.context)
    for _, key, value in every:
        if key not in queries:
            assert value not in sample.golds
            assert all(q not in key and key not in q for q in queries)
    assert len({v for _, _, v in every}) == len(every), "values are unique"
    if cfg["nv"] == 1:
        assert len({k for _, k, _ in every}) == len(every), "keys are unique"
    # Template: RULER's, singular when one value is asked for.
    single = cfg["nq"] * cfg["nv"] == 1
    noun = cfg["v"][:-1] if single else cfg["v"]
    head = "A special magic" if single else "Some special magic"
    assert sample.context.startswith(f"{head} {noun} {'is' if single else 'are'} hidden within the following text.")
    ask = "What is the" if single else "What are all the"
    assert sample.question.startswith(f"\n{ask} special magic {noun} for ")
    assert sample.question.endswith(f"mentioned in the provided text {'is' if single else 'are'}")


def check_vt(sample: Sample) -> None:
    value = re.search(r"assigned the value (\d+) in the text above", sample.question).group(1)
    assert sample.question.endswith(f"5 variables are assigned the value {value}, they are: ")
    # Follow the assignments in the task's own part (after the in-context example).
    part = sample.context[sample.context.rindex("Memorize and track the chain(s)") :]
    assigned: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", part):
        assert name not in assigned
        assigned[name] = rhs

    def resolve(name: str) -> str:
        rhs = assigned[name]
        return resolve(rhs[4:]) if rhs.startswith("VAR ") else rhs

    holders = {name for name in assigned if resolve(name) == value}
    assert holders == set(sample.golds) and len(sample.golds) == 5
    for link in sample.meta["chains"][0]:
        assert sample.context[link["offset"] : link["offset"] + len(link["text"])] == link["text"]
    assert sample.meta["offsets"] == sorted(sample.meta["offsets"])
    # The in-context example answers its own (different) chain.
    icl = sample.context[: sample.context.rindex("Memorize and track the chain(s)")]
    icl_value = re.search(r"assigned the value (\d+) in the text above", icl).group(1)
    assert icl_value != value and all(g not in icl for g in sample.golds)
    noise = [line for line in _haystack(sample).split("\n") if not line.startswith("VAR ")]
    assert all(ruler.NOISE.startswith(line) for line in noise)


def check_cwe(sample: Sample) -> None:
    listed = _haystack(sample)
    assert sample.context[: sample.meta["haystack_offset"]].endswith("Memorize the ones that appear most often.\n")
    words = re.findall(r"(\d+)\. (\S+)", listed)
    assert [int(i) for i, _ in words] == list(range(1, len(words) + 1))
    counts = Counter(w for _, w in words)
    golds = sample.golds
    assert len(set(golds)) == 10
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(golds)
    assert min(counts[g] for g in golds) > max(c for w, c in counts.items() if w not in golds)
    assert {counts[g] for g in golds} == {sample.meta["freq_cw"]}
    assert sample.question.startswith("\nQuestion: What are the 10 most common words in the above list?")


def check_fwe(sample: Sample) -> None:
    counts = Counter(_haystack(sample).split())
    assert counts.most_common(1)[0][0] == "..."
    del counts["..."]
    ranked = counts.most_common()
    assert {w for w, _ in ranked[:3]} == set(sample.golds)
    fourth = ranked[3][1] if len(ranked) > 3 else 0
    assert min(counts[g] for g in sample.golds) > fourth
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)


CHECKS = {"variable_tracking": check_vt, "common_words_extraction": check_cwe, "freq_words_extraction": check_fwe}


def _min_tokens(sample: Sample) -> int:
    """The least prompt a fit may leave: a few percent under the budget, or one distractor
    needle under it where the haystack is made of whole needles (niah_multikey_2/3)."""
    budget = sample.meta["budget"]
    if ruler.CONFIG[sample.task].get("haystack") == "needle":
        longest = max(len(TOK.encode(line)) for line in _haystack(sample).split("\n"))
        return budget - longest - 1
    return int(0.97 * budget)


@pytest.mark.parametrize(("task", "length", "seed"), LOCAL_CASES)
def test_local_task(task: str, length: int, seed: int):
    samples = _samples(task, length, seed)
    assert [s.id for s in samples] == [f"{task}-{length}-{i}" for i in range(N)]
    ttg = ruler.TOKENS_TO_GENERATE[task]
    for sample in samples:
        assert sample.task == task and sample.length == length
        tokens = len(TOK.encode(sample.context + sample.question))
        assert tokens == sample.meta["prompt_tokens"]
        assert sample.meta["budget"] == length - ttg
        assert _min_tokens(sample) <= tokens <= length - ttg
        assert sample.meta["context_tokens"] == len(TOK.encode(sample.context))
        assert sample.question.endswith(sample.meta["answer_prefix"])
        assert sample.golds and all(isinstance(g, str) and g for g in sample.golds)
        assert all(g in sample.context for g in sample.golds)
        family = ruler.CONFIG[task]["family"]
        CHECKS.get(family, check_niah)(sample)


@pytest.mark.parametrize("task", ruler.LOCAL_TASKS)
def test_deterministic_and_seeded(task: str):
    length = _lengths(task)[0]
    again = ruler.generate(task, length, N, TOK, seed=0)
    assert again == _samples(task, length, 0)
    # Sample i does not depend on how many samples are asked for.
    assert ruler.generate(task, length, 2, TOK, seed=0) == again[:2]
    other = _samples(task, length, 1)
    assert all(a.context + a.question != b.context + b.question for a, b in zip(again, other, strict=True))
    assert all(a.golds != b.golds for a, b in zip(again, other, strict=True))
    # Samples within a call differ too.
    assert len({s.context + s.question for s in again}) == N


def test_ids_unique_across_tasks_and_lengths():
    ids = [s.id for (t, length, seed) in LOCAL_CASES if seed == 0 for s in _samples(t, length, seed)]
    assert len(ids) == len(set(ids))


def test_other_tokenizer_fits():
    """A coarser, word-level tokenizer: the fit still stays under the budget and close to it."""

    class WordTokenizer:
        name, vocab_size = "words", 1 << 20

        def encode(self, text: str) -> list[int]:
            return [hash(w) % 1000 for w in re.findall(r"\w+|[^\w\s]", text)]

        def decode(self, ids: list[int]) -> str:
            raise NotImplementedError

    tok = WordTokenizer()
    for task in ("niah_single_1", "niah_multikey_1", "vt", "cwe", "fwe"):
        for sample in ruler.generate(task, 4096, 2, tok, seed=3):
            tokens = len(tok.encode(sample.context + sample.question))
            assert tokens == sample.meta["prompt_tokens"]
            assert 0.97 * sample.meta["budget"] <= tokens <= sample.meta["budget"]
            assert all(g in sample.context for g in sample.golds)
    # At 4096 word-tokens, cwe fits RULER's long setting (30 / 3 repeats).
    assert ruler.generate("cwe", 4096, 1, tok)[0].meta["freq_cw"] == 30


def test_errors():
    with pytest.raises(HybridKVError, match="unknown RULER task"):
        ruler.generate("niah_single_9", 4096, 1, TOK)
    with pytest.raises(HybridKVError, match="too short"):
        ruler.generate("cwe", 1024, 1, TOK)
    with pytest.raises(HybridKVError, match="no room"):
        ruler.generate("niah_single_1", 100, 1, TOK)
    assert ruler.generate("niah_single_1", 4096, 0, TOK) == []


def test_essay_text():
    words = ruler.essay_words(3000)
    assert words == ruler.essay_words(3000) and words[:100] == ruler.essay_words(100)
    assert all(re.fullmatch(r"[A-Za-z]+[.,]?", w) for w in words), "no digits, hyphens or other marks"
    assert sum(w.endswith(".") for w in words) > 200 and words[0][0].isupper()
    assert len(set(words)) > 400


def test_needle_depths_spread():
    samples = ruler.generate("niah_single_2", 4096, 24, TOK, seed=5)
    depths = [s.meta["needles"][0]["depth_percent"] for s in samples]
    assert len(set(depths)) > 10 and min(depths) < 25 and max(depths) > 75
    noise = ruler.generate("niah_single_1", 4096, 24, TOK, seed=5)
    depths = [s.meta["depths"][0] for s in noise]
    assert len(set(depths)) > 10 and min(depths) < 0.25 and max(depths) > 0.75


# ---------------------------------------------------------------------------------------------
# qa: SQuAD / HotpotQA from a local file.

SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Danube flows through ten countries. It rises in the Black Forest.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "Where does the Danube rise?",
                            "answers": [{"text": "the Black Forest", "answer_start": 53}],
                            "is_impossible": False,
                        },
                        {"id": "q2", "question": "Who owns the Danube?", "answers": [], "is_impossible": True},
                    ],
                },
                {
                    "context": "The Rhine ends in the North Sea near Rotterdam.",
                    "qas": [
                        {
                            "id": "q3",
                            "question": "Where does the Rhine end?",
                            "answers": [
                                {"text": "the North Sea", "answer_start": 18},
                                {"text": "North Sea", "answer_start": 22},
                            ],
                            "is_impossible": False,
                        }
                    ],
                },
            ],
        },
        {
            "title": "Birds",
            "paragraphs": [
                {
                    "context": "Arctic terns migrate from pole to pole every year, the longest migration known.",
                    "qas": [
                        {
                            "id": "q4",
                            "question": "Which bird has the longest migration?",
                            "answers": [{"text": "Arctic terns", "answer_start": 0}],
                            "is_impossible": False,
                        }
                    ],
                },
                {"context": "Owls hunt at night with silent feathers.", "qas": []},
            ],
        },
    ],
}

HOTPOT = [
    {
        "_id": "h1",
        "question": "Which city hosts the museum founded by the painter of Blue Horse?",
        "answer": "Munich",
        "type": "bridge",
        "supporting_facts": [["Blue Horse", 0], ["Marc Museum", 0]],
        "context": [
            ["Blue Horse", ["Blue Horse was painted by Franz Marc. ", "It dates from 1911."]],
            ["Marc Museum", ["The Marc Museum, founded for Franz Marc, is near Munich."]],
            ["Rye", ["Rye is a grass grown as a grain."]],
        ],
    },
    {
        "_id": "h2",
        "question": "Are tulips and roses both flowers?",
        "answer": "yes",
        "type": "comparison",
        "supporting_facts": [["Tulip", 0], ["Rose", 0]],
        "context": [
            ["Tulip", ["The tulip is a flower of spring."]],
            ["Rose", ["A rose is a woody flowering plant."]],
            ["Granite", ["Granite is a coarse rock."]],
        ],
    },
]


@pytest.fixture
def qa_files(tmp_path):
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    (tmp_path / "hotpotqa.json").write_text(json.dumps(HOTPOT))
    return tmp_path


@pytest.mark.parametrize("task", ruler.DATA_TASKS)
def test_qa_without_data(task, tmp_path):
    with pytest.raises(MissingDataError, match=r"skipped: needs --data PATH with (SQuAD|HotpotQA)"):
        ruler.generate(task, 4096, 2, TOK)
    with pytest.raises(MissingDataError, match="does not exist"):
        ruler.generate(task, 4096, 2, TOK, data_path=str(tmp_path / "nope.json"))
    with pytest.raises(MissingDataError, match="holds none of"):
        ruler.generate(task, 4096, 2, TOK, data_path=str(tmp_path))
    assert issubclass(MissingDataError, HybridKVError)


def test_qa_wrong_dataset(qa_files):
    with pytest.raises(MissingDataError, match="is not one"):
        ruler.generate("qa_1", 4096, 1, TOK, data_path=str(qa_files / "hotpotqa.json"))
    with pytest.raises(MissingDataError, match="is not one"):
        ruler.generate("qa_2", 4096, 1, TOK, data_path=str(qa_files / "squad.json"))


@pytest.mark.parametrize("length", [1024, 4096])
def test_qa_samples(qa_files, length):
    squad = ruler.generate("qa_1", length, 3, TOK, data_path=str(qa_files))  # a folder holding squad.json
    assert [s.golds for s in squad] == [["the Black Forest"], ["the North Sea", "North Sea"], ["Arctic terns"]]
    questions = ["Where does the Danube rise?", "Where does the Rhine end?", "Which bird has the longest migration?"]
    hotpot = ruler.generate("qa_2", length, 2, TOK, data_path=str(qa_files / "hotpotqa.json"))
    assert [s.golds for s in hotpot] == [["Munich"], ["yes"]]
    for sample, question in zip(squad + hotpot, questions + [h["question"] for h in HOTPOT], strict=True):
        assert sample.question.endswith(f"\n\nQuestion: {question} Answer:")
        assert sample.context.startswith("Answer the question based on the given documents.")
        assert "Document 1:\n" in sample.context
        tokens = len(TOK.encode(sample.context + sample.question))
        assert tokens == sample.meta["prompt_tokens"] <= length - 32
        for offset in sample.meta["offsets"]:
            assert re.match(r"Document \d+:\n", sample.context[offset:])
    for sample in squad:
        assert any(g in sample.context for g in sample.golds)
    # Every HotpotQA paragraph of the question is in its context.
    for sample, item in zip(hotpot, HOTPOT, strict=True):
        for title, sentences in item["context"]:
            assert f"{title}\n{''.join(sentences)}" in sample.context
    assert ruler.generate("qa_1", length, 3, TOK, data_path=str(qa_files)) == squad
    with pytest.raises(HybridKVError, match="3 answerable questions"):
        ruler.generate("qa_1", length, 4, TOK, data_path=str(qa_files))


# ---------------------------------------------------------------------------------------------
# frozen JSONL


def _some_samples() -> list[Sample]:
    return _samples("niah_multivalue", 1024, 0) + _samples("vt", 1024, 0) + _samples("cwe", 2048, 0)


def test_freeze_round_trip(tmp_path):
    samples = _some_samples()
    path = tmp_path / "sub" / "ruler.jsonl"
    digest = freeze(samples, path)
    data = path.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() == checksum(path)
    assert (tmp_path / "sub" / "ruler.jsonl.sha256").read_text() == f"{digest}  ruler.jsonl\n"
    lines = data.decode().splitlines()
    assert len(lines) == len(samples)
    assert all(list(json.loads(line)) == sorted(json.loads(line)) for line in lines)
    assert load_frozen(path) == samples
    assert load_frozen(str(path)) == samples
    # Freezing the same samples again gives the same bytes.
    assert freeze(samples, tmp_path / "again.jsonl") == digest


def test_frozen_tamper_and_missing(tmp_path):
    path = tmp_path / "w.jsonl"
    freeze(_some_samples(), path)
    data = bytearray(path.read_bytes())
    data[data.index(b"special magic")] ^= 0x20
    path.write_bytes(bytes(data))
    with pytest.raises(HybridKVError, match="checksum mismatch"):
        load_frozen(path)
    with pytest.raises(HybridKVError, match="no checksum file"):
        load_frozen(tmp_path / "absent.jsonl")
    freeze(_some_samples(), path)
    (tmp_path / "w.jsonl.sha256").unlink()
    with pytest.raises(HybridKVError, match="no checksum file"):
        load_frozen(path)
    # A missing data file beside a checksum file.
    freeze([], tmp_path / "e.jsonl")
    assert load_frozen(tmp_path / "e.jsonl") == []
    (tmp_path / "e.jsonl").unlink()
    with pytest.raises(HybridKVError, match="cannot read"):
        load_frozen(tmp_path / "e.jsonl")
