"""Cache keys that mean the same thing on every process, machine and Python version.

Everything is SHA-256 over explicit bytes (token ids as little-endian int64), never Python's
`hash`. A key binds:

* the **model fingerprint** (`fingerprint`, one recipe for everything cached) — architecture,
  config, a digest of the weights, dtype and what else the bytes depend on, so a cache written by
  one model is never read by another;
* the **tenant salt** (`cache_salt`), so one tenant's prompts never hit another's cache;
* the tokens: a **chained hash** over C-token blocks for prefixes (the key of a prefix of p
  tokens commits to all p tokens and their order), and a position-independent **chunk key**
  (fingerprint + salt + the chunk's tokens only) for chunks reused at any position.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hybridkv.models.loader import HybridModel

DIGEST_BYTES = 32


def _sha(*parts: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        # Length-prefix every part so that no two different part lists hash the same bytes.
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def token_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.reshape(-1).cpu().numpy()
    return np.asarray(tokens, dtype="<i8").tobytes()


DIGESTS_FILE = "hybridkv-digests.json"  # beside a checkpoint: each weight file's digest, computed once


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


WEIGHT_FILES = ("*.safetensors", "*.bin")  # what transformers and vLLM load weights from


def weight_files(directory: Path) -> list[Path]:
    return sorted({path for pattern in WEIGHT_FILES for path in directory.glob(pattern)})


def checkpoint_digest(directory: Path) -> bytes:
    """A checkpoint directory's weights, read once: each weight file's name, size and SHA-256.

    Every byte of every weight file is hashed, so two checkpoints that differ in one weight never
    share a key. The digests are kept in `hybridkv-digests.json` beside the weights, keyed by size
    and modification time (a rewritten file is hashed again), so fingerprinting a 600 GB
    checkpoint reads it the first time only. A directory we cannot write to is hashed every time.
    """
    record_path = directory / DIGESTS_FILE
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    files, changed = [], False
    for path in weight_files(directory):
        stat = path.stat()
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        known = record.get(path.name)
        if not (isinstance(known, dict) and {k: known.get(k) for k in stamp} == stamp and "sha256" in known):
            known, changed = {**stamp, "sha256": _file_digest(path)}, True
            record[path.name] = known
        files.append(f"{path.name}:{stat.st_size}:{known['sha256']}")
    if changed:
        # Written whole under another name, then renamed: vLLM's scheduler and worker processes
        # fingerprint the same checkpoint at once, and neither may read the other's half-written file.
        spare = record_path.with_name(f".{DIGESTS_FILE}.{os.getpid()}")
        with contextlib.suppress(OSError):  # a read-only checkpoint: correct, only slower next time
            spare.write_text(json.dumps(record, indent=1, sort_keys=True))
            spare.replace(record_path)
    return "\n".join(files).encode()


def fingerprint(architecture: str, config: bytes, weights: bytes, dtype: str, *context: bytes) -> str:
    """The one fingerprint of everything hybridkv caches, as hex: SHA-256 over the model's
    architecture, its config, a digest of its weights, the dtype they run in, and `context` (what
    else the cached bytes depend on: an engine's cache layout, the hub commit a checkpoint was
    fetched at). Every other fingerprint is this one with its parts filled in."""
    return _sha(b"hybridkv-model", architecture.encode(), config, weights, dtype.encode(), *context).hex()


def _model_type(config: bytes) -> str:
    try:
        parsed = json.loads(config)
    except ValueError:
        return ""
    return str(parsed.get("model_type", "")) if isinstance(parsed, dict) else ""


def checkpoint_fingerprint(directory: Path, *context: bytes, dtype: str = "") -> str:
    """A checkpoint directory as an engine loads it: its `config.json` as written (and the
    `model_type` in it), every weight file's digest (`checkpoint_digest`), `dtype` and `context`."""
    try:
        config = (directory / "config.json").read_bytes()
    except OSError:
        config = b""
    return fingerprint(_model_type(config), config, checkpoint_digest(directory), dtype, *context)


def _tensor_digest(model: HybridModel) -> bytes:
    weights = hashlib.sha256()
    for module in (model.backbone, model.lm_head):
        for name, tensor in sorted(module.state_dict().items()):
            weights.update(name.encode())
            weights.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
            weights.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return weights.digest()


def _canonical_config(model: HybridModel) -> bytes:
    return json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str).encode()


