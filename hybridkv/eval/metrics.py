"""Fidelity of a method's next-token distributions against a reference (definitions: README.md)."""

from __future__ import annotations

import torch


def kl_mean(reference_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference ‖ method) between next-token distributions, in nats."""
    ref = reference_logits.float().log_softmax(-1)
    out = method_logits.float().log_softmax(-1)
    per_position = (ref.exp() * (ref - out)).sum(-1)
    return float(per_position.mean().clamp_min(0.0))  # tiny negatives are float rounding


def top1_agreement(reference_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """Fraction of positions whose most likely next token is the same."""
    return float((reference_logits.argmax(-1) == method_logits.argmax(-1)).float().mean())


def greedy_agreement(reference_tokens: list[int], method_tokens: list[int]) -> float:
    """Length of the common leading run of two greedy continuations, as a fraction of G.

    Each continuation decodes on its own output, so once they differ the rest is not comparable;
    the common prefix is the honest count.
    """
    length = len(reference_tokens)
    for i, (a, b) in enumerate(zip(reference_tokens, method_tokens, strict=True)):
        if a != b:
            return i / length
    return 1.0
