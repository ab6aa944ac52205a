"""Build a transformers `DynamicCache` by hand from cached pieces, through the cache's own API.

A forward pass continued from the result behaves exactly as if the model had processed the
prefix itself, provided the pieces are the ones it would have produced.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hybridkv.cache.prompt import AttentionKV, LinearStates
from hybridkv.models.loader import HybridModel


def zero_states(model: HybridModel) -> LinearStates:
    from hybridkv.cache.prompt import LinearState

    dtype = model.dtype
    return {
        spec.index: LinearState(
            conv=torch.zeros(spec.conv_shape, dtype=dtype),
            recurrent=torch.zeros(spec.recurrent_shape, dtype=getattr(torch, spec.state_dtype)),
        )
        for spec in model.description.layers
        if spec.kind == "linear"
    }


def set_attention(cache: DynamicCache, kv: AttentionKV) -> None:
    """Make every attention layer of `cache` hold exactly `kv` (replacing what it held)."""
    for index, tensors in kv.items():
        layer = cache.layers[index]
        layer.reset()
        layer.update(tensors["keys"], tensors["values"])
        if "indexer_keys" in tensors:
            layer.update_indexer(tensors["indexer_keys"])


def set_linear_states(cache: DynamicCache, states: LinearStates) -> None:
    """Load one state per linear layer. The cache copies them, so the originals stay intact."""
    for index, state in states.items():
        layer = cache.layers[index]
        kernel = state.conv.shape[-1]
        # First call on a fresh layer: stores the window as-is and marks it as having history,
        # so the next forward continues from it instead of starting a new sequence.
        layer.update_conv_state(state.conv.clone(), conv_kernel_size=kernel)
        layer.update_recurrent_state(state.recurrent)


def assemble_cache(model: HybridModel, kv: AttentionKV | None, states: LinearStates | None) -> DynamicCache:
    """A cache holding attention KV `kv` and linear states `states` (None: zero state)."""
    cache = model.new_cache()
    if kv:
        set_attention(cache, kv)
    set_linear_states(cache, states if states is not None else zero_states(model))
    return cache
