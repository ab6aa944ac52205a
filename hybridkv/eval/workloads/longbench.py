"""LongBench v1 (Bai et al., 2023): the 21 datasets read from local files, with the official
prompt templates, answer-length limits, middle truncation and per-dataset metric.

Source read (not copied): THUDM/LongBench `LongBench/config/dataset2prompt.json` (PROMPTS, the
template strings reproduced exactly, typos included), `LongBench/config/dataset2maxlen.json`
(MAX_NEW_TOKENS) and `LongBench/pred.py` (prompt = template.format(**record), middle truncation).
The metrics are hybridkv.eval.scoring's (`score_longbench`, `DATASET_METRIC`).

**Data.** Nothing is downloaded. `data_path` is one of
- a folder holding `<dataset>.jsonl` or `data/<dataset>.jsonl` (the official data.zip unpacked),
  or `data.zip` itself (read in place, member `data/<dataset>.jsonl`);
- a Hugging Face hub cache of the dataset repo (`.../datasets--THUDM--LongBench`, or
  `datasets--zai-org--LongBench`, or the hub folder above either): its snapshots are searched
  as above, `refs/main`'s first;
- parquet files `<dataset>/test/*.parquet` or `<dataset>/*.parquet` (the hub's parquet export),
  read with pyarrow when it is installed;
- a `datasets` copy written by `save_to_disk`, as `<dataset>/` or as `data_path` itself (then
  rows are kept by their `dataset` field), read with `datasets.load_from_disk` when the
  `datasets` package is installed (it is not a dependency of hybridkv);
- a single `.jsonl`, `.zip` or `.parquet` file.
Without data `load` raises MissingDataError (`hybridkv.errors`, one type for the CLI to catch), whose
message says the dataset is skipped and what to download. LongBench-E files (`<dataset>_e`) are
read the same way, with their base dataset's template, length limit and metric.

**Samples.** The official prompt is `PROMPTS[dataset].format(**record)`. Every template holds
`{context}` once, and `{input}` (when it has one) only after it, so the prompt is split right
after the context: `Sample.context` = the template text up to `{context}` plus the context (the
question-blind, cacheable part: the document, or the few-shot examples of trec, triviaqa, samsum
and lsht), `Sample.question` = the rest of the template with `{input}` filled in; for gov_report,
multi_news, vcsum, passage_count and lcc, which have no `{input}`, the question is the fixed
instruction tail. `context + question` is always the prompt pred.py would build (before
truncation, see below). Samples keep file order; sample i is `longbench-<dataset>-<i>`.

**Truncation** (`tokenizer` and `max_length` given). pred.py keeps the first and the last
`max_length // 2` tokens of the whole prompt, each decoded, when it has more than `max_length`
tokens. Here the question is always kept whole, so the cut must fall inside the context:
- When the question fits in the last half (the usual case: LongBench questions are short), the
  official cut never reaches it and the sample is exactly pred.py's prompt, split where the
  question starts (`meta["truncation"] == "pred.py"`).
- Otherwise (a question longer than half of max_length, e.g. repobench-p's in-file code at a small
  max_length; or a tokenizer whose decoded tail does not end with the question verbatim) only the
  context is cut (`"context"`): it keeps its first min(half, B) tokens and its last B - that,
  B = 2 * half - (question tokens), so the total is still at most max_length and the prompt's
  start is kept as pred.py keeps it. A question that leaves no room for any context at all is a
  HybridKVError.
A cut inside a multi-byte character decodes to U+FFFD, as in pred.py, so with a byte tokenizer the
re-encoded prompt can exceed max_length by a few tokens; `meta["prompt_tokens"]` is the real count.

Other differences from pred.py:
- Model chat templates (`build_chat`, skipped by pred.py for RAW_PROMPT_DATASETS) are not applied,
  as in the RULER workload.
- pred.py counts the tokens its tokenizer adds (BOS); hybridkv tokenizers add none.
- pred.py also stops samsum generation at a newline (its `eos_token_id` list); the arena does
  not, but samsum is scored on the prediction's first line anyway.
- `Sample.length` is `max_length` for every sample when it is given (a length bucket, as RULER's
  target length), else the prompt's token count with a tokenizer, else LongBench's own `length`
  field (words, or characters for Chinese), which `meta["length"]` always holds. `generate`, the
  RULER-shaped entry point, sets it to its `length` (prompt + tokens to generate).
"""

