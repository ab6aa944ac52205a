"""The one boundary between hybridkv and transformers' caches: the only code that touches `cache.layers`.

Everything else hands this module typed containers (`hybridkv.models.kv`) and gets them back:

- `new_cache(config)`: the model's own `DynamicCache` layout, built through transformers'
  `Cache(layers=…)` extension point with our `Splicing*` layer classes in place of the
  attention layers (they behave exactly like transformers' until told otherwise); for a model
  that insists on a cache class of its own (MiniMax), an instance of that class too, whose
  linear states live in the cache layers (`_LinearCacheOnLayers`);
- `describe_layers`: what each cache layer holds, read off a cache after a probe forward;
- `read_kv` / `write_kv`, `read_states` / `write_states`, `zero_states`;
- token-indexed tensors a model keeps on the cache object rather than its layers (Qwen4-Exp's
  position ids, `POSITIONS`) travel with the first attention layer's KV;
- `exact_kv_for_first_tokens`: for one forward, each attention layer stores (and attends) given
  exact KV for the first tokens of each row instead of what it computes — how the exact-KV
  replay runs in a single pass. The splice is a method of the layer class, so it holds however
  the model calls `update` (positionally, by keyword, through the class); after the forward every
  layer must have consumed its splice, or the call fails instead of returning inexact numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import (
    Cache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
)

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import architecture_for
from hybridkv.models.describe import LayerSpec, ModelDescription
from hybridkv.models.kv import LayerKV, LinearState, LinearStates, PromptKV
from hybridkv.models.rope import no_shift

# Token-indexed tensors an attention cache layer holds, and the dimension that counts tokens.
ATTENTION_TENSORS: dict[str, int] = {"keys": -2, "values": -2}
INDEXED_ATTENTION_TENSORS: dict[str, int] = {**ATTENTION_TENSORS, "indexer_keys": 1}
# Qwen4-Exp keeps the position ids of every token it has seen on the cache object itself
# (`cache.position_ids`, [3 rope sections, batch, tokens]): its QSA indexer rotates each pooled key
# block by its first token's position. hybridkv keeps them batch first, [batch, 3, tokens], as one
# more token-indexed tensor of the first attention layer. A forward computes them from the positions
# it is given, so a replay's splice never needs them.
POSITIONS = "positions"


class _StopForward(HybridKVError):
    """Raised by an armed attention cache layer to end a forward at it (`kv_at_first_attention`
    catches it; one that escapes says so)."""

    def __init__(self) -> None:
        super().__init__("the forward was ended at the first attention layer (kv_at_first_attention)")


class _Splice:
    """Mixin for an attention cache layer: the next update takes exact KV for each row's first tokens.

    `pending[name] = (token dim, rows)`; row i's tensor (None: keep what the model computed)
    replaces that row's first tokens of the incoming `name` tensor, once, and is then consumed.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pending: dict[str, tuple[int, list[torch.Tensor | None]]] = {}
        # armed by `kv_at_first_attention`: the next update fills it and ends the forward
        self.stop_here: dict[str, torch.Tensor] | None = None

    def _splice(self, name: str, incoming: torch.Tensor) -> torch.Tensor:
        if name not in self.pending:
            return incoming
        dim, rows = self.pending.pop(name)
        spliced = incoming.clone()
        for row, exact in enumerate(rows):
            if exact is None:
                continue
            if exact.shape[dim] > incoming.shape[dim]:
                raise HybridKVError(
                    f"exact KV of {exact.shape[dim]} tokens for a forward of {incoming.shape[dim]} tokens"
                )
            spliced[row : row + 1].narrow(dim, 0, exact.shape[dim]).copy_(exact)
        return spliced

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        key_states, value_states = self._splice("keys", key_states), self._splice("values", value_states)
        if self.stop_here is not None:
            self.stop_here.update(keys=key_states, values=value_states)
            raise _StopForward
        return super().update(key_states, value_states, *args, **kwargs)


