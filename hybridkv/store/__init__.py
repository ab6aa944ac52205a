"""Byte stores behind one small interface, chosen by URL (as LMCache chooses its backends).

memory://[?capacity=BYTES]     in-process, with a byte budget (1 GiB unless given)
file:///path[?capacity=BYTES]  one file per entry, atomic writes, survives restarts; with a
                               capacity an LRU kept by every process writing to it
redis://host:port[/db]         a shared Redis server ([?capacity=BYTES]: kept on the server;
                               [&ttl=SECONDS]: entries no one reads expire, a backstop)
valkey://host:port[/db]        a shared Valkey server (same protocol)
lmcache://…                    LMCache's own storage layer (see hybridkv/store/lmcache_store.py)

A capacity is kept by a rule (`&policy=`, `hybridkv.store.policy`, the trace simulator's): `lru`
(the default) or `value` (compute saved per byte held, by each entry's `Worth`), on memory:// and
redis://; file:// keeps LRU.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from hybridkv.errors import HybridKVError, StoreError
from hybridkv.store.base import Store
from hybridkv.store.guarded import GuardedStore
from hybridkv.store.policy import RULES

SCHEMES = ("memory", "file", "redis", "valkey", "lmcache")


def open_store(url: str) -> Store:
    """The backend a URL names. Raises HybridKVError for a malformed or unknown URL, StoreError (a
    HybridKVError) for a backend that cannot be opened."""
    parsed = urlparse(url)
    scheme = parsed.scheme
    if scheme == "memory":
        from hybridkv.store.memory import DEFAULT_CAPACITY, MemoryStore

        return MemoryStore(_capacity(url, parsed.query) or DEFAULT_CAPACITY, url=url, rule=_rule(url, parsed.query))
    if scheme == "file":
        from hybridkv.store.file import FileStore

        path = (parsed.netloc + parsed.path) if parsed.netloc not in ("", "localhost") else parsed.path
        if not path:
            raise HybridKVError(f"store {url!r}: a file store needs a directory, e.g. file:///tmp/hybridkv")
        if _rule(url, parsed.query) != "lru":
            raise HybridKVError(
                f"store {url!r}: a file store keeps its capacity by LRU only (policy=value needs memory:// or redis://)"
            )
        return FileStore(path, url=url, capacity_bytes=_capacity(url, parsed.query))
    if scheme in ("redis", "valkey"):
        from hybridkv.store.redis_store import RedisStore

        if not parsed.hostname:
            raise HybridKVError(f"store {url!r}: needs a host, e.g. {scheme}://127.0.0.1:6379")
        capacity, rule = _capacity(url, parsed.query), _rule(url, parsed.query)
        if rule != "lru" and capacity is None:
            raise HybridKVError(f"store {url!r}: policy={rule} needs a capacity (?capacity=BYTES)")
        return RedisStore(url, capacity_bytes=capacity, rule=rule, ttl_s=_positive(url, parsed.query, "ttl") or 0)
    if scheme == "lmcache":
        from hybridkv.store.lmcache_store import LMCacheStore

        if {"capacity", "policy"} & parse_qs(parsed.query).keys():
            raise HybridKVError(
                f"store {url!r}: an lmcache:// store is kept by LMCache's own eviction (pool_gib for cpu); "
                "capacity and policy are not taken"
            )
        return LMCacheStore(url)
    raise HybridKVError(f"unknown store URL {url!r}; use one of: {', '.join(s + '://' for s in SCHEMES)}")


def _capacity(url: str, query: str) -> int | None:
    """The URL's `?capacity=BYTES`, or None when it names none."""
    return _positive(url, query, "capacity", "a positive byte count")


def _positive(url: str, query: str, name: str, what: str = "a positive whole number") -> int | None:
    """The URL's `name=` as a positive int, or None when it names none."""
    values = parse_qs(query).get(name)
    if values is None:
        return None
    try:
        value = int(values[0])
    except ValueError:
        value = 0
    if value <= 0:
        raise HybridKVError(f"store {url!r}: {name} must be {what}")
    return value


def _rule(url: str, query: str) -> str:
    """The URL's `policy=` (lru unless named)."""
    rule = parse_qs(query).get("policy", ["lru"])[0]
    if rule not in RULES:
        raise HybridKVError(f"store {url!r}: unknown policy {rule!r} (known: {', '.join(RULES)})")
    return rule


__all__ = ["SCHEMES", "GuardedStore", "Store", "StoreError", "open_store"]
