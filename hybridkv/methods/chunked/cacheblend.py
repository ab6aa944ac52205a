"""cacheblend (attention, CacheBlend): recompute the tokens whose stored KV deviates most from
what the whole assembled context gives them, at an early layer.

The whole context runs through the layers before the first attention layer (its linear layers
from zero, so they see the real context) and stops there (`adapter.kv_at_first_attention`); each
token's deviation is the squared distance between that layer's in-context KV and the chunk's
stored KV moved to its new place. The most deviating tokens are recomputed in place, as many as
fit in `ratio` of the context (default 15%) counting the executor's warm-up before each run inside
a chunk, seeing everything before them; the rest are used as stored, position-corrected. The early
check costs (first attention layer + 1) layers for every context token, which the cost columns
count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.methods.chunked.base import top_within_budget
from hybridkv.models import HybridModel
from hybridkv.models.adapter import kv_at_first_attention, shift_kv

DEFAULT_RATIO = 0.15
# A token whose KV is off by less than this (squared, relative to its squared norm) has nothing to
# repair: float32 reassociation between one forward and a split one is ~1e-6 relative.
NOTHING_TO_REPAIR = 1e-8


def _per_token(tensor: torch.Tensor, token_dim: int) -> torch.Tensor:
    """Squared norm of each token's slice of `tensor` (batch 1), [tokens]."""
    return tensor.movedim(token_dim, 0).reshape(tensor.shape[token_dim], -1).float().pow(2).sum(-1)


def deviations(model: HybridModel, chunks: list[EncodedChunk]) -> list[torch.Tensor]:
    """For each chunk, each token's squared KV deviation at the first attention layer, relative to
    the squared norm of its stored KV."""
    layer = model.description.attention_layers[0]
    dims = model.description.token_tensors(layer)
    cache = model.new_cache()
    with kv_at_first_attention(model.description, cache) as in_context:
        model.forward(torch.cat([chunk.tokens for chunk in chunks]), cache, start=0)
    out, position = [], 0
    for chunk in chunks:
        stored = shift_kv(model, chunk.kv, position - chunk.start)[layer]
        deviation, norm = torch.zeros(len(chunk)), torch.zeros(len(chunk))
        for name in ("keys", "values"):
            fresh = in_context[name].narrow(dims[name], position, len(chunk)).cpu()
            deviation += _per_token(fresh - stored[name].cpu(), dims[name])
            norm += _per_token(stored[name].cpu(), dims[name])
        out.append(deviation / norm.clamp_min(1e-30))
        position += len(chunk)
    return out


@dataclass(frozen=True)
class CacheBlend:
    ratio: float = DEFAULT_RATIO
    name: str = "cacheblend"
    corrects_positions: bool = True

    def recompute(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[list[int]]:
        per_chunk = [torch.where(d > NOTHING_TO_REPAIR, d, float("-inf")) for d in deviations(model, chunks)]
        return top_within_budget(per_chunk, math.ceil(self.ratio * sum(len(chunk) for chunk in chunks)))

    def selection_layer_tokens(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> int:
        return sum(len(chunk) for chunk in chunks) * (model.description.attention_layers[0] + 1)