class SplicingLayer(_Splice, DynamicLayer):
    """transformers' `DynamicLayer` that can take exact KV for one update."""


class SplicingIndexedLayer(_Splice, DynamicIndexedLayer):
    """transformers' `DynamicIndexedLayer` (DSA) that can take exact KV and indexer keys for one update."""

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        return super().update_indexer(self._splice("indexer_keys", indexer_key_states))


class SplicingHybridLayer(_Splice, LinearAttentionAndFullAttentionLayer):
    """A parallel hybrid's layer (attention and a recurrent mixer side by side, one cache layer:
    Falcon-H1, Zamba): its KV can be spliced, its states load like a linear layer's."""


class _KeepsHistory:
    """Mixin for a sliding-window layer: besides the window transformers keeps (and hands attention),
    it records every token's KV in `history`.

    A sliding layer resumed at an arbitrary L needs the KV of the window before L, and any L may
    be the next match, so the cached prompt must hold all of them; `write_kv` of a prefix then
    leaves the layer exactly as a forward over that prefix would. (transformers' own
    `activate_past_recording` would also keep the linear half's conv windows whole, which changes
    what a parallel hybrid's next forward computes.)
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.history: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for name, incoming in (("keys", key_states), ("values", value_states)):
            kept = self.history.get(name)
            self.history[name] = incoming if kept is None else torch.cat([kept, incoming], dim=-2)
        return super().update(key_states, value_states, *args, **kwargs)


class SplicingSlidingLayer(_Splice, _KeepsHistory, DynamicSlidingWindowLayer):
    """transformers' `DynamicSlidingWindowLayer`, keeping every token and able to take exact KV."""


class SplicingHybridSlidingLayer(_Splice, _KeepsHistory, LinearAttentionAndSlidingWindowAttentionLayer):
    """A parallel hybrid's sliding-window layer (Zaya, Inkling): attention over a window beside
    recurrent or short-conv states."""


# transformers' layer class -> ours (the exact class: a subclass may mean something else).
_SPLICING: dict[type, type] = {
    DynamicLayer: SplicingLayer,
    DynamicIndexedLayer: SplicingIndexedLayer,
    DynamicSlidingWindowLayer: SplicingSlidingLayer,
    LinearAttentionAndFullAttentionLayer: SplicingHybridLayer,
    LinearAttentionAndSlidingWindowAttentionLayer: SplicingHybridSlidingLayer,
}


def _spliceable(layer: object) -> object:
    cls = _SPLICING.get(type(layer))
    if cls is None:
        return layer
    kwargs = {}
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        kwargs["number_of_states"] = layer.number_of_states
    if isinstance(layer, DynamicSlidingWindowLayer):
        kwargs["sliding_window"] = layer.sliding_window
    return cls(**kwargs)


class HybridCache(DynamicCache):
    """The model's `DynamicCache` layout with spliceable attention layers, on the model's device
    (`layer_devices`: where each layer lives when the model is spread over several GPUs)."""

    def __init__(
        self,
        config: PreTrainedConfig,
        device: torch.device | str = "cpu",
        layer_devices: dict[int, torch.device] | None = None,
    ) -> None:
        Cache.__init__(self, layers=[_spliceable(layer) for layer in DynamicCache(config=config).layers])
        self.device = torch.device(device)
        self.layer_devices = layer_devices or {}


