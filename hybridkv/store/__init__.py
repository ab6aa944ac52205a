"""Byte stores behind one small interface, chosen by URL (as LMCache chooses its backends).

memory://[?capacity=BYTES]     in-process LRU with a byte budget
file:///path[?capacity=BYTES]  one file per entry, atomic writes, survives restarts; with a
                               capacity an LRU kept by every process writing to it
redis://host:port[/db]         a shared Redis server ([?capacity=BYTES]: an LRU kept on the server)
valkey://host:port[/db]        a shared Valkey server (same protocol)
lmcache://…                    LMCache's own storage layer (see hybridkv/store/lmcache_store.py)
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from hybridkv.errors import HybridKVError, StoreError
from hybridkv.store.base import Store
from hybridkv.store.guarded import GuardedStore

SCHEMES = ("memory", "file", "redis", "valkey", "lmcache")


def open_store(url: str) -> Store:
    """The backend a URL names. Raises HybridKVError for a malformed or unknown URL, StoreError (a
    HybridKVError) for a backend that cannot be opened."""
    parsed = urlparse(url)
    scheme = parsed.scheme
    if scheme == "memory":
        from hybridkv.store.memory import DEFAULT_CAPACITY, MemoryStore

        return MemoryStore(_capacity(url, parsed.query) or DEFAULT_CAPACITY, url=url)
    if scheme == "file":
        from hybridkv.store.file import FileStore

        path = (parsed.netloc + parsed.path) if parsed.netloc not in ("", "localhost") else parsed.path
        if not path:
            raise HybridKVError(f"store {url!r}: a file store needs a directory, e.g. file:///tmp/hybridkv")
        return FileStore(path, url=url, capacity_bytes=_capacity(url, parsed.query))
    if scheme in ("redis", "valkey"):
        from hybridkv.store.redis_store import RedisStore

        if not parsed.hostname:
            raise HybridKVError(f"store {url!r}: needs a host, e.g. {scheme}://127.0.0.1:6379")
        return RedisStore(url, capacity_bytes=_capacity(url, parsed.query))
    if scheme == "lmcache":
        from hybridkv.store.lmcache_store import LMCacheStore

        return LMCacheStore(url)
    raise HybridKVError(f"unknown store URL {url!r}; use one of: {', '.join(s + '://' for s in SCHEMES)}")


def _capacity(url: str, query: str) -> int | None:
    """The URL's `?capacity=BYTES`, or None when it names none."""
    values = parse_qs(query).get("capacity")
    if values is None:
        return None
    try:
        capacity = int(values[0])
    except ValueError:
        capacity = 0
    if capacity <= 0:
        raise HybridKVError(f"store {url!r}: capacity must be a positive byte count")
    return capacity


__all__ = ["SCHEMES", "GuardedStore", "Store", "StoreError", "open_store"]
