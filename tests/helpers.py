"""Small helpers shared by test modules."""

from __future__ import annotations

import socket

import torch


def lcp(a, b) -> int:
    """Length of the longest common prefix of two sequences (the brute-force oracle)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def greedy_decode(model, cache, first_logits: torch.Tensor, start: int, steps: int, follow: list[int] | None = None):
    """Greedy tokens and the logits seen after each, decoding from `cache` (the oracle for "continues exactly").

    With `follow` (another run's greedy tokens), feed those instead of this run's own argmax: two
    runs computed by different code paths then see the same history at every step, and their logits
    can be compared within a tolerance even where a near-tie on a random-weight model's near-uniform
    distribution lets last-bit noise flip the argmax. (Wherever the reference's top-1 lead exceeds
    twice that tolerance, logits within it imply the same argmax, so nothing is lost.)
    """
    tokens, logits_seen = [], []
    logits = first_logits
    for i in range(steps):
        token = logits.argmax(-1).reshape(1) if follow is None else torch.tensor([follow[i]])
        tokens.append(int(token))
        logits = model.forward(token, cache, start=start + i, logits_to_keep=1)[0]
        logits_seen.append(logits)
    return tokens, torch.stack(logits_seen)