class _LinearCacheOnLayers:
    """Mixin for a model's own cache class that keeps one state per linear layer on the cache object,
    through `get_linear_cache` / `set_linear_cache` (MiniMax's `MiniMaxCache`).

    Here that state is the layer's recurrent slot 0 in the ordinary linear cache layer, so
    `describe_layers`, `read_states` and `write_states` handle it as they do every family's, and a
    state written there is what the next forward continues from.
    """

    layers: list

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """The state the layer continues from, or None: the forward starts a new sequence.

        A zero state (what a replay from the first token is seeded with) counts as none. Given a
        state, MiniMax runs its recurrence token by token; given none, its chunked kernel from
        zero: the same numbers (to float reassociation), ~3x faster on 2K tokens on the CPU, so
        a replay from the start costs what a fresh prefill does.
        """
        layer = self.layers[layer_idx]
        if not layer.has_previous_state[0] or not layer.recurrent_states[0].any():
            return None
        return layer.recurrent_states[0]

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        layer = self.layers[layer_idx]
        layer.update_recurrent_state(linear_cache, state_idx=0)
        layer.has_previous_state[0] = True

    def __len__(self) -> int:
        # MiniMaxCache counts its side list of states too; here every layer is in `layers`.
        return len(self.layers)


@functools.cache
def _hybrid_cache_class(model_cache: type[DynamicCache]) -> type[HybridCache]:
    """`HybridCache` that is also an instance of `model_cache` (which the model checks for), with
    that class's linear-state accessors backed by the cache layers. Its `__init__` is not run:
    the layers come from `HybridCache`, and the state list it would create is never used."""
    return type(f"Hybrid{model_cache.__name__}", (_LinearCacheOnLayers, HybridCache, model_cache), {})


def new_cache(
    config: PreTrainedConfig, device: torch.device | str = "cpu", layer_devices: dict[int, torch.device] | None = None
) -> HybridCache:
    """A fresh cache for `config`'s model: `HybridCache`, or the subclass that is also the cache
    class the model's architecture says it requires."""
    arch = architecture_for(config)
    if arch is None or arch.cache_class is None:
        return HybridCache(config, device, layer_devices)
    return _hybrid_cache_class(arch.cache_class())(config, device, layer_devices)


