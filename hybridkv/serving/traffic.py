"""What a server sees, as token-id prompts: sessions of requests that go in order.

A session is what one client sends in order (a conversation's turns, or a single request); the
bench's clients each take the next waiting session. Prompts are seeded random token ids: the bench
models have random weights, so text would mean nothing to them, and ids leave the prefix/suffix
seam exactly where the workload puts it (text re-tokenised by a server may not).

- `shared-system`: a few long system prompts (shared prefixes), each followed by user turns of
  varied length, every request its own session: matches end wherever the system prompt ends,
  almost never on vLLM's block grid.
- `multi-turn`: conversations whose every turn is the previous prompt plus a fixed assistant reply
  and a new user message (replies are written here, not generated, so every configuration sees the
  same prompts); a session is one conversation.
- `rag-mix`: an instruction header and retrieved passages, then a question; 70% of requests reuse
  a passage set seen before (a hit on header + passages), 30% bring a new one (a miss).
- `grid-aligned`: a shared prefix of exactly k blocks, then the user's turn: every match ends on
  the grid, where vLLM's own cache loses nothing. The guard against a connector slower than vLLM
  where vLLM is at its best.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.errors import HybridKVError


@dataclass(frozen=True)
class Shape:
    """Sizes every workload draws from: prefix lengths log-uniform in [min_prefix, max_prefix]."""

    min_prefix: int = field(default=1024, metadata={"help": "shortest shared prefix (tokens)"})
    max_prefix: int = field(default=16384, metadata={"help": "longest shared prefix (tokens)"})
    requests: int = field(default=24, metadata={"help": "requests per workload and client count"})
    block_size: int = 2176  # vLLM's block (the bench sets the one the server chose; grid-aligned uses it)


@dataclass(frozen=True)
class Tokens:
    """Where prompt tokens come from: stretches of `text` (a tokenised corpus) at seeded places, or,
    with no text, seeded random ids in [3, vocab) (3: clear of the special ids)."""

    text: tuple[int, ...] = ()
    vocab: int = 500

    def draw(self, rng: random.Random, n: int) -> list[int]:
        if not self.text:
            return [rng.randrange(3, self.vocab) for _ in range(n)]
        if n > len(self.text):
            raise HybridKVError(f"a {n}-token prompt piece is longer than the {len(self.text)}-token text cut from")
        start = rng.randrange(0, len(self.text) - n + 1)
        return list(self.text[start : start + n])

    @property
    def kind(self) -> str:
        return "text" if self.text else "random ids"


Sessions = list[list[list[int]]]


def _prefix_length(rng: random.Random, shape: Shape) -> int:
    return round(math.exp(rng.uniform(math.log(shape.min_prefix), math.log(shape.max_prefix))))


def shared_system(rng: random.Random, shape: Shape, tokens: Tokens) -> Sessions:
    systems = [tokens.draw(rng, _prefix_length(rng, shape)) for _ in range(max(1, shape.requests // 6))]
    return [[systems[i % len(systems)] + tokens.draw(rng, rng.randint(32, 512))] for i in range(shape.requests)]


def multi_turn(rng: random.Random, shape: Shape, tokens: Tokens, turns: int = 4) -> Sessions:
    sessions = []
    for _ in range(max(1, shape.requests // turns)):
        prompt = tokens.draw(rng, _prefix_length(rng, shape) // 2)  # room for the turns to grow
        conversation = [prompt]
        for _ in range(turns - 1):
            reply = tokens.draw(rng, rng.randint(64, 256))  # the assistant's, fixed here
            prompt = prompt + reply + tokens.draw(rng, rng.randint(32, 256))
            conversation.append(prompt)
        sessions.append(conversation)
    return sessions


def rag_mix(rng: random.Random, shape: Shape, tokens: Tokens, miss_rate: float = 0.3) -> Sessions:
    header = tokens.draw(rng, 128)
    seen: list[list[int]] = []
    sessions = []
    for _ in range(shape.requests):
        if not seen or rng.random() < miss_rate:
            seen.append(header + tokens.draw(rng, _prefix_length(rng, shape) - len(header)))
            passages = seen[-1]
        else:
            passages = rng.choice(seen)
        sessions.append([passages + tokens.draw(rng, rng.randint(16, 64))])
    return sessions


def grid_aligned(rng: random.Random, shape: Shape, tokens: Tokens) -> Sessions:
    blocks = range(max(1, shape.min_prefix // shape.block_size), max(1, shape.max_prefix // shape.block_size) + 1)
    count = max(1, shape.requests // 6)
    prefixes = [tokens.draw(rng, rng.choice(blocks) * shape.block_size) for _ in range(count)]
    return [[prefixes[i % len(prefixes)] + tokens.draw(rng, rng.randint(32, 512))] for i in range(shape.requests)]


TRAFFIC: dict[str, Callable[[random.Random, Shape, Tokens], Sessions]] = {
    "shared-system": shared_system,
    "multi-turn": multi_turn,
    "rag-mix": rag_mix,
    "grid-aligned": grid_aligned,
}


def make_sessions(name: str, shape: Shape, seed: int, clients: int, tokens: Tokens = Tokens()) -> Sessions:
    """A workload's sessions, the same for every configuration (and new for every client count, so
    one run cannot warm the next)."""
    if name not in TRAFFIC:
        raise HybridKVError(f"unknown server workload {name!r}: one of {', '.join(TRAFFIC)}")
    return TRAFFIC[name](random.Random(f"hybridkv-serve|{name}|{seed}|{clients}"), shape, tokens)
