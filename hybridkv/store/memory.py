"""memory://[?capacity=BYTES] — an in-process LRU store with a byte budget."""

from __future__ import annotations

from collections import OrderedDict

from hybridkv.errors import HybridKVError, StoreError

DEFAULT_CAPACITY = 1 << 30


class MemoryStore:
    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY, url: str = "memory://") -> None:
        if capacity_bytes <= 0:
            raise HybridKVError(f"store {url!r}: capacity must be a positive byte count")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self.evictions = 0

    def get(self, key: str) -> bytes | None:
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            raise StoreError(
                f"entry of {len(data)} bytes exceeds the memory store's capacity ({self.capacity_bytes})",
                unavailable=False,
            )
        self.delete(key)
        while self._bytes + len(data) > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted)
            self.evictions += 1
        self._entries[key] = bytes(data)
        self._bytes += len(data)

    def delete(self, key: str) -> None:
        data = self._entries.pop(key, None)
        if data is not None:
            self._bytes -= len(data)

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self._bytes, "capacity_bytes": self.capacity_bytes,
                "evictions": self.evictions}  # fmt: skip

    def clear(self) -> int:
        removed = len(self._entries)
        self._entries.clear()
        self._bytes = 0
        return removed

    def close(self) -> None:
        pass
