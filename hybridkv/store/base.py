"""The store interface: opaque bytes under string keys. Backends know nothing of models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Worth:
    """What a capacity-bound store weighs an entry by (`hybridkv.store.policy`): its `kind`
    ("kv-block", "state", ...), the prefill compute one use of it saves (`saved`, FLOPs), and the
    key of the entry it depends on (`parent`: a KV block on the block before it, a state on the
    block it ends), without which no lookup reaches it. An entry written without one is kind
    "other", saves nothing and depends on nothing."""

    kind: str = "other"
    saved: float = 0.0
    parent: str | None = None


NO_WORTH = Worth()


class Store(Protocol):
    url: str

    def get(self, key: str) -> bytes | None:
        """The bytes under `key`, or None if absent. Raises StoreError when the backend fails."""

    def put(self, key: str, data: bytes, worth: Worth = NO_WORTH) -> bool:
        """Store `data` under `key`, replacing what was there; False when a capacity-bound store's
        rule refuses it (it would evict entries worth more, or its `worth.parent` is not held).
        Raises StoreError when it cannot."""

    def contains(self, key: str) -> bool:
        """Whether an entry is under `key`, without reading it (nor counting it used)."""

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
