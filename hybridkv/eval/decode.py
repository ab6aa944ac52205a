"""Greedy continuation from a prepared cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hybridkv.models import HybridModel


def greedy_continue(
    model: HybridModel,
    cache: DynamicCache,
    last_logits: torch.Tensor,
    position: int,
    steps: int,
    stop: frozenset[int] = frozenset(),
) -> list[int]:
    """Decode up to `steps` tokens greedily; `last_logits` are the prompt's final next-token logits.

    Ends early after a token in `stop` (kept as the last token): the arena passes the model's end
    of sequence, which the trained built-in models emit after their answer's newline.
    """
    tokens = []
    logits = last_logits
    for step in range(steps):
        token = int(logits.argmax(-1))
        tokens.append(token)
        if token in stop:
            break
        if step + 1 < steps:
            logits = model.forward(torch.tensor([token]), cache, start=position + step, logits_to_keep=1)[-1]
    return tokens
