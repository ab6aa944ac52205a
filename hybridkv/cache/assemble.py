"""Build a transformers `DynamicCache` by hand from cached pieces, through the cache's own API.

A forward pass continued from the result behaves exactly as if the model had processed the
prefix itself, provided the pieces are the ones it would have produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from hybridkv.cache.prompt import AttentionKV, LinearStates
from hybridkv.models.describe import token_tensors
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


def _splice_first(update: Callable, exact: list[torch.Tensor], dims: list[int]) -> Callable:
    """`update` with the first tokens of its incoming tensors replaced by `exact`."""

    def spliced(*incoming: torch.Tensor, **kwargs):
        new = [
            torch.cat([kept, fresh.narrow(dim, kept.shape[dim], fresh.shape[dim] - kept.shape[dim])], dim)
            for kept, fresh, dim in zip(exact, incoming, dims, strict=False)
        ]
        return update(*new, *incoming[len(exact) :], **kwargs)

    return spliced


@contextmanager
def exact_attention_for_first_tokens(model: HybridModel, cache: DynamicCache, kv: AttentionKV) -> Iterator[None]:
    """During one forward, attention layers take `kv` for the first tokens instead of what they compute.

    This is how the exact-KV replay runs in a single pass: the forward covers the replayed tail
    [s, n) and the suffix [n, end) together; every attention layer stores (and attends) the
    cached exact KV for [s, n) and its own KV only from n on, while the linear layers carry their
    states through the whole span. No KV is copied back afterwards and no second call is paid.
    The wrappers are instance attributes that shadow the layer class's methods; they are removed
    on exit, so the cache is an ordinary transformers cache again for decoding.
    """
    kinds = {spec.index: spec.kind for spec in model.description.layers}
    patched: list[tuple[object, str]] = []
    try:
        for index, tensors in kv.items():
            layer = cache.layers[index]
            dims = token_tensors(kinds[index])
            groups = [("update", ["keys", "values"]), ("update_indexer", ["indexer_keys"])]
            for method, names in groups:
                if names[0] not in tensors:
                    continue
                exact = [tensors[name] for name in names]
                setattr(layer, method, _splice_first(getattr(layer, method), exact, [dims[name] for name in names]))
                patched.append((layer, method))
        yield
    finally:
        for layer, method in patched:
            delattr(layer, method)
