"""Small helpers shared by test modules."""

from __future__ import annotations

import socket


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
