"""Build transformers caches from cached pieces, through the adapter (`hybridkv.models.adapter`).

A forward pass continued from the result behaves exactly as if the model had processed the
prefix itself, provided the pieces are the ones it would have produced.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hybridkv.models import adapter
from hybridkv.models.arch import architecture_for
from hybridkv.models.kv import LinearState, LinearStates, PromptKV
from hybridkv.models.loader import HybridModel


def zero_states(model: HybridModel) -> LinearStates:
    """Every linear layer's state before any token (what a fresh cache would start from)."""
    arch = architecture_for(model.config)
    fills = arch.zero_state_fills(model.config) if arch is not None and arch.zero_state_fills else None
    return adapter.zero_states(model.description, model.dtype, model.device, fills)


def assemble_cache(model: HybridModel, kv: PromptKV | None, states: LinearStates | None) -> DynamicCache:
    """A cache holding attention KV `kv` and linear states `states` (None: zero state)."""
    cache = model.new_cache()
    if kv:
        adapter.write_kv(cache, kv)
    adapter.write_states(cache, states if states is not None else zero_states(model))
    return cache


def assemble_batch(
    model: HybridModel, kvs: list[PromptKV | None], states: list[LinearStates | None]
) -> tuple[DynamicCache, torch.Tensor]:
    """One cache for several requests: row i holds `kvs[i]` left-padded to the longest, and `states[i]`.

    Returns the cache and a [rows, longest] mask that is False on the padding. Padding KV is
    zero, which for GLM's DSA indexer also means "not a valid key" (its packed keys end in a
    validity flag), so no query ever selects it; other attention layers get the mask.
    """
    lengths = [len(kv) if kv else 0 for kv in kvs]
    longest = max(lengths)
    cache = model.new_cache()
    if longest:
        template = next(kv for kv in kvs if kv)

        def padded(index: int):
            def pad(name: str, like: torch.Tensor, dim: int) -> torch.Tensor:
                shape = list(like.shape)
                shape[0], shape[dim] = len(kvs), longest
                out = like.new_zeros(shape)
                for row, (kv, length) in enumerate(zip(kvs, lengths, strict=True)):
                    if length:
                        out[row : row + 1].narrow(dim, longest - length, length).copy_(kv[index][name])
                return out

            return template[index].map(pad)

        adapter.write_kv(cache, PromptKV({index: padded(index) for index in template}))
    zero = zero_states(model)
    rows = [row if row is not None else zero for row in states]
    adapter.write_states(cache, {index: LinearState.cat([row[index] for row in rows]) for index in zero})
    mask = torch.arange(longest).unsqueeze(0) >= torch.tensor([longest - length for length in lengths]).unsqueeze(1)
    return cache, mask


def split_batch(model: HybridModel, cache: DynamicCache, row: int, padding: int) -> DynamicCache:
    """Row `row` of a batched cache as a cache of its own, with its `padding` leading KV slots dropped."""
    kv = adapter.read_kv(model.description, cache).row(row)
    own = model.new_cache()
    adapter.write_kv(own, kv.narrow(padding, len(kv)))
    states = adapter.read_states(model.description, cache)
    adapter.write_states(own, {index: state.row(row) for index, state in states.items()})
    return own