from __future__ import annotations

import importlib.util
import io
import json
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.scoring import DATASET_METRIC, score_longbench
from hybridkv.eval.workloads.base import Sample, Workload

DATASETS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)
TASKS = DATASETS
# LongBench-E: 13 of the datasets resampled over length buckets, files named "<dataset>_e".
E_DATASETS = tuple(
    f"{d}_e"
    for d in (
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "gov_report",
        "multi_news",
        "trec",
        "triviaqa",
        "samsum",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
        "repobench-p",
    )
)
# pred.py feeds these prompts to chat models without the chat template.
RAW_PROMPT_DATASETS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")

# LongBench/config/dataset2prompt.json, verbatim.
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer "
        "the question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely "
        "as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you "
        "can, using a single phrase or sentence if possible. If the question cannot be answered based "
        'on the information in the article, write "unanswerable". If the question is a yes/no '
        'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Article: {context}\n\n Answer the question based on the above article as concisely as you "
        "can, using a single phrase or sentence if possible. If the question cannot be answered based "
        'on the information in the article, write "unanswerable". If the question is a yes/no '
        'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based on the above text, only give me the answer and do not output any other "
        "words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，"
        "只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output "
        "any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based "
        "on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output "
        "any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based "
        "on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output "
        "any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based "
        "on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer "
        "the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based "
        "on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": ("下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are "
        "after removing duplicates. In other words, how many non-repeating paragraphs are there in "
        "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
        "duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be "
        'like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n"
        '下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，'
        '"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# LongBench/config/dataset2maxlen.json: the answer budget in tokens.
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

TOKENS_TO_GENERATE = MAX_NEW_TOKENS  # the name the RULER workload uses
METRICS = {d: DATASET_METRIC[d].__name__ for d in DATASETS}

DATA_URL = "https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip"
# The hub cache folders of the dataset repo (THUDM's models and data now live under zai-org).
_HUB_REPOS = ("datasets--THUDM--LongBench", "datasets--zai-org--LongBench")


def _base(dataset: str) -> str:
    return dataset[:-2] if dataset in E_DATASETS else dataset


def _check_dataset(dataset: str) -> str:
    if dataset not in DATASETS and dataset not in E_DATASETS:
        raise HybridKVError(f"unknown LongBench dataset {dataset!r}; one of {', '.join(DATASETS)} (or <name>_e)")
    return _base(dataset)


# ---------------------------------------------------------------------------------------------
# Finding and reading the data


@dataclass(frozen=True)
class _Source:
    where: str  # for messages: the file (and member) read
    rows: Callable[[], Iterator[dict]]  # the records in file order, read lazily


def _jsonl_rows(lines: Iterable[str], where: str) -> Iterator[dict]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise HybridKVError(f"{where}:{number}: not a JSON line ({err.msg})") from err
        if not isinstance(record, dict):
            raise HybridKVError(f"{where}:{number}: not a JSON object")
        yield record


def _jsonl_file(path: Path) -> _Source:
    def rows() -> Iterator[dict]:
        with open(path, encoding="utf-8") as f:
            yield from _jsonl_rows(f, str(path))

    return _Source(str(path), rows)


def _zip_source(path: Path, dataset: str) -> _Source | None:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile) as err:
        raise HybridKVError(f"{path}: not a readable zip file ({err})") from err
    file_name = f"{dataset}.jsonl"
    found = sorted((n for n in names if n == file_name or n.endswith("/" + file_name)), key=len)
    if not found:
        return None
    member = found[0]

    def rows() -> Iterator[dict]:
        with zipfile.ZipFile(path) as zf, zf.open(member) as raw:
            yield from _jsonl_rows(io.TextIOWrapper(raw, encoding="utf-8"), f"{path}:{member}")

    return _Source(f"{path}:{member}", rows)


