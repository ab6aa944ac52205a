"""compose (linear, HYPIC): the exact composition of every chunk's state.

Each chunk's first `seam` tokens are recomputed after what came before (its conv windows see the
previous chunk's tail, its recurrences start from the composed state); from the seam on, the
chunk's stored map carries each recurrent state to the chunk's end (S = M · S_seam + B), and the
conv windows are the chunk's own tail. Exact for a layer whose inputs are as when the chunk was
encoded (the first linear layer); deeper layers see inputs that separate encoding changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.errors import HybridKVError
from hybridkv.models import HybridModel
from hybridkv.models.kv import LinearState, LinearStates


@dataclass(frozen=True)
class Compose:
    name: str = "compose"
    needs_maps: bool = True
    stores_states: bool = True

    def seam(self, chunk: EncodedChunk) -> int:
        return chunk.seam

    def after(self, model: HybridModel, chunk: EncodedChunk, at_seam: LinearStates | None) -> LinearStates:
        if not chunk.maps or at_seam is None:
            raise HybridKVError("compose needs chunks encoded with their maps and a recomputed seam")
        return {
            layer: LinearState(
                {**state.tensors, **{slot: m.apply(at_seam[layer][slot]) for slot, m in chunk.maps[layer].items()}}
            )
            for layer, state in chunk.end_states.items()
        }

    def at_question(self, chunks: list[EncodedChunk], carried: LinearStates, question: torch.Tensor) -> LinearStates:
        return carried
