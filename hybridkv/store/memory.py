"""memory://[?capacity=BYTES][&policy=lru|value] — an in-process store with a byte budget, kept
by the rule of `hybridkv.store.policy` (the simulator's own bookkeeping): `lru` (the default) or
`value` (compute saved per byte held, each entry's `Worth`)."""

from __future__ import annotations

from collections import Counter

from hybridkv.errors import HybridKVError, StoreError
from hybridkv.store.base import NO_WORTH, Worth
from hybridkv.store.policy import RULES, PolicyStore

DEFAULT_CAPACITY = 1 << 30


class MemoryStore:
    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY, url: str = "memory://", rule: str = "lru") -> None:
        if capacity_bytes <= 0:
            raise HybridKVError(f"store {url!r}: capacity must be a positive byte count")
        if rule not in RULES:
            raise HybridKVError(f"store {url!r}: unknown policy {rule!r} (known: {', '.join(RULES)})")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.rule = rule
        self._entries: dict[str, bytes] = {}
        self._policy = PolicyStore(capacity_bytes, rule, on_evict=self._evicted)
        self.evicted: Counter[str] = Counter()  # entries removed to make room, by kind

    def _evicted(self, victims, _priority) -> None:
        for victim in victims:
            del self._entries[victim.key]
            self.evicted[victim.kind] += 1

    def _tick(self) -> None:
        self._policy.now += 1  # lru's clock: one step per operation

    def get(self, key: str) -> bytes | None:
        return self._read([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._read(keys)

    def _read(self, keys: list[str]) -> list[bytes | None]:
        """The keys' bytes (None: absent), each one found used now."""
        self._tick()
        found = [self._entries.get(key) for key in keys]
        self._policy.use_all([key for key, data in zip(keys, found, strict=True) if data is not None])
        return found

    def put(self, key: str, data: bytes, worth: Worth = NO_WORTH) -> bool:
        if len(data) > self.capacity_bytes:
            raise StoreError(
                f"entry of {len(data)} bytes exceeds the memory store's capacity ({self.capacity_bytes})",
                unavailable=False,
            )
        self._tick()
        policy = self._policy
        if key in policy:
            if policy.entries[key].nbytes == len(data):  # written again (keys name their content): used once more
                policy.use(key)
                self._entries[key] = bytes(data)
                return True
            self.delete(key)  # replaced by other bytes: a new entry
        if worth.parent is not None and worth.parent not in policy:
            return False  # no lookup can reach it
        if not policy.put(key, worth.kind, len(data), worth.saved, worth.parent, rank=key):
            return False
        self._entries[key] = bytes(data)
        return True

    def contains(self, key: str) -> bool:
        return key in self._entries

    def delete(self, key: str) -> None:
        self._policy.discard(key)
        self._entries.pop(key, None)

    def held_bytes(self) -> int:
        return self._policy.used

    @property
    def evictions(self) -> int:
        return sum(self.evicted.values())

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self._policy.used, "capacity_bytes": self.capacity_bytes,
                "policy": self.rule, "evictions": self.evictions, "evicted": dict(self.evicted)}  # fmt: skip

    def clear(self) -> int:
        removed = len(self._entries)
        self._entries.clear()
        self._policy = PolicyStore(self.capacity_bytes, self.rule, on_evict=self._evicted)
        return removed

    def close(self) -> None:
        pass
