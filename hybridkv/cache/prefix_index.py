"""Token-level longest-prefix matching over cached prompts: a radix tree.

Engines match on block boundaries (vLLM: whole blocks, 3,584 tokens for GLM-5.3-Flash); this
matches to the exact token, which is what lets a hit reuse attention KV up to the first
differing token. Edges hold token runs as numpy arrays so a comparison is one vectorised
operation per edge, not a Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Node:
    edge: np.ndarray  # tokens on the edge from the parent to this node
    children: dict[int, _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)  # ids of prompts passing through this node


def common_length(a, b) -> int:
    """How many leading tokens two token runs share."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class PrefixIndex:
    """Maps token sequences to entry ids; `longest_match` finds the entry sharing the most leading tokens."""

    def __init__(self) -> None:
        self._root = _Node(np.empty(0, dtype=np.int64))

    def insert(self, tokens, entry_id: int) -> None:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        node, i = self._root, 0
        node.entries.add(entry_id)
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            if child is None:
                node.children[int(tokens[i])] = _Node(tokens[i:].copy(), entries={entry_id})
                return
            common = common_length(child.edge, tokens[i:])
            if common < len(child.edge):  # split the edge at the first difference
                head = _Node(child.edge[:common], {int(child.edge[common]): child}, set(child.entries))
                child.edge = child.edge[common:]
                node.children[int(tokens[i])] = head
                child = head
            child.entries.add(entry_id)
            node, i = child, i + common

    def longest_match(self, tokens) -> tuple[int | None, int]:
        """(an entry id sharing the longest prefix with `tokens`, that prefix's length)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            if child is None:
                break
            common = common_length(child.edge, tokens[i:])
            i += common
            node = child
            if common < len(child.edge):
                break
        if i == 0:
            return None, 0
        return min(node.entries), i
