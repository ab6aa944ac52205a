"""position-corrected (attention): every chunk's stored KV at its new place, nothing recomputed.

A chunk's keys were rotated for the positions it was encoded at; moved δ positions later they are
re-rotated by δ (`hybridkv.models.rope`). NoPE attention (GLM-5.3-Flash's MLA and its DSA indexer,
Kimi Linear, Nemotron-H) carries no position in its keys, so there this equals `naive`. The chunks
still never attended to each other: that is what recomputation repairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.models import HybridModel


@dataclass(frozen=True)
class PositionCorrected:
    name: str = "position-corrected"
    corrects_positions: bool = True

    def recompute(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[list[int]]:
        return [[] for _ in chunks]

    def selection_layer_tokens(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> int:
        return 0
