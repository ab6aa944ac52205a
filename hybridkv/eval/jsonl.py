"""Reading JSON Lines files without losing or inventing rows.

Lines are split on "\\n" only. `str.splitlines()` would also split on U+2028, U+2029, U+0085 and
other characters that JSON allows unescaped inside strings (a file written with
`ensure_ascii=False` holds them raw), tearing one record into two unreadable halves.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv.errors import HybridKVError


def numbered_jsonl(text: str, where: str, *, torn_tail_ok: bool = False) -> list[tuple[int, dict]]:
    """The JSON objects of `text`, one per line, each with its 1-based line number; blank lines are
    skipped.

    Any line that is not a JSON object is refused with its line number — except, when
    `torn_tail_ok`, a last line with no newline after it: a writer killed mid-line leaves one,
    and the caller redoes what it held (a resumable run).
    """
    lines = text.split("\n")
    unterminated = len(lines) - 1 if lines[-1] else None  # text not ending in "\n": the last line may be torn
    records = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if torn_tail_ok and number == unterminated:
                break
            raise HybridKVError(f"{where}:{number + 1}: not a JSON line ({err.msg})") from err
        if not isinstance(record, dict):
            raise HybridKVError(f"{where}:{number + 1}: not a JSON object")
        records.append((number + 1, record))
    return records


def parse_jsonl(text: str, where: str, *, torn_tail_ok: bool = False) -> list[dict]:
    """`numbered_jsonl` without the line numbers."""
    return [record for _, record in numbered_jsonl(text, where, torn_tail_ok=torn_tail_ok)]


def read_jsonl(path: Path, *, torn_tail_ok: bool = False) -> list[dict]:
    """`parse_jsonl` of a UTF-8 file; a file that cannot be read or decoded is refused, not shortened."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise HybridKVError(f"{path}: cannot read ({err.strerror or err})") from err
    except UnicodeDecodeError as err:
        raise HybridKVError(f"{path}: not UTF-8 text (byte {err.start})") from err
    return parse_jsonl(text, str(path), torn_tail_ok=torn_tail_ok)


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in file `path`, or a one-line error naming the file and `what` it should be."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HybridKVError(f"{path}: not a readable {what} ({err})") from err
    if not isinstance(data, dict):
        raise HybridKVError(f"{path}: not a JSON object ({what})")
    return data
