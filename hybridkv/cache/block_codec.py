"""A prompt's blocks and state checkpoints as store entries: the one write and read path that the
stored prefix cache (tensors per layer) and the vLLM block store (vLLM's opaque pages) share.

A block of C tokens is stored under the key of its prompt through the block's last token
(`kv_block_key`), its meta holding its first position and its tokens (a reader compares them with
its own), and is listed in its slot for readers whose prompt diverges inside it (`PrefixWalk`). A
checkpoint is stored under the key of its prompt through its position (`state_key`). What a page
holds, and what else a caller's meta says, stays the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.cache.keys import PrefixKeys, kv_block_key, state_key
from hybridkv.cache.prefix_walk import PrefixWalk
from hybridkv.store.base import NO_WORTH, Worth
from hybridkv.store.codec import Entry, encode
from hybridkv.store.guarded import GuardedStore


@dataclass
class BlockCodec:
    """Entries of one model (`fingerprint`): blocks of `kind`, listed in slots of `kind`-variants,
    and checkpoints of `state_kind`."""

    store: GuardedStore
    fingerprint: str
    kind: str
    state_kind: str
    walk: PrefixWalk = field(init=False)

    def __post_init__(self) -> None:
        self.walk = PrefixWalk(self.store, self.fingerprint, self.kind, f"{self.kind}-variants")

    def block_key(self, keys: PrefixKeys, tokens, index: int, chain: list[bytes] | None = None) -> str:
        """Where block `index` of the prompt `tokens` is stored: the key of the prompt through its last token."""
        end = min((index + 1) * keys.block_tokens, len(tokens))
        return kv_block_key(keys.prefix(tokens, end, chain))

    def put_block(
        self, keys: PrefixKeys, chain: list[bytes], tokens: Sequence[int] | torch.Tensor, index: int,
        tensors: dict[str, torch.Tensor], meta: dict, worth: Worth = NO_WORTH,
    ) -> bool:  # fmt: skip
        """Store block `index` of the prompt `tokens` (its chain under `keys`: `chain`) holding
        `tensors`, with `meta` beside its start and tokens; list it in its slot once stored."""
        start = index * keys.block_tokens
        block_tokens = [int(t) for t in tokens[start : start + keys.block_tokens]]
        key = self.block_key(keys, tokens, index, chain)
        entry = Entry(self.kind, self.fingerprint, key, {"start": start, "tokens": block_tokens, **meta}, tensors)
        if not self.store.put(key, encode(entry), worth):
            return False
        self.walk.list_block(chain[index], block_tokens)
        return True

    def state_key(self, keys: PrefixKeys, tokens, position: int, chain: list[bytes] | None = None) -> str:
        return state_key(keys.prefix(tokens, position, chain))

    def put_state(
        self, keys: PrefixKeys, tokens, position: int, tensors: dict[str, torch.Tensor], meta: dict | None = None,
        chain: list[bytes] | None = None, worth: Worth = NO_WORTH,
    ) -> bool:  # fmt: skip
        """Store the checkpoint at `position` of the prompt `tokens`."""
        key = self.state_key(keys, tokens, position, chain)
        entry = Entry(self.state_kind, self.fingerprint, key, {"position": position, **(meta or {})}, tensors)
        return self.store.put(key, encode(entry), worth)

    def read(self, key: str, kind: str) -> Entry | None:
        """The verified entry of `kind` under `key` (None: missing, or bad and reported)."""
        return self.store.read_entry(key, kind, self.fingerprint)
