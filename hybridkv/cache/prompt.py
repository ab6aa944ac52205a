"""A cached prompt: its attention KV at token granularity and optional linear-state checkpoints.

Attention layers cache one entry per token (keys, values, and for DSA layers the indexer's
packed keys), so any prefix of the prompt can be handed back by slicing. Linear layers cache a
single state that summarises everything before it; it exists only at the positions where we
stopped and copied it — the checkpoints, every `checkpoint_interval` tokens (vLLM's align-mode
semantics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from hybridkv.models.decay import DecaySummary, record_decay, summarise
from hybridkv.models.loader import HybridModel


@dataclass(frozen=True)
class LinearState:
    """One linear layer's state after some token: short-conv window and recurrent/SSM state."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


# layer index -> tensor name -> tensor (token dimension as in `token_tensors`)
AttentionKV = dict[int, dict[str, torch.Tensor]]
# layer index -> state
LinearStates = dict[int, LinearState]


@dataclass
class CachedPrompt:
    tokens: torch.Tensor  # 1-D int64
    attention: AttentionKV
    checkpoints: dict[int, LinearStates] = field(default_factory=dict)  # position -> states
    checkpoint_interval: int | None = None
    decay: DecaySummary | None = None  # how fast each linear layer forgot over each chunk (adaptive-replay)

    def __len__(self) -> int:
        return self.tokens.numel()

    def kv_prefix(self, model: HybridModel, n: int) -> AttentionKV:
        """Views (no copies) of the attention KV of tokens [0, n)."""
        return self.kv_range(model, 0, n)

    def kv_range(self, model: HybridModel, start: int, end: int) -> AttentionKV:
        """Views (no copies) of the attention KV of tokens [start, end)."""
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"tokens [{start}, {end}) asked from a cached prompt of {len(self)}")
        return kv_slice(model, self.attention, start, end)

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.attention.values() for t in tensors.values())

    def state_bytes(self) -> int:
        return sum(state.nbytes for states in self.checkpoints.values() for state in states.values())

    def last_checkpoint_at_or_before(self, position: int) -> int | None:
        eligible = [p for p in self.checkpoints if p <= position]
        return max(eligible) if eligible else None


def kv_slice(model: HybridModel, kv: AttentionKV, start: int, end: int) -> AttentionKV:
    """Views (no copies) of tokens [start, end) of every tensor in `kv`."""
    return {
        layer: {
            name: tensors[name].narrow(dim, start, end - start)
            for name, dim in model.description.token_tensors(layer).items()
        }
        for layer, tensors in kv.items()
    }


def read_attention(model: HybridModel, cache: DynamicCache) -> AttentionKV:
    """The token-indexed tensors of every attention layer (references, not copies)."""
    return {
        index: {name: getattr(cache.layers[index], name) for name in model.description.token_tensors(index)}
        for index in model.description.attention_layers
    }


def read_linear_states(model: HybridModel, cache: DynamicCache) -> LinearStates:
    """Copies of every linear layer's current state (the cache updates them in place)."""
    return {
        index: LinearState(
            conv=cache.layers[index].conv_states[0].clone(),
            recurrent=cache.layers[index].recurrent_states[0].clone(),
        )
        for index in model.description.linear_layers
    }


def capture_prompt(model: HybridModel, tokens: torch.Tensor, checkpoint_interval: int | None = None) -> CachedPrompt:
    """Prefill `tokens` and keep what an engine would cache.

    With a checkpoint interval B the prompt is prefilled in B-token chunks (as an engine with
    block-aligned state checkpoints does) and every linear state is copied at each multiple of
    B inside the prompt. Without one it is a single pass and no state is kept.
    """
    if checkpoint_interval is not None and checkpoint_interval < 1:
        raise ValueError(f"checkpoint interval must be a positive token count, got {checkpoint_interval}")
    tokens = tokens.reshape(-1).to(torch.long)
    cache = model.new_cache()
    step = checkpoint_interval or len(tokens)
    checkpoints: dict[int, LinearStates] = {}
    with record_decay(model) as gates:
        for start in range(0, len(tokens), step):
            end = min(start + step, len(tokens))
            model.forward(tokens[start:end], cache, start=start)
            if checkpoint_interval is not None and end % checkpoint_interval == 0:
                checkpoints[end] = read_linear_states(model, cache)
    decay = summarise(gates) if gates is not None else None
    return CachedPrompt(tokens, read_attention(model, cache), checkpoints, checkpoint_interval, decay)