def _on(cache: DynamicCache, index: int, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` where layer `index` of the cache lives (stored pieces arrive on the CPU)."""
    device = getattr(cache, "layer_devices", {}).get(index) or getattr(cache, "device", tensor.device)
    return tensor if tensor.device == device else tensor.to(device)


def _token_dims(layer: object) -> dict[str, int]:
    return INDEXED_ATTENTION_TENSORS if isinstance(layer, DynamicIndexedLayer) else ATTENTION_TENSORS


def _positions(cache: DynamicCache) -> torch.Tensor | None:
    """The position ids a model keeps on the cache object (Qwen4-Exp), batch first; None if it keeps none."""
    positions = getattr(cache, "position_ids", None)
    return None if positions is None else positions.transpose(0, 1)


def _token_tensor(cache: DynamicCache, index: int, name: str) -> torch.Tensor:
    """Every token's `name` tensor that layer `index` has seen (a sliding window's from its history;
    the position ids from the cache object)."""
    if name == POSITIONS:
        return _positions(cache)
    layer = cache.layers[index]
    return layer.history[name] if isinstance(layer, _KeepsHistory) else getattr(layer, name)


def _state_tensors(layer: LinearAttentionCacheLayerMixin) -> dict[str, torch.Tensor]:
    """A linear cache layer's live state tensors by slot name (references)."""
    tensors = {}
    for slot in range(layer.number_of_states):
        if layer.is_conv_states_initialized[slot]:
            tensors[f"conv.{slot}"] = layer.conv_states[slot]
        if layer.is_recurrent_states_initialized[slot]:
            tensors[f"recurrent.{slot}"] = layer.recurrent_states[slot]
    return tensors


def describe_layers(cache: DynamicCache, tokens_seen: int) -> tuple[LayerSpec, ...]:
    """Classify every layer of a cache that has seen `tokens_seen` tokens of one sequence."""
    specs = []
    carry_positions = _positions(cache) is not None
    for index, layer in enumerate(cache.layers):
        linear = isinstance(layer, LinearAttentionCacheLayerMixin)
        attention = isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None
        if not (linear or isinstance(layer, DynamicLayer)):
            raise HybridKVError(f"layer {index}: unsupported cache layer type {type(layer).__name__}")
        if isinstance(layer, DynamicSlidingWindowLayer) and not isinstance(layer, _KeepsHistory):
            raise HybridKVError(
                f"layer {index} is sliding-window attention ({type(layer).__name__}) that keeps only its last "
                "tokens' KV, so no token-level prefix of it can be cached and resumed exactly"
            )
        tensors = _state_tensors(layer) if linear else {}
        dims = _token_dims(layer) if attention else {}
        if dims and carry_positions:  # the first attention layer carries the cache object's positions
            dims, carry_positions = {**dims, POSITIONS: -1}, False
        if tensors and dims:
            kind = "hybrid"
        elif tensors:
            kind = "linear"
        elif dims:
            kind = "indexed_attention" if isinstance(layer, DynamicIndexedLayer) else "attention"
        else:
            kind = "none"  # e.g. Nemotron-H's MLP-only blocks
        per_token = sum(t.numel() * t.element_size() for t in (_token_tensor(cache, index, n) for n in dims))
        specs.append(
            LayerSpec(
                index,
                kind,
                state_tensors=tuple(
                    (name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()
                ),
                state_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                token_dims=tuple(dims.items()),
                kv_bytes_per_token=per_token // tokens_seen,
                window=layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) and dims else None,
            )
        )
    return tuple(specs)


def read_kv(description: ModelDescription, cache: DynamicCache) -> PromptKV:
    """The token-indexed tensors of every attention layer (references, not copies)."""
    return PromptKV(
        {
            index: LayerKV(
                {name: _token_tensor(cache, index, name) for name in description.token_tensors(index)},
                description.token_tensors(index),
            )
            for index in description.attention_layers
        }
    )


def write_kv(cache: DynamicCache, kv: PromptKV, append: bool = False) -> None:
    """Make every attention layer of a fresh `cache` hold exactly `kv`; with `append`, add `kv`
    after what the layers hold (the next tokens of a prompt assembled from pieces)."""
    for index, layer_kv in kv.items():
        layer = cache.layers[index]
        if layer.get_seq_length() and not append:
            raise ValueError(f"layer {index} already holds {layer.get_seq_length()} tokens; write KV to a fresh cache")
        layer.update(_on(cache, index, layer_kv["keys"]), _on(cache, index, layer_kv["values"]))
        if "indexer_keys" in layer_kv.tensors:
            layer.update_indexer(_on(cache, index, layer_kv["indexer_keys"]))
        if POSITIONS in layer_kv.tensors:
            # The model only ever replaces this tensor (torch.cat), never writes into it.
            positions = _on(cache, index, layer_kv[POSITIONS]).transpose(0, 1)
            held = getattr(cache, "position_ids", None)
            cache.position_ids = positions if held is None or not append else torch.cat([held, positions], dim=-1)


def read_states(description: ModelDescription, cache: DynamicCache) -> LinearStates:
    """Copies of every linear layer's current state (the cache updates them in place)."""
    return {
        index: LinearState({name: t.clone() for name, t in _state_tensors(cache.layers[index]).items()})
        for index in description.linear_layers
    }


def write_states(cache: DynamicCache, states: LinearStates) -> None:
    """Load one state per linear layer. The cache copies them, so the originals stay intact."""
    for index, state in states.items():
        layer = cache.layers[index]
        for name, tensor in state.tensors.items():
            kind, slot = name.split(".")
            tensor = _on(cache, index, tensor)
            if kind == "conv":
                # On a fresh layer this stores the window as-is (a copy: it is updated in place later).
                layer.update_conv_state(tensor.clone(), state_idx=int(slot), conv_kernel_size=tensor.shape[-1])
            else:
                layer.update_recurrent_state(tensor, state_idx=int(slot))
            # The next forward continues from this state instead of starting a new sequence.
            layer.has_previous_state[int(slot)] = True


def zero_states(
    description: ModelDescription,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    fills: Mapping[str, int] | None = None,
) -> LinearStates:
    """Every linear layer's state before any token: conv windows in `dtype`, recurrent states and
    windows of token ids (Qwen4-Exp's n-gram context) in their own. `fills`: the value a slot starts
    at where it is not zero, by slot name (Qwen4-Exp's n-gram context starts as end-of-sequence ids)."""

    def state_dtype(name: str, recorded: str) -> torch.dtype:
        own = getattr(torch, recorded)
        return dtype if name.startswith("conv") and own.is_floating_point else own

    fills = fills or {}
    return {
        spec.index: LinearState(
            {
                name: torch.full(shape, fills.get(name, 0), dtype=state_dtype(name, recorded), device=device)
                for name, shape, recorded in spec.state_tensors
            }
        )
        for spec in description.layers
        if spec.state_tensors
    }


@contextmanager
def exact_kv_for_first_tokens(
    description: ModelDescription, cache: DynamicCache, rows: list[PromptKV | None]
) -> Iterator[None]:
    """During one forward, attention layers take row i's `rows[i]` KV for its first tokens.

    The forward covers the replayed tail [s, n) and the suffix [n, end) together; every attention
    layer stores (and attends) the cached exact KV for [s, n) and its own KV only from n on, while
    the linear layers carry their states through the whole span. No KV is copied back afterwards
    and no second call is paid. `rows` has one entry per batch row (None: that row keeps what it
    computes). If the forward leaves a splice unconsumed — transformers called the cache in a way
    this layer class does not see — the call fails: the result would not be exact.
    """
    armed = []
    for index in description.attention_layers:
        if not any(row and index in row.layers for row in rows):
            continue
        layer = cache.layers[index]
        if not isinstance(layer, _Splice):
            raise HybridKVError(f"layer {index} ({type(layer).__name__}) cannot take exact KV for a replay")
        layer.pending = {
            name: (dim, [row[index][name] if row else None for row in rows])
            for name, dim in description.token_tensors(index).items()
            if name != POSITIONS
        }
        armed.append(layer)
    try:
        yield
    except BaseException:
        for layer in armed:
            layer.pending = {}
        raise
    left = {cache.layers.index(layer): sorted(layer.pending) for layer in armed if layer.pending}
    for layer in armed:
        layer.pending = {}
    if left:
        raise HybridKVError(
            f"exact KV was never taken by attention layers {left}: the model did not update its cache "
            "through the cache layer's methods, so the replay would not be exact"
        )


@contextmanager
def kv_at_first_attention(description: ModelDescription, cache: DynamicCache) -> Iterator[dict[str, torch.Tensor]]:
    """During one forward, the KV the first attention layer computes for the forward's tokens, and
    the forward ends there: only the layers before it run (CacheBlend's early-layer check costs
    that much, not a prefill). The dict yielded holds `keys` and `values` once the forward has
    run; the cache is left half-updated and must not be used again.
    """
    layer = cache.layers[description.attention_layers[0]]
    if not isinstance(layer, _Splice):
        raise HybridKVError(f"the first attention layer ({type(layer).__name__}) cannot report its KV")
    captured: dict[str, torch.Tensor] = {}
    layer.stop_here = captured
    try:
        yield captured
    except _StopForward:
        pass
    finally:
        layer.stop_here = None
    if not captured:
        raise HybridKVError("the first attention layer never received its KV: the forward did not reach it")


def shift_kv(model, kv: PromptKV, delta: int) -> PromptKV:
    """`kv` (of `model`) moved `delta` positions later: keys re-rotated, everything else as stored."""
    arch = architecture_for(model.config)
    if arch is None or arch.shift_keys is None:
        raise HybridKVError(
            f"position correction is not known for {model.config.model_type}: its architecture module does not say "
            "how its keys carry positions"
        )
    if delta == 0 or arch.shift_keys is no_shift:
        return kv
    return kv.map(lambda name, t, _dim: arch.shift_keys(model.backbone, t, delta) if name == "keys" else t)
