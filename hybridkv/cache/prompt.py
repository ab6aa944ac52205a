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

from hybridkv.models.adapter import read_kv, read_states
from hybridkv.models.decay import DecaySummary, record_decay, summarise
from hybridkv.models.kv import LinearState, LinearStates, PromptKV
from hybridkv.models.loader import HybridModel

__all__ = ["CHECKPOINT_INTERVAL", "CachedPrompt", "LinearState", "LinearStates", "PromptKV", "capture_prompt"]

# The checkpoint interval B (tokens between linear-state checkpoints) that `hybridkv validate` and
# the arena's checkpoint methods use unless told otherwise.
CHECKPOINT_INTERVAL = 384


@dataclass
class CachedPrompt:
    tokens: torch.Tensor  # 1-D int64
    attention: PromptKV
    checkpoints: dict[int, LinearStates] = field(default_factory=dict)  # position -> states
    checkpoint_interval: int | None = None
    decay: DecaySummary | None = None  # how fast each linear layer forgot over each span (adaptive-replay)

    def __len__(self) -> int:
        return self.tokens.numel()

    def kv_prefix(self, n: int) -> PromptKV:
        """Views (no copies) of the attention KV of tokens [0, n)."""
        return self.kv_range(0, n)

    def kv_range(self, start: int, end: int) -> PromptKV:
        """Views (no copies) of the attention KV of tokens [start, end)."""
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"tokens [{start}, {end}) asked from a cached prompt of {len(self)}")
        return self.attention.narrow(start, end)

    def kv_bytes(self) -> int:
        return self.attention.nbytes

    def state_bytes(self) -> int:
        return sum(state.nbytes for states in self.checkpoints.values() for state in states.values())

    def last_checkpoint_at_or_before(self, position: int) -> int | None:
        eligible = [p for p in self.checkpoints if p <= position]
        return max(eligible) if eligible else None


def capture_prompt(model: HybridModel, tokens: torch.Tensor, checkpoint_interval: int | None = None) -> CachedPrompt:
    """Prefill `tokens` and keep what an engine would cache.

    With a checkpoint interval B the prompt is prefilled in B-token pieces (as an engine with
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
                checkpoints[end] = read_states(model.description, cache)
    decay = summarise(gates) if gates is not None else None
    return CachedPrompt(tokens, read_kv(model.description, cache), checkpoints, checkpoint_interval, decay)
