"""naive (attention): every chunk's KV concatenated as stored, nothing recomputed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.models import HybridModel


@dataclass(frozen=True)
class Naive:
    name: str = "naive"
    corrects_positions: bool = False

    def recompute(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[list[int]]:
        return [[] for _ in chunks]

    def selection_layer_tokens(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> int:
        return 0
