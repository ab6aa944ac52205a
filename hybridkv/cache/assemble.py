"""Build a transformers `DynamicCache` by hand from cached pieces, through the cache's own API.

A forward pass continued from the result behaves exactly as if the model had processed the
prefix itself, provided the pieces are the ones it would have produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from hybridkv.cache.prompt import AttentionKV, LinearState, LinearStates, kv_slice, read_attention
from hybridkv.models.loader import HybridModel


def zero_states(model: HybridModel) -> LinearStates:
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


def _splice_rows(update: Callable, rows: list[list[torch.Tensor] | None], dims: list[int]) -> Callable:
    """`update` with row i's first tokens of each incoming tensor replaced by `rows[i]`."""

    def spliced(*incoming: torch.Tensor, **kwargs):
        new = [fresh.clone() for fresh in incoming[: len(dims)]]
        for row, exact in enumerate(rows):
            for tensor, kept, dim in zip(new, exact or [], dims, strict=False):
                tensor[row : row + 1].narrow(dim, 0, kept.shape[dim]).copy_(kept)
        return update(*new, *incoming[len(dims) :], **kwargs)

    return spliced


@contextmanager
def exact_attention_for_first_tokens(
    model: HybridModel, cache: DynamicCache, rows: list[AttentionKV | None]
) -> Iterator[None]:
    """During one forward, attention layers take row i's `rows[i]` KV for its first tokens.

    This is how the exact-KV replay runs in a single pass: the forward covers the replayed tail
    [s, n) and the suffix [n, end) together; every attention layer stores (and attends) the
    cached exact KV for [s, n) and its own KV only from n on, while the linear layers carry their
    states through the whole span. No KV is copied back afterwards and no second call is paid.
    `rows` has one entry per batch row (None: that row keeps what it computes). The wrappers are
    instance attributes that shadow the layer class's methods; they are removed on exit, so the
    cache is an ordinary transformers cache again for decoding.
    """
    patched: list[tuple[object, str]] = []
    try:
        for index in model.description.attention_layers:
            if not any(row and row.get(index) for row in rows):
                continue
            layer = cache.layers[index]
            dims = model.description.token_tensors(index)
            for method, names in (("update", ["keys", "values"]), ("update_indexer", ["indexer_keys"])):
                if names[0] not in dims:
                    continue
                exact = [[row[index][name] for name in names] if row else None for row in rows]
                setattr(layer, method, _splice_rows(getattr(layer, method), exact, [dims[name] for name in names]))
                patched.append((layer, method))
        yield
    finally:
        for layer, method in patched:
            delattr(layer, method)


def assemble_batch(
    model: HybridModel, kvs: list[AttentionKV | None], states: list[LinearStates | None]
) -> tuple[DynamicCache, torch.Tensor]:
    """One cache for several requests: row i holds `kvs[i]` left-padded to the longest, and `states[i]`.

    Returns the cache and a [rows, longest] mask that is False on the padding. Padding KV is
    zero, which for GLM's DSA indexer also means "not a valid key" (its packed keys end in a
    validity flag), so no query ever selects it; other attention layers get the mask.
    """
    lengths = [_kv_length(model, kv) for kv in kvs]
    longest = max(lengths)
    cache = model.new_cache()
    if longest:
        batched: AttentionKV = {}
        for index in model.description.attention_layers:
            template = next(kv[index] for kv in kvs if kv)
            batched[index] = {}
            for name, dim in model.description.token_tensors(index).items():
                shape = list(template[name].shape)
                shape[0], shape[dim] = len(kvs), longest
                padded = template[name].new_zeros(shape)
                for row, (kv, length) in enumerate(zip(kvs, lengths, strict=True)):
                    if length:
                        padded[row : row + 1].narrow(dim, longest - length, length).copy_(kv[index][name])
                batched[index][name] = padded
        set_attention(cache, batched)
    zero = zero_states(model)
    rows = [row if row is not None else zero for row in states]
    set_linear_states(
        cache,
        {
            index: LinearState(
                conv=torch.cat([row[index].conv for row in rows]),
                recurrent=torch.cat([row[index].recurrent for row in rows]),
            )
            for index in zero
        },
    )
    mask = torch.arange(longest).unsqueeze(0) >= torch.tensor([longest - length for length in lengths]).unsqueeze(1)
    return cache, mask


def _kv_length(model: HybridModel, kv: AttentionKV | None) -> int:
    if not kv:
        return 0
    index = model.description.attention_layers[0]
    return kv[index]["keys"].shape[model.description.token_tensors(index)["keys"]]


def split_batch(model: HybridModel, cache: DynamicCache, row: int, padding: int) -> DynamicCache:
    """Row `row` of a batched cache as a cache of its own, with its `padding` leading KV slots dropped."""
    rows = {
        index: {name: tensor[row : row + 1] for name, tensor in tensors.items()}
        for index, tensors in read_attention(model, cache).items()
    }
    own = model.new_cache()
    set_attention(own, kv_slice(model, rows, padding, _kv_length(model, rows)))
    set_linear_states(
        own,
        {
            index: LinearState(
                conv=cache.layers[index].conv_states[0][row : row + 1],
                recurrent=cache.layers[index].recurrent_states[0][row : row + 1],
            )
            for index in model.description.linear_layers
        },
    )
    return own