def model_fingerprint(model: HybridModel) -> str:
    """A loaded model's `fingerprint`: its architecture, canonical config, weights and dtype.

    A checkpoint directory's weights are named by their files' digests (`checkpoint_digest`);
    built-in models, a few MB each, by their tensors' bytes. These are the bytes stored prefixes,
    chunks and arena captures were always keyed by, so they stay readable.
    """
    directory = Path(model.name)
    on_disk = directory.is_dir() and weight_files(directory)
    weights = checkpoint_digest(directory) if on_disk else _tensor_digest(model)
    return fingerprint(model.config.model_type, _canonical_config(model), weights, str(model.dtype))


FAMILY = b"\0family\0"  # in place of the weights in a family's fingerprint: no weight file's name starts so


def family_fingerprint(model: HybridModel, family: str) -> str:
    """The `fingerprint` shared by every checkpoint of one model family that the user names
    `family`: architecture, canonical config and dtype, the family's name in place of the weights.

    Store keys normally commit to the weights, so a cache written by one checkpoint is never read
    by another. Reading another checkpoint's caches (KVShareArena's cross-checkpoint axis: a
    fine-tuned model reusing its base model's caches) is possible only through this explicit
    opt-in: both sides pass the same family name, and entries of other families, or of the same
    weights without the name, stay apart.
    """
    if not family:
        raise ValueError("a cache family needs a name")
    return fingerprint(model.config.model_type, _canonical_config(model), FAMILY + family.encode(), str(model.dtype))


class PrefixKeys:
    """Chained prefix keys for one (model, tenant) namespace, with blocks of `block_tokens` tokens.

    `root` commits to the model and salt; `chain[i]` commits to the first i·C tokens. The key of
    any prefix length p extends `chain[p // C]` with the remaining p mod C tokens, so prefixes
    of every length have keys, while computing all of them costs one pass over the tokens.
    """

    def __init__(self, fingerprint: str, salt: str = "", block_tokens: int = 64) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be positive")
        self.fingerprint = fingerprint
        self.salt = salt
        self.block_tokens = block_tokens
        self.root = _sha(b"hybridkv-prefix", bytes.fromhex(fingerprint), salt.encode(), str(block_tokens).encode())

    def chain(self, tokens) -> list[bytes]:
        """chain[i] = key of the first i·C tokens, for every full block (chain[0] is the root)."""
        data = token_bytes(tokens)
        step = self.block_tokens * 8
        keys = [self.root]
        # b"chunk" and b"partial" are fixed tags hashed into every stored key: changing them orphans stores.
        for start in range(0, len(data) - step + 1, step):
            keys.append(_sha(b"chunk", keys[-1], data[start : start + step]))
        return keys

    def extend(self, key: bytes, tokens) -> bytes:
        """Key of the prefix `key` (a block boundary's) followed by `tokens`, at most one block."""
        if not 0 < len(tokens) <= self.block_tokens:
            raise ValueError(f"extend takes 1 to {self.block_tokens} tokens, not {len(tokens)}")
        return _sha(b"chunk" if len(tokens) == self.block_tokens else b"partial", key, token_bytes(tokens))

    def prefix(self, tokens, length: int, chain: list[bytes] | None = None) -> bytes:
        """Key of tokens[:length]."""
        chain = chain if chain is not None else self.chain(tokens[:length])
        full = length // self.block_tokens
        rest = tokens[full * self.block_tokens : length]
        return chain[full] if not len(rest) else self.extend(chain[full], rest)

    def chunk(self, tokens) -> bytes:
        """Position-independent key of a chunk: the same tokens anywhere give the same key."""
        return _sha(b"hybridkv-chunk", bytes.fromhex(self.fingerprint), self.salt.encode(), token_bytes(tokens))


def variant_slot_key(chain_key: bytes, first_token: int) -> str:
    """Where the list of blocks stored after prefix `chain_key` that start with `first_token` lives
    (`hybridkv.cache.variants`): keyed by what a reader already knows — the exact prefix before
    the block and its first token — so a prompt that diverges *inside* a block still finds the
    stored ones, compares their tokens, and reuses KV up to the exact differing token."""
    return _sha(b"kv", chain_key, token_bytes([first_token])).hex()


def kv_block_key(prefix_key: bytes) -> str:
    """Where a block of KV lives whose prompt, through the block's last token, has key `prefix_key`:
    blocks of prompts that share a start and then diverge inside a block each keep their own entry."""
    return _sha(b"kv-block", prefix_key).hex()


def state_key(prefix_key: bytes) -> str:
    """Where the linear-state checkpoint after exactly the prefix `prefix_key` lives."""
    return _sha(b"state", prefix_key).hex()