def _parquet_source(files: list[Path], dataset: str) -> _Source:
    def rows() -> Iterator[dict]:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise MissingDataError(
                f"longbench {dataset} skipped: {files[0].parent} holds parquet files, which need pyarrow "
                f"(not installed); install it, or pass a folder with {dataset}.jsonl ({DATA_URL})"
            ) from err
        for file in files:
            yield from pq.read_table(str(file)).to_pylist()

    return _Source(str(files[0].parent), rows)


def _is_saved(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _saved_source(path: Path, dataset: str, keep_by_field: bool) -> _Source:
    def rows() -> Iterator[dict]:
        try:
            from datasets import load_from_disk
        except ImportError as err:
            raise MissingDataError(
                f"longbench {dataset} skipped: {path} is a Hugging Face `datasets` save_to_disk copy, but the "
                f"`datasets` package is not installed; install it, or pass a folder with {dataset}.jsonl "
                f"(from {DATA_URL})"
            ) from err
        data = load_from_disk(str(path))
        if isinstance(data, dict):  # a DatasetDict: LongBench has only the test split
            if "test" in data:
                data = data["test"]
            elif len(data) == 1:
                data = next(iter(data.values()))
            else:
                raise HybridKVError(f"{path}: splits {', '.join(data)}, none of them 'test'")
        names = {dataset, _base(dataset)}
        for row in data:
            if not keep_by_field or row.get("dataset") in names:
                yield dict(row)

    return _Source(str(path), rows)


def _roots(path: Path) -> list[Path]:
    """`path`, then the snapshots of a hub cache at or right under it (refs/main's first)."""
    roots = [path]
    for repo in (path, *(path / name for name in _HUB_REPOS)):
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        main = ref.read_text(encoding="utf-8").strip() if ref.is_file() else None
        roots += sorted((s for s in snapshots.iterdir() if s.is_dir()), key=lambda s: (s.name != main, s.name))
    return roots


def _find_in(root: Path, dataset: str) -> _Source | None:
    for rel in (f"{dataset}.jsonl", f"data/{dataset}.jsonl"):
        if (root / rel).is_file():
            return _jsonl_file(root / rel)
    if (root / "data.zip").is_file() and (source := _zip_source(root / "data.zip", dataset)):
        return source
    for pattern in (f"{dataset}/test/*.parquet", f"{dataset}/*.parquet"):
        if files := sorted(root.glob(pattern)):
            return _parquet_source(files, dataset)
    if _is_saved(root / dataset):
        return _saved_source(root / dataset, dataset, keep_by_field=False)
    return None


def _source(dataset: str, data_path: str | Path | None) -> _Source:
    need = f"longbench {dataset} skipped: needs --data PATH with LongBench's {dataset}.jsonl (from {DATA_URL})"
    if data_path is None:
        raise MissingDataError(need)
    path = Path(data_path)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return _jsonl_file(path)
        if suffix == ".zip":
            if source := _zip_source(path, dataset):
                return source
            raise MissingDataError(f"{need}; {path} holds no {dataset}.jsonl")
        if suffix == ".parquet":
            return _parquet_source([path], dataset)
        raise HybridKVError(f"{path}: not a LongBench .jsonl, .zip or .parquet file")
    if not path.is_dir():
        raise MissingDataError(f"{need}; {path} does not exist")
    for root in _roots(path):
        if source := _find_in(root, dataset):
            return source
    if _is_saved(path):
        return _saved_source(path, dataset, keep_by_field=True)
    looked = f"{dataset}.jsonl, data/{dataset}.jsonl, data.zip, {dataset}/test/*.parquet, a save_to_disk copy"
    note = ""
    if importlib.util.find_spec("datasets") is None:
        note = " (the `datasets` package is not installed: only JSONL, data.zip, and parquet with pyarrow are read)"
    raise MissingDataError(f"{need}; {path} holds none of: {looked}, nor a hub cache snapshot with them{note}")


# ---------------------------------------------------------------------------------------------
# Prompts and truncation


def split_prompt(dataset: str, record: dict) -> tuple[str, str]:
    """(context, question) of the official prompt `PROMPTS[dataset].format(**record)`, split right
    after the record's context; their concatenation is that prompt."""
    template = PROMPTS[_check_dataset(dataset)]
    head, tail = template.split("{context}")
    try:
        return head.format(**record) + record["context"], tail.format(**record)
    except KeyError as err:
        raise HybridKVError(f"longbench {dataset}: the record has no {err.args[0]!r} field") from err


def truncate(context: str, question: str, tokenizer, max_length: int) -> tuple[str, str, str | None]:
    """pred.py's middle truncation of `context + question` to `max_length` tokens, with the cut
    kept inside the context (see the module notes). Returns (context, question, how): how is None
    (the prompt fits), "pred.py" (exactly the official cut) or "context" (the question was longer
    than the official tail half)."""
    ids = tokenizer.encode(context + question)
    if len(ids) <= max_length:
        return context, question, None
    half = max_length // 2
    if half > 0:
        tail = tokenizer.decode(ids[len(ids) - half :])
        if tail.endswith(question):
            head = tokenizer.decode(ids[:half])
            return head + tail[: len(tail) - len(question)], question, "pred.py"
    question_tokens = len(tokenizer.encode(question))
    room = 2 * half - question_tokens
    if room < 1:
        raise HybridKVError(
            f"the question alone is {question_tokens} tokens: max_length {max_length} leaves no room for the context"
        )
    context_ids = tokenizer.encode(context)
    if len(context_ids) <= room:  # only the tokens at the seam differ; nothing to cut
        return context, question, None
    keep_head = min(half, room)
    keep_tail = room - keep_head
    kept = tokenizer.decode(context_ids[:keep_head])
    if keep_tail:
        kept += tokenizer.decode(context_ids[len(context_ids) - keep_tail :])
    return kept, question, "context"


# ---------------------------------------------------------------------------------------------


def _check_load_args(dataset: str, n: int | None, tokenizer, max_length: int | None) -> str:
    """`dataset`'s base name, once the arguments `load` was given are known to be usable."""
    base = _check_dataset(dataset)
    if n is not None and n < 0:
        raise HybridKVError(f"longbench {dataset}: the number of samples must be >= 0, not {n}")
    if max_length is not None:
        if tokenizer is None:
            raise HybridKVError(f"longbench {dataset}: max_length needs a tokenizer")
        if max_length < 1:
            raise HybridKVError(f"longbench {dataset}: max_length must be >= 1, not {max_length}")
    return base


def _tokenized(
    context: str, question: str, tokenizer, max_length: int | None, where: str
) -> tuple[str, str, dict, int]:
    """The prompt middle-truncated to `max_length` (when given), its token counts for the meta, and
    the sample's length: the prompt's tokens, or `max_length` when the prompt was capped."""
    truncation = None
    full_tokens = len(tokenizer.encode(context + question))
    if max_length is not None:
        try:
            context, question, truncation = truncate(context, question, tokenizer, max_length)
        except HybridKVError as err:
            raise HybridKVError(f"{where}: {err}") from err
    prompt_tokens = len(tokenizer.encode(context + question)) if truncation else full_tokens
    counts = {
        "max_length": max_length,
        "truncation": truncation,
        "full_prompt_tokens": full_tokens,
        "prompt_tokens": prompt_tokens,
        "context_tokens": len(tokenizer.encode(context)),
    }
    return context, question, counts, prompt_tokens if max_length is None else max_length


def _sample(dataset: str, base: str, index: int, record: dict, where: str, tokenizer, max_length: int | None) -> Sample:
    """Record `index` of `dataset` as a Sample, refused with `where` when malformed."""
    if not isinstance(record.get("context"), str):
        raise HybridKVError(f"{where}: no string 'context'")
    answers = record.get("answers")
    if not isinstance(answers, list):
        raise HybridKVError(f"{where}: 'answers' is not a list")
    try:
        context, question = split_prompt(dataset, record)
    except HybridKVError as err:
        raise HybridKVError(f"{where}: {err}") from err
    meta = {
        "index": index,
        "_id": record.get("_id"),
        "language": record.get("language"),
        "length": record.get("length"),
        "all_classes": record.get("all_classes"),
        "tokens_to_generate": MAX_NEW_TOKENS[base],
        "metric": METRICS[base],
    }
    length = record.get("length") if isinstance(record.get("length"), int) else 0
    if tokenizer is not None:
        context, question, counts, length = _tokenized(context, question, tokenizer, max_length, where)
        meta.update(counts)
    return Sample(
        id=f"longbench-{dataset}-{index}",
        task=dataset,
        length=length,
        context=context,
        question=question,
        golds=[str(a) for a in answers],
        meta=meta,
    )


def load(
    dataset: str,
    data_path: str | Path | None,
    n: int | None = None,
    tokenizer=None,
    max_length: int | None = None,
) -> list[Sample]:
    """The first `n` samples (all when None, or fewer when the file has fewer) of LongBench
    `dataset` read from `data_path` (see the module notes for the layouts read), in file order.

    With `tokenizer`, token counts go in the meta; with `max_length` too, each prompt longer than
    that is middle-truncated as pred.py does, the question kept whole. Raises MissingDataError
    when the data is not there, HybridKVError for an unknown dataset, a bad argument or a
    malformed record.
    """
    base = _check_load_args(dataset, n, tokenizer, max_length)
    source = _source(dataset, data_path)
    samples: list[Sample] = []
    if n == 0:
        return samples
    for index, record in enumerate(source.rows()):
        samples.append(_sample(dataset, base, index, record, f"{source.where}: record {index}", tokenizer, max_length))
        if n is not None and len(samples) >= n:
            break
    if not samples and n != 0:
        raise MissingDataError(f"longbench {dataset} skipped: {source.where} holds no {dataset} records")
    return samples


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """The RULER workload's entry point for LongBench: the first n samples of dataset `task`, each
    prompt middle-truncated so that it plus MAX_NEW_TOKENS[task] fits `length` tokens, with
    `Sample.length == length`. LongBench's data is fixed: `seed` is accepted and ignored."""
    base = _check_dataset(task)
    max_length = length - MAX_NEW_TOKENS[base]
    if max_length < 1:
        raise HybridKVError(f"longbench {task}: length {length} leaves no room for the prompt")
    return [replace(s, length=length) for s in load(task, data_path, n, tokenizer, max_length)]


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    """One sample's score in [0, 1], as LongBench's eval.py computes it (the class list of trec and
    lsht taken from `meta["all_classes"]`)."""
    return score_longbench(task, prediction, golds, (meta or {}).get("all_classes"))


WORKLOAD = Workload(name="longbench", tasks=TASKS, default_tasks=TASKS, generate=generate, score=score)


__all__ = [
    "WORKLOAD",
    "DATASETS",
    "DATA_URL",
    "E_DATASETS",
    "MAX_NEW_TOKENS",
    "METRICS",
    "PROMPTS",
    "RAW_PROMPT_DATASETS",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "Sample",
    "generate",
    "load",
    "score",
    "split_prompt",
    "truncate",
]
