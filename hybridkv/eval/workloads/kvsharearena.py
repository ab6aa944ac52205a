"""`kvsharearena`: KVShareArena's frozen querysets, read from a local copy, one cache per declared chunk.

KVShareArena (github.com/xishi404/KVShareArena) scores KV-reuse methods on frozen inputs: 100
questions each of LongBench v1's qasper, multifieldqa_en and hotpotqa (the "re" track, Retrieved
Evidence), and question-blind reports that agents wrote on the hotpotqa passages (the "ar" track,
Agent Reports). This module reads that release as it is laid out (read, not copied; nothing of it is
bundled here), and `hybridkv arena export --format kva` (`hybridkv.eval.kva`) writes the arena's
answers back as its `kva.result.v1` result files.

**Data** (`--data DIR`; nothing is downloaded). DIR is the release's `data/queryset` folder (or a
folder holding `data/queryset`):
- `<subset>_n100.jsonl` (any one `<subset>_n<N>.jsonl`): one question per line with `_id`,
  `context`, `input`, `answers` and `chunks` (passage boundaries for hotpotqa, 512-token pieces
  for the single-document subsets); `n_chunks`, when present, must count them. The chunks are what
  is cached and what the prompt holds, as in KVShareArena's harness, which reads `chunks` only.
  `context` is meant to be their join but not always is: a 512-token boundary can fall inside a
  character, which the release stores as U+FFFD on both sides (multifieldqa_en line 2 cuts "Λ"),
  so such a line is read from its chunks and reported once through the `hybridkv.eval` logger.
- `agent_reports/<subset>_notes.jsonl`: per question `_id`, `input` and `notes`, one note per
  passage (`passage_idx` 0, 1, ... in order, `note_text`); the golds come from the subset's
  queryset, joined on `_id`.
- `sha256.json`, when present: every file read here that it lists must match its checksum. It
  holds whole-file hashes, so a folder of some lines of the release cannot carry it; without it
  the files are read unchecked, and the export says so (`manifest_checked` false, as KVShareArena
  records it).
A file that is there but cannot be read, a line that is not a JSON object, a missing or ill-typed
field, an `n_chunks` that does not count the chunks or a duplicate `_id` is a HybridKVError naming
the file and line; a record is never skipped or cut. A task whose files are absent raises
MissingDataError (the CLI reports it and runs the other tasks).

**Tasks**: `re-<subset>` and `ar-<subset>`, track and subset as KVShareArena names them.

**Prompts.** KVShareArena's receiver sees LongBench's official template for the subset (the same
strings as `longbench.PROMPTS`), the context cut at `{context}` into its chunks. So a sample's
chunks are [the template's head, chunk 1, ..., chunk k], and its question is the template's tail
with `{input}` filled in; `context + question` is LongBench's prompt. For the ar track the chunks
are the notes, each followed by NOTE_SEPARATOR, under the hotpotqa template. Differences from
KVShareArena's harness:
- its receiver also has a system prompt and the model's chat template; the arena applies neither
  (as for `longbench` and `ruler`);
- agent reports are read as `note_text` and tokenised with the arena model's tokenizer
  (KVShareArena replays the producer's `note_token_ids`, Qwen3's token ids);
- how the receiver separates the notes is not published; NOTE_SEPARATOR is our choice.

**Length.** Records are frozen and never cut: `length` (`--lengths`) is the sample's length label
and a cap; a record whose prompt plus answer budget exceeds it is refused with the length it needs.
`n` keeps the first n records in file order (KVShareArena's `--n`); `seed` is ignored.

**Score**: KVShareArena's `f1_raw` (its scoring.py): LongBench's English normalisation and token
F1 (`scoring.qa_f1_score`), the best over the golds, 0.0 with no golds.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from hybridkv.errors import HybridKVError, MissingDataError
from hybridkv.eval.jsonl import numbered_jsonl, read_json_object
from hybridkv.eval.scoring import qa_f1_score
from hybridkv.eval.workloads.base import Sample, Workload
from hybridkv.eval.workloads.longbench import MAX_NEW_TOKENS, PROMPTS

SUBSETS = ("qasper", "multifieldqa_en", "hotpotqa")
TRACKS = ("re", "ar")
TASKS = ("re-qasper", "re-multifieldqa_en", "re-hotpotqa", "ar-hotpotqa")
TOKENS_TO_GENERATE = {task: MAX_NEW_TOKENS[task.split("-", 1)[1]] for task in TASKS}
NOTE_SEPARATOR = "\n\n"
REPO_URL = "https://github.com/xishi404/KVShareArena"
_QUERYSET = re.compile(r"(?P<subset>.+)_n(?P<n>\d+)\.jsonl")
log = logging.getLogger("hybridkv.eval")
# (file, sha256, line) of each line whose context was reported as differing from its chunks: a
# run reads a queryset once per length, and one report per line is enough.
_REPORTED: set[tuple[str, str, int]] = set()


def track_subset(task: str) -> tuple[str, str]:
    """("re" | "ar", subset) of a task name."""
    if task not in TASKS:
        raise HybridKVError(f"unknown kvsharearena task {task!r}; one of {', '.join(TASKS)}")
    track, subset = task.split("-", 1)
    return track, subset


# ---------------------------------------------------------------------------------------------
# Files


def _root(data_path: str | Path | None, need: str) -> Path:
    if data_path is None:
        raise MissingDataError(need)
    path = Path(data_path)
    if not path.is_dir():
        raise MissingDataError(f"{need}; {path} is not a folder")
    nested = path / "data" / "queryset"
    return nested if nested.is_dir() and not any(path.glob("*_n*.jsonl")) else path


def _queryset_file(root: Path, subset: str, need: str) -> Path:
    found = sorted(
        p for p in root.glob(f"{subset}_n*.jsonl") if (m := _QUERYSET.fullmatch(p.name)) and m["subset"] == subset
    )
    if not found:
        raise MissingDataError(f"{need}; {root} holds no {subset}_n100.jsonl")
    if len(found) > 1:
        preferred = [p for p in found if p.name == f"{subset}_n100.jsonl"]
        if not preferred:
            raise HybridKVError(f"{root}: several {subset} querysets ({', '.join(p.name for p in found)}); keep one")
        return preferred[0]
    return found[0]


def _read(path: Path, root: Path) -> tuple[bytes, str, bool]:
    """The file's bytes, its sha256, and whether `root/sha256.json` lists it (then it matched)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise HybridKVError(f"{path}: cannot read ({err.strerror or err})") from err
    digest = hashlib.sha256(data).hexdigest()
    sums = root / "sha256.json"
    if not sums.exists():
        return data, digest, False
    expected = read_json_object(sums, "JSON checksum list (file -> sha256)")
    want = expected.get(path.relative_to(root).as_posix())
    if want is not None and want != digest:
        raise HybridKVError(f"{path}: sha256 {digest[:12]}… is not the {str(want)[:12]}… sha256.json records")
    return data, digest, want is not None


