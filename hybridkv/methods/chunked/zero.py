"""zero (linear): every linear layer starts the question, and each run of recomputed tokens, from
zero: the chunks' linear states are not used (LinearKV's lower baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.assemble import zero_states
from hybridkv.cache.chunks import EncodedChunk
from hybridkv.models import HybridModel
from hybridkv.models.kv import LinearStates


@dataclass(frozen=True)
class Zero:
    name: str = "zero"
    needs_maps: bool = False
    stores_states: bool = False

    def seam(self, chunk: EncodedChunk) -> int:
        return 0

    def after(self, model: HybridModel, chunk: EncodedChunk, at_seam: LinearStates | None) -> LinearStates:
        return zero_states(model)

    def at_question(self, chunks: list[EncodedChunk], carried: LinearStates, question: torch.Tensor) -> LinearStates:
        return carried
