"""Which stored blocks follow a prefix, for the reader that does not know their keys.

A block of KV is stored under the key of its prompt through the block's last token
(`kv_block_key`), so prompts that share a start and diverge inside a block keep a block each (a
RAG header followed by different passages, a system prompt followed by different user turns). A
reader finds the blocks its prompt holds whole by key. The block where its match ends it cannot
name: each (prefix before a block, first token) slot (`variant_slot_key`) lists the token runs of the
last `MAX_VARIANTS` blocks stored after it, newest first, and the reader takes the one sharing the
most tokens with its prompt.

The list is read, changed and written back: two writers updating one slot at once may drop one's
run from it. That is a later miss, never a wrong block: readers always compare tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.cache.prefix_index import common_length
from hybridkv.store.codec import Entry, encode
from hybridkv.store.guarded import GuardedStore

MAX_VARIANTS = 8  # blocks listed per (prefix, first token) slot, newest first


@dataclass
class BlockVariants:
    """The slots' lists in one store, as entries of `kind` bound to one model's `fingerprint`."""

    store: GuardedStore
    fingerprint: str
    kind: str

    def add(self, slot: str, tokens: list[int]) -> None:
        """List a stored block's tokens first in its slot (a run listed already moves to the front)."""
        run = torch.tensor(tokens, dtype=torch.int32)
        runs = [run] + [old for old in self.runs(slot) if not torch.equal(old, run)]
        listed = {str(i): r for i, r in enumerate(runs[:MAX_VARIANTS])}
        self.store.put(slot, encode(Entry(self.kind, self.fingerprint, slot, {}, listed)))

    def runs(self, slot: str) -> list[torch.Tensor]:
        """The token runs listed in `slot`, newest first (none if it is missing or corrupt)."""
        entry = self.store.read_entry(slot, self.kind, self.fingerprint)
        if entry is None:
            return []
        runs = [entry.tensors.get(str(i)) for i in range(len(entry.tensors))]
        if not all(r is not None and r.dtype == torch.int32 and r.dim() == 1 and len(r) for r in runs):
            self.store.corrupt(slot, "a block list that is not token runs")
            return []
        return runs

    def best(self, slot: str, ahead: np.ndarray) -> list[int] | None:
        """The listed block sharing the most leading tokens with `ahead` (None: none shares any).
        A tie goes to the block that ends where the match does: a block's entry carries the
        checkpoint at its end, which the other could not give."""
        best, shared = None, 0
        for run in self.runs(slot):
            common = common_length(run.numpy(), ahead)
            if common > shared or (common == shared and common and len(run) == common):
                best, shared = run, common
        return None if best is None else best.tolist()

    def held_whole(self, slot: str, ahead: np.ndarray) -> list[int]:
        """The lengths of the listed blocks `ahead` begins with whole: prompts stored earlier that
        end inside this block and that the prompt extends (a shared document, before another
        question), each with its checkpoint, if one was stored, at its end."""
        return sorted({len(run) for run in self.runs(slot) if common_length(run.numpy(), ahead) == len(run)})