def _records(path: Path, data: bytes) -> list[tuple[int, dict]]:
    """(line number, object) per non-blank line; anything else is refused with its line number."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HybridKVError(f"{path}: not UTF-8 text (byte {err.start})") from err
    return numbered_jsonl(text, str(path))


def _field(record: dict, key: str, kind: type, where: str):
    if key not in record:
        raise HybridKVError(f"{where}: no {key!r} field")
    value = record[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HybridKVError(f"{where}: {key!r} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _strings(record: dict, key: str, where: str) -> list[str]:
    value = _field(record, key, list, where)
    if not value or not all(isinstance(item, str) for item in value):
        raise HybridKVError(f"{where}: {key!r} is not a non-empty list of strings")
    return value


def _question(record: dict, where: str) -> dict:
    """The checked fields of one queryset line (`context` is only compared with the chunks)."""
    _id = _field(record, "_id", str, where)
    context = _field(record, "context", str, where)
    query = _field(record, "input", str, where)
    answers = _strings(record, "answers", where)
    chunks = _strings(record, "chunks", where)
    declared = record.get("n_chunks")
    if declared is not None and declared != len(chunks):
        raise HybridKVError(f"{where}: declares n_chunks {declared!r} but holds {len(chunks)} chunks")
    return {"_id": _id, "input": query, "answers": answers, "chunks": chunks, "context": context, "record": record}


def _differs_at(joined: str, context: str) -> int | None:
    """The first character at which the chunks' join and the context differ; None where they agree."""
    if joined == context:
        return None
    at = next((i for i, (a, b) in enumerate(zip(joined, context, strict=False)) if a != b), None)
    return min(len(joined), len(context)) if at is None else at


