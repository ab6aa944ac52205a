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


def greedy_decode(model, cache, first_logits: torch.Tensor, start: int, steps: int):
    """Greedy tokens and the logits seen after each, decoding from `cache` (the oracle for "continues exactly")."""
    tokens, logits_seen = [], []
    logits = first_logits
    for i in range(steps):
        token = logits.argmax(-1).reshape(1)
        tokens.append(int(token))
        logits = model.forward(token, cache, start=start + i, logits_to_keep=1)[0]
        logits_seen.append(logits)
    return tokens, torch.stack(logits_seen)
