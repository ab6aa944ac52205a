"""prophet (attention, ProphetKV): recompute the context tokens the question attends to most.

CacheBlend picks tokens whose KV changed most, which may be salient to the context but not to
the question ("crowding out"); ProphetKV spends the budget on what the question needs, in two
stages. Stage one: the question runs once over the chunks' stored KV, moved to their new places,
with each linear layer started from the last chunk's state, and at each attention layer every
context token's relevance is the attention the question's tokens pay it, the softmax taken over
the context's keys alone, summed over heads and question tokens. Stage two fuses the layers with
equal weights (their mean) into one set for every layer: the most relevant tokens after the leading
chunk, as many as fit in `ratio` of them (default 20%, ProphetKV's budget) counting the executor's
warm-up before each run inside a chunk (the fact sentence a question asks about lies mid-passage:
recomputed from a state that skipped the tokens before it, it came out worse than stored). The
leading chunk sits where it was encoded and is exact as stored.

Only the paper's abstract was readable here; the two stages follow the equations that public
reimplementations quote from it (per layer, softmax(Q_s K'_{1:C}^T / sqrt(d_k)) summed over the
query's tokens; then the uniform mean over layers and one top-p set).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.methods.chunked.base import top_within_budget
from hybridkv.models import HybridModel
from hybridkv.models.adapter import shift_kv, write_kv, write_states
from hybridkv.models.kv import PromptKV

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
    # transformers' softmax also covers the question's own keys; renormalised over the context's,
    # each query row is softmax(q K'_{1:C}^T / sqrt(d_k)), and every layer gives the context the
    # same total (heads × question tokens), so the mean weighs layers alike
    received = sum(_over_context(weights, position).sum(dim=(0, 1)) for weights in layers) / len(layers)
    return list(received.split([len(chunk) for chunk in chunks]))


def _over_context(weights: torch.Tensor, context: int) -> torch.Tensor:
    """[heads, queries, keys] attention weights restricted to the first `context` keys, each row
    renormalised to sum to one."""
    kept = weights[:, :, :context]  # float32 already (`attention_weights`)
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


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