def _queryset(root: Path, subset: str, need: str) -> tuple[Path, str, bool, list[tuple[int, dict]]]:
    path = _queryset_file(root, subset, need)
    data, digest, checked = _read(path, root)
    rows, seen = [], {}
    for number, record in _records(path, data):
        row = _question(record, f"{path}:{number}")
        if row["_id"] in seen:
            raise HybridKVError(f"{path}:{number}: _id {row['_id']!r} again (first on line {seen[row['_id']]})")
        seen[row["_id"]] = number
        rows.append((number, row))
    for number, row in rows:  # after the whole file passed: a refused file reports nothing
        at = _differs_at("".join(row["chunks"]), row["context"])
        key = (str(path.resolve()), digest, number)
        if at is not None and key not in _REPORTED:
            _REPORTED.add(key)
            log.warning(
                "%s:%d: its context differs from its %d chunks joined (at character %d); the chunks are cached and "
                "prompted, as KVShareArena's harness does", path, number, len(row["chunks"]), at,
            )  # fmt: skip
    return path, digest, checked, rows


def _notes(record: dict, where: str) -> list[str]:
    notes = _field(record, "notes", list, where)
    if not notes:
        raise HybridKVError(f"{where}: 'notes' is empty")
    declared = record.get("n_notes")
    if declared is not None and declared != len(notes):
        raise HybridKVError(f"{where}: declares n_notes {declared!r} but holds {len(notes)} notes")
    texts = []
    for index, note in enumerate(notes):
        here = f"{where}: notes[{index}]"
        if not isinstance(note, dict):
            raise HybridKVError(f"{here} is not a JSON object")
        if _field(note, "passage_idx", int, here) != index:
            raise HybridKVError(f"{here}: passage_idx {note['passage_idx']} out of order (expected {index})")
        texts.append(_field(note, "note_text", str, here))
    return texts


# ---------------------------------------------------------------------------------------------
# Samples


def _split_template(subset: str) -> tuple[str, str]:
    head, tail = PROMPTS[subset].split("{context}")
    return head, tail


def load(task: str, data_path: str | Path | None, n: int | None = None) -> list[dict]:
    """The first `n` questions of `task` (all when None) as dicts: `_id`, `input`, `answers`, the
    cached pieces `chunks` (the record's chunks, or the notes each followed by NOTE_SEPARATOR),
    and where they came from (`file`, `line`, `sha256`, `manifest_checked`: whether sha256.json
    vouched for every file read; for ar also the `reports_*` of the notes)."""
    track, subset = track_subset(task)
    if n is not None and n < 0:
        raise HybridKVError(f"kvsharearena {task}: the number of samples must be >= 0, not {n}")
    where = "data/queryset" if track == "re" else f"data/queryset/agent_reports/{subset}_notes.jsonl"
    need = f"kvsharearena {task} skipped: needs --data DIR with KVShareArena's {where} ({REPO_URL})"
    root = _root(data_path, need)
    if track == "re":
        path, digest, checked, rows = _queryset(root, subset, need)
        out = [
            {**{k: row[k] for k in ("_id", "input", "answers", "chunks")}, "file": path.name, "line": number,
             "sha256": digest, "manifest_checked": checked,
             **{k: row["record"].get(k) for k in ("chunk_mode", "n_tok_ctx")}}
            for number, row in rows
        ]  # fmt: skip
        return out[:n] if n is not None else out
    reports = root / "agent_reports" / f"{subset}_notes.jsonl"
    if not reports.exists():
        raise MissingDataError(f"{need}; {root} holds no agent_reports/{subset}_notes.jsonl")
    path, digest, checked, rows = _queryset(root, subset, f"{need} (and its {subset}_n100.jsonl for the answers)")
    by_id = {row["_id"]: (number, row) for number, row in rows}
    data, reports_digest, reports_checked = _read(reports, root)
    out, seen = [], {}
    for number, record in _records(reports, data):
        here = f"{reports}:{number}"
        _id = _field(record, "_id", str, here)
        if _id in seen:
            raise HybridKVError(f"{here}: _id {_id!r} again (first on line {seen[_id]})")
        seen[_id] = number
        if _id not in by_id:
            raise HybridKVError(f"{here}: _id {_id!r} is not in {path.name}, which holds the answers")
        line, question = by_id[_id]
        query = _field(record, "input", str, here)
        if query != question["input"]:
            raise HybridKVError(f"{here}: its input is not the question of {_id!r} in {path.name}:{line}")
        notes = [text + NOTE_SEPARATOR for text in _notes(record, here)]
        out.append(
            {"_id": _id, "input": query, "answers": question["answers"], "chunks": notes, "file": path.name,
             "line": line, "sha256": digest, "manifest_checked": checked and reports_checked,
             "reports_file": f"agent_reports/{reports.name}", "reports_line": number, "reports_sha256": reports_digest}
        )  # fmt: skip
    return out[:n] if n is not None else out


