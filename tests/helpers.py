"""Small helpers shared by test modules."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch

from hybridkv.store.memory import MemoryStore


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


def assert_greedy_agrees(model, prompt: list[int], got: list[int], want: list[int], tol: float = 1e-4) -> None:
    """Two greedy continuations of `prompt` computed by different code paths are equal, or first
    differ at a step where the reference (`want`) is a near-tie: its top-1 lead under 2·tol, so
    float noise of `tol` may flip the argmax (a random-weight model's distributions are near-uniform).
    Later steps condition on different tokens and are not compared."""
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            history = torch.tensor(prompt + want[:step], dtype=torch.long)
            logits = model.forward(history, model.new_cache(), start=0, logits_to_keep=1)[-1]
            first, second = logits.float().topk(2).values.tolist()
            assert first - second < 2 * tol, (
                f"step {step}: {a} != {b} though the reference leads by {first - second:.2e}"
            )
            return


def record_answers(monkeypatch) -> dict[tuple[str, str], list[tuple[list[int], list[int]]]]:
    """Make the arena runner's methods record, per (method, budget), each answer's prompt tokens and
    generated tokens (rows keep only the decoded text, which drops ids outside the byte range)."""
    from hybridkv.eval import arena

    recorded: dict[tuple[str, str], list[tuple[list[int], list[int]]]] = {}
    build = arena.get_arena_method

    def recording(name, budget):
        method = build(name, budget)
        answer = method.answer

        def recorded_answer(question, caches, config):
            result = answer(question, caches, config)
            prompt = [int(t) for cache in caches for t in cache.tokens] + list(question)
            recorded.setdefault((name, str(budget)), []).append((prompt, list(result.tokens)))
            return result

        method.answer = recorded_answer
        return method

    monkeypatch.setattr(arena, "get_arena_method", recording)
    return recorded


def flip_one_weight_in_the_middle(weights: Path) -> str:
    """Change the last mantissa bit of the one weight lying at the middle of a safetensors file, in
    place: the file keeps its size and its first and last MiB; the tensor's name is returned."""
    data = bytearray(weights.read_bytes())
    header_bytes = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_bytes])
    middle = len(data) // 2
    start_of_data = 8 + header_bytes
    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        begin, end = (start_of_data + offset for offset in tensor["data_offsets"])
        if begin <= middle < end and tensor["dtype"] in sizes:
            element = begin + (middle - begin) // sizes[tensor["dtype"]] * sizes[tensor["dtype"]]
            data[element] ^= 1  # little-endian: the lowest byte holds the lowest mantissa bits
            weights.write_bytes(data)
            return name
    raise AssertionError(f"no floating-point tensor spans the middle of {weights}")


class RoundTripStore(MemoryStore):
    """A memory store that reads several keys at once, as redis's MGET does, counting round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.trips = 0

    def get(self, key: str) -> bytes | None:
        self.trips += 1
        return super().get(key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        self.trips += 1
        return [MemoryStore.get(self, key) for key in keys]
