"""Cached prompts in memory, looked up by token-level longest prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.prefix_index import PrefixIndex
from hybridkv.cache.prompt import CachedPrompt, PromptKV
from hybridkv.models.decay import DecaySummary


@dataclass(frozen=True)
class CachedMatch:
    """A cached prompt sharing the first `length` tokens of the new prompt."""

    cached: CachedPrompt
    length: int

    @classmethod
    def miss(cls) -> CachedMatch:
        """No usable prefix: every method then recomputes the whole prompt."""
        return cls(CachedPrompt(torch.empty(0, dtype=torch.long), PromptKV({})), 0)

    def checkpoint_at_or_before(self, position: int) -> int | None:
        return self.cached.last_checkpoint_at_or_before(position)

    @property
    def decay(self) -> DecaySummary | None:
        return self.cached.decay


class PrefixCache:
    def __init__(self) -> None:
        self._entries: list[CachedPrompt] = []
        self._index = PrefixIndex()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, cached: CachedPrompt) -> int:
        self._entries.append(cached)
        entry_id = len(self._entries) - 1
        self._index.insert(cached.tokens.numpy(), entry_id)
        return entry_id

    def lookup(self, prompt: torch.Tensor) -> CachedMatch | None:
        """The longest cached prefix of `prompt`, leaving at least one token to compute.

        The last prompt token is never taken from the cache: its logits are the answer.
        """
        entry_id, length = self._index.longest_match(prompt.reshape(-1)[:-1].numpy())
        if entry_id is None:
            return None
        return CachedMatch(self._entries[entry_id], length)