def generate(task: str, length: int, n: int, tokenizer, seed: int = 0, data_path: str | None = None) -> list[Sample]:
    """The first `n` questions of `task` as samples of `length` tokens (a label and a cap: a record
    whose prompt and answer do not fit is refused, never cut). `seed` is accepted and ignored."""
    track, subset = track_subset(task)
    head, tail = _split_template(subset)
    head_tokens = len(tokenizer.encode(head))
    samples = []
    for index, item in enumerate(load(task, data_path, n)):
        chunks = [head, *item["chunks"]]
        question = tail.format(input=item["input"])
        context_tokens = head_tokens + sum(len(tokenizer.encode(chunk)) for chunk in item["chunks"])
        question_tokens = len(tokenizer.encode(question))
        needed = context_tokens + question_tokens + TOKENS_TO_GENERATE[task]
        if needed > length:
            place = f"{item.get('reports_file', item['file'])}:{item.get('reports_line', item['line'])}"
            raise HybridKVError(
                f"kvsharearena {task}: {place} (_id {item['_id']}) needs {needed} tokens with its answer, more than "
                f"length {length}; the frozen records are never cut: pass --lengths {needed} or more"
            )
        meta = {k: v for k, v in item.items() if k not in ("input", "answers", "chunks")}
        meta.update(
            {"track": track, "subset": subset, "index": index, "header_tokens": head_tokens,
             "context_tokens": context_tokens, "question_tokens": question_tokens,
             "tokens_to_generate": TOKENS_TO_GENERATE[task], "metric": "f1_raw"}
        )  # fmt: skip
        samples.append(
            Sample(
                id=f"{task}-{length}-{index}",
                task=task,
                length=length,
                context="".join(chunks),
                question=question,
                golds=list(item["answers"]),
                meta=meta,
                chunks=chunks,
            )
        )
    if not samples and n != 0:
        raise MissingDataError(f"kvsharearena {task} skipped: its files hold no records")
    return samples


def f1_raw(prediction: str, golds: list[str]) -> float:
    """KVShareArena's `f1_raw`: the best LongBench token F1 of the prediction over the golds (0.0 with none)."""
    return max((qa_f1_score(prediction, gold) for gold in golds), default=0.0)


def score(task: str, prediction: str, golds: list[str], meta: dict | None = None) -> float:
    return f1_raw(prediction, golds)


WORKLOAD = Workload(name="kvsharearena", tasks=TASKS, default_tasks=TASKS, generate=generate, score=score)


__all__ = [
    "WORKLOAD",
    "NOTE_SEPARATOR",
    "SUBSETS",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "TRACKS",
    "f1_raw",
    "generate",
    "load",
    "score",
    "track_subset",
]
