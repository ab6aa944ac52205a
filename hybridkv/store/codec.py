"""Bytes of a store entry: a versioned header, raw tensor bytes, and a checksum.

    b"HKVE" | u16 version | u32 header length | header (JSON) | tensor bytes | sha256 of all before

The header names the entry's kind, the model fingerprint and the key it was written under,
free metadata, and each tensor's dtype, shape and byte range. Decoding checks all of it and
rebuilds tensors from raw bytes: nothing from a store is ever unpickled or `torch.load`ed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

import torch

from hybridkv.errors import CorruptEntry

MAGIC = b"HKVE"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_CHECKSUM_BYTES = 32
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
}


@dataclass
class Entry:
    kind: str
    fingerprint: str
    key: str
    meta: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def encode(entry: Entry) -> bytes:
    specs, pieces, offset = [], [], 0
    for name, tensor in entry.tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} cannot be stored")
        # A fresh dense copy: views, 0-d tensors and odd strides all serialise the same way.
        dense = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach().cpu())
        raw = dense.reshape(-1).view(torch.uint8).numpy().tobytes()
        specs.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "offset": offset, "nbytes": len(raw)})
        pieces.append(raw)
        offset += len(raw)
    header = json.dumps(
        {"kind": entry.kind, "fingerprint": entry.fingerprint, "key": entry.key, "meta": entry.meta, "tensors": specs},
        separators=(",", ":"),
    ).encode()
    body = b"".join([_PREFIX.pack(MAGIC, VERSION, len(header)), header, *pieces])
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, *, key: str, fingerprint: str) -> Entry:
    """Parse and verify `data`, which must be the entry for `key` written by the model `fingerprint`."""
    if len(data) < _PREFIX.size + _CHECKSUM_BYTES:
        raise CorruptEntry("truncated: shorter than the fixed header")
    body, checksum = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
    magic, version, header_length = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise CorruptEntry("not a hybridkv entry (bad magic)")
    if version != VERSION:
        raise CorruptEntry(f"entry format version {version}, this hybridkv reads {VERSION}")
    if hashlib.sha256(body).digest() != checksum:
        raise CorruptEntry("checksum mismatch (flipped or truncated bytes)")
    try:
        header = json.loads(body[_PREFIX.size : _PREFIX.size + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptEntry(f"unreadable header ({err})") from err
    if not isinstance(header, dict):
        raise CorruptEntry("header is not a JSON object")
    if header.get("fingerprint") != fingerprint:
        raise CorruptEntry("written by another model (fingerprint mismatch)")
    if header.get("key") != key:
        raise CorruptEntry("stored under another key")
    try:
        return Entry(
            header["kind"],
            fingerprint,
            key,
            header["meta"],
            _tensors(header["tensors"], body[_PREFIX.size + header_length :]),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CorruptEntry(f"malformed header ({type(err).__name__}: {err})") from err


def _tensors(specs: list[dict], payload: bytes) -> dict[str, torch.Tensor]:
    tensors = {}
    for spec in specs:
        start, nbytes, dtype = spec["offset"], spec["nbytes"], _DTYPES[spec["dtype"]]
        if start < 0 or nbytes < 0 or start + nbytes > len(payload):
            raise ValueError(f"tensor {spec['name']}: byte range outside the payload")
        raw = bytearray(payload[start : start + nbytes])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[spec["name"]] = flat.view(dtype).reshape(spec["shape"])
    return tensors
