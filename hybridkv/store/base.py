"""The store interface: opaque bytes under string keys. Backends know nothing of models."""

from __future__ import annotations

from typing import Protocol


class Store(Protocol):
    url: str

    def get(self, key: str) -> bytes | None:
        """The bytes under `key`, or None if absent. Raises StoreError when the backend fails."""

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing what was there. Raises StoreError when it cannot."""

    def delete(self, key: str) -> None: ...

    def stats(self) -> dict:
        """Entry count and bytes held, where the backend can tell."""

    def clear(self) -> int:
        """Remove every hybridkv entry; returns how many were removed."""

    def close(self) -> None: ...


def get_many(store: Store, keys: list[str]) -> list[bytes | None]:
    """The bytes under each key, in one round trip where the backend has one (its own
    `get_many`, e.g. redis MGET), else one `get` per key."""
    many = getattr(store, "get_many", None)
    return many(keys) if many is not None else [store.get(key) for key in keys]
