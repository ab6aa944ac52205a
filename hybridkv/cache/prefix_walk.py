"""How much of a prompt a store holds, block by block, whatever a block's page holds.

A block of C tokens is stored under the key of its prompt through the block's last token
(`kv_block_key`), with its tokens inside. The walk reads the prompt's own whole blocks by their
chained keys, in order, and stops at the first one that is missing, unusable, or shares no token
with the prompt; a block sharing only some of its tokens ends the match inside it. The block after
the last whole one found cannot be named by a prompt that diverges inside it: its slot's list
(`hybridkv.cache.variants`) gives the stored block sharing the most tokens, read under its own key.
Stored tokens are always compared with the prompt's, so the match is token-level.

What a page holds is its caller's: a `decode` callback checks an entry against the reader's layout
and returns the block's tokens and page, or raises `CorruptEntry` (the entry is then reported and
removed, like one failing its checksum). `StoredPrefixCache` decodes tensors per layer, the vLLM
block store vLLM's opaque block bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from hybridkv.cache.keys import PrefixKeys, kv_block_key, variant_slot_key
from hybridkv.cache.prefix_index import common_length
from hybridkv.cache.variants import BlockVariants
from hybridkv.errors import CorruptEntry
from hybridkv.store.codec import Entry
from hybridkv.store.guarded import GuardedStore

Page = TypeVar("Page")
# (key, verified entry, the block's first position in the prompt) -> (stored tokens, page)
Decode = Callable[[str, Entry, int], tuple[list[int], Page]]

READ_BATCH = 8  # keys per round trip, at most, on a backend with batched reads
PROMPT_END_BLOCKS = 2  # blocks `prompt_ends` reads back from a match's end (a replay tail rarely spans more)


@dataclass
class Block(Generic[Page]):
    """A stored block taken into a match."""

    start: int  # the prompt position of its first token
    tokens: list[int]  # its stored tokens (the prompt's up to `end`, possibly more after)
    page: Page
    end: int  # where the match stands once this block is taken: start + the tokens it shares


@dataclass
class Walk(Generic[Page]):
    """The longest stored prefix of a prompt: its blocks in order, covering [0, length)."""

    blocks: list[Block[Page]] = field(default_factory=list)
    length: int = 0


@dataclass
class PrefixWalk:
    """Blocks stored as entries of `kind` bound to one model's `fingerprint`, listed in their slots
    as entries of `variants_kind`."""

    store: GuardedStore
    fingerprint: str
    kind: str
    variants_kind: str

    def __post_init__(self) -> None:
        self.variants = BlockVariants(self.store, self.fingerprint, self.variants_kind)

    def list_block(self, prefix: bytes, tokens: list[int]) -> None:
        """List a block just stored after `prefix` (a block boundary's chained key) in its slot, for
        readers whose prompt diverges inside it."""
        self.variants.add(variant_slot_key(prefix, int(tokens[0])), tokens)

    def match(self, keys: PrefixKeys, chain: list[bytes], wanted: np.ndarray, decode: Decode[Page]) -> Walk[Page]:
        """The longest stored prefix of `wanted` (int64 tokens), whose chain under `keys` is `chain`."""
        size = keys.block_tokens
        found: Walk[Page] = Walk()
        whole = [kv_block_key(chain[index + 1]) for index in range(len(wanted) // size)]
        for index, (key, entry) in enumerate(self._entries(whole)):
            start = index * size
            if not self._take(found, key, entry, wanted, start, decode):
                break
            if found.length < start + size:  # the prompt diverges inside this block: nothing after agrees
                return found
        index = len(found.blocks)
        start = index * size
        if found.length == start < len(wanted):
            ahead = wanted[start : start + size]
            best = self.variants.best(variant_slot_key(chain[index], int(ahead[0])), ahead)
            if best is not None:
                key = kv_block_key(keys.extend(chain[index], best))
                _, entry = next(self._entries([key]))
                self._take(found, key, entry, wanted, start, decode)
        return found

    def prompt_ends(
        self, keys: PrefixKeys, chain: list[bytes], wanted: np.ndarray, since: int, length: int
    ) -> list[int]:
        """Where shorter stored prompts that `wanted` extends end inside [since, length), in the
        last `PROMPT_END_BLOCKS` blocks of the match, one read each. A block the walk took there
        may be a longer prompt's (a question on a shared document shares the document and the
        question's first words, perhaps past a block boundary), whose entry does not mark the
        shorter one's checkpoint; each block's slot lists every block stored there."""
        size, ends = keys.block_tokens, []
        last = (length - 1) // size
        for index in range(last, max(since // size, last - PROMPT_END_BLOCKS + 1, 0) - 1, -1):
            start = index * size
            ahead = wanted[start:length]
            slot = variant_slot_key(chain[index], int(ahead[0]))
            ends += [
                start + n for n in self.variants.held_whole(slot, ahead) if n < size and since <= start + n < length
            ]
        return sorted(ends)

    def _take(
        self, found: Walk[Page], key: str, entry: Entry | None, wanted: np.ndarray, start: int, decode: Decode[Page]
    ) -> bool:
        """Add the block stored under `key` at `start`, as far as its tokens agree; False if there is none to add."""
        if entry is None:
            return False
        try:
            tokens, page = decode(key, entry, start)
        except CorruptEntry as err:
            self.store.corrupt(key, str(err))
            return False
        common = common_length(tokens, wanted[start : start + len(tokens)])
        if common == 0:
            return False
        found.blocks.append(Block(start, tokens, page, start + common))
        found.length = start + common
        return True

    def _entries(self, keys: list[str]) -> Iterator[tuple[str, Entry | None]]:
        """(key, verified entry or None) of each key in order. A backend with batched reads is read
        1, 2, 4, then up to READ_BATCH keys per round trip, so a match ending early reads at most a
        few blocks past its end; an entry is verified only when the walk reaches it, so one the walk
        never uses is neither counted nor removed if corrupt."""
        index, size = 0, 1
        grow = READ_BATCH if self.store.batched else 1
        while index < len(keys):
            batch = keys[index : index + size]
            for key, data in zip(batch, self.store.get_many(batch), strict=True):
                yield key, self.store.verified(key, data, self.kind, self.fingerprint)
            index += len(batch)
            size = min(2 * size, grow)
