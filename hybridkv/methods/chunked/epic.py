"""epic (attention, EPIC): recompute the first k tokens of each chunk, where the attention sinks a
chunk encoded on its own puts at its start sit; the other stored keys are moved to their new
positions, as in `position-corrected`. The first chunk sits where it was encoded (at the
prompt's start), so its KV is already exact and it is left as stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.models import HybridModel

DEFAULT_K = 32


@dataclass(frozen=True)
class Epic:
    k: int = DEFAULT_K
    name: str = "epic"
    corrects_positions: bool = True

    def recompute(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[list[int]]:
        return [[] if i == 0 else list(range(min(self.k, len(chunk)))) for i, chunk in enumerate(chunks)]

    def selection_layer_tokens(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> int:
        return 0
