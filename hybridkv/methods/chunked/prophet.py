"""prophet (attention, ProphetKV): recompute the context tokens the question attends to most.

CacheBlend picks tokens whose KV changed most, which may be salient to the context but not to
the question ("crowding out"); ProphetKV spends the budget on what the question needs. Here the
question runs once over the chunks' stored KV, moved to their new places, with each linear layer
started from the last chunk's state; every context token's relevance is the attention the
question's tokens pay it, summed over heads and question tokens and averaged over attention
layers (each layer's weights sum to one per query, so layers weigh alike). The most relevant
tokens after the leading chunk are recomputed in place, as many as fit in `ratio` of them (default
20%, ProphetKV's budget) counting the executor's warm-up before each run inside a chunk (the fact
sentence a question asks about lies mid-passage: recomputed from a state that skipped the tokens
before it, it came out worse than stored); the leading chunk sits where it was encoded and is exact
as stored. This is the selection stage of ProphetKV; its second, layer-wise refinement is not
reproduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.methods.chunked.base import top_within_budget
from hybridkv.models import HybridModel
from hybridkv.models.adapter import write_kv, write_states
from hybridkv.models.kv import PromptKV
from hybridkv.models.rope import shift_kv

DEFAULT_RATIO = 0.2


def relevance(model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[torch.Tensor]:
    """For each chunk, the attention each of its tokens receives from the question."""
    cache = model.new_cache()
    moved, position = [], 0
    for chunk in chunks:
        moved.append(shift_kv(model, chunk.kv, position - chunk.start))
        position += len(chunk)
    write_kv(cache, PromptKV.cat(moved))
    write_states(cache, chunks[-1].end_states)
    layers = model.attention_weights(question.reshape(-1), cache, start=position)
    received = sum(weights[:, :, :position].sum(dim=(0, 1)) for weights in layers) / len(layers)
    return list(received.split([len(chunk) for chunk in chunks]))


@dataclass(frozen=True)
class Prophet:
    ratio: float = DEFAULT_RATIO
    name: str = "prophet"
    corrects_positions: bool = True

    def recompute(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[list[int]]:
        if len(chunks) < 2:
            return [[] for _ in chunks]
        scores = relevance(model, chunks, question)
        budget = math.ceil(self.ratio * sum(len(chunk) for chunk in chunks[1:]))
        return top_within_budget(scores, budget, skip_chunks=1)

    def selection_layer_tokens(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> int:
        return question.numel() * model.description.num_layers if len(chunks) > 1 else 0
