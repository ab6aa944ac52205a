"""Frozen workloads: samples written once to JSONL with a sha256 checksum beside them, and read
back only when the checksum still matches, so a run is reproducible from the exact prompts.

`freeze(samples, path)` writes `path` (one sample per line, keys sorted, UTF-8) and
`path + ".sha256"` (`<hex digest>  <file name>`, the `sha256sum` format, so
`sha256sum -c path.sha256` checks it too) and returns the digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.jsonl import parse_jsonl
from hybridkv.eval.workloads.base import Sample

_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
# Fields added later have defaults, so workloads frozen before them still load.
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(Sample)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def _checksum_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + ".sha256")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def freeze(samples: Iterable[Sample], path: str | os.PathLike) -> str:
    """Write samples as JSONL to `path` and the checksum file beside it; return the sha256."""
    path = Path(path)
    lines = [json.dumps(dataclasses.asdict(s), sort_keys=True, ensure_ascii=False) + "\n" for s in samples]
    data = "".join(lines).encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, data)
    _write_atomic(_checksum_path(path), f"{digest}  {path.name}\n".encode())
    return digest


def checksum(path: str | os.PathLike) -> str:
    """The sha256 recorded beside a frozen file (HybridKVError when there is none)."""
    sums = _checksum_path(path)
    try:
        text = sums.read_text(encoding="utf-8").split()
    except OSError as err:
        raise HybridKVError(f"{path}: no checksum file {sums.name} ({err.strerror or err})") from err
    if not text or len(text[0]) != 64 or any(c not in "0123456789abcdef" for c in text[0]):
        raise HybridKVError(f"{sums}: not a sha256 checksum file")
    return text[0]


def load_frozen(path: str | os.PathLike) -> list[Sample]:
    """The samples frozen at `path`, after checking them against `path + ".sha256"`.

    Raises HybridKVError when the file or its checksum is missing, the content does not match
    the checksum, or a line is not a sample.
    """
    path = Path(path)
    expected = checksum(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise HybridKVError(f"{path}: cannot read frozen workload ({err.strerror or err})") from err
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise HybridKVError(f"{path}: checksum mismatch (file {actual[:12]}…, recorded {expected[:12]}…); it changed")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HybridKVError(f"{path}: not UTF-8 text (byte {err.start})") from err
    samples = []
    for number, record in enumerate(parse_jsonl(text, str(path)), 1):
        if not set(_REQUIRED) <= set(record) <= set(_FIELDS):
            raise HybridKVError(f"{path}: sample {number} is not a sample (fields {', '.join(_FIELDS)})")
        samples.append(Sample(**record))
    return samples


__all__ = ["checksum", "freeze", "load_frozen"]
