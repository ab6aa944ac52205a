"""redis://host:port[/db][?capacity=BYTES] and valkey://… — a shared server; the distributed case.

Several processes and machines share one cache through it. Every call has a socket timeout, so
a slow or dead server costs a bounded wait and surfaces as StoreError, never as a hang.

With a capacity the entries' bytes are an LRU kept on the server: each entry's size and last use
(a shared clock, `#clock`) sit beside it (`#bytes`, `#lru`, the total in `#used`), and a write is
admitted, and the least recently used entries removed to make room, by one Lua script, which the
server runs whole or not at all: writers on any number of processes and machines never count an
entry twice or evict on a stale view, and a client that dies mid-write leaves nothing half done.
Every writer of one database must give the same capacity (an entry written without one is not
counted, and is never evicted by it).
"""

from __future__ import annotations

from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from hybridkv.errors import HybridKVError, StoreError

NAMESPACE = "hybridkv:"
# The capacity's bookkeeping, beside the entries (outside NAMESPACE + "*", which lists entries only)
CLOCK, LRU, SIZES, USED = "hybridkv#clock", "hybridkv#lru", "hybridkv#bytes", "hybridkv#used"
DEFAULT_TIMEOUT_S = 1.0

# KEYS: the entry, CLOCK, LRU, SIZES, USED. ARGV: the bytes, the capacity, the entry's name in LRU,
# NAMESPACE. Returns how many entries it removed.
_PUT = """
local size, capacity, name = string.len(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local used = tonumber(redis.call('GET', KEYS[5]) or '0') - tonumber(redis.call('HGET', KEYS[4], name) or '0')
redis.call('ZREM', KEYS[3], name)
local removed = 0
while used + size > capacity do
  local victim = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  if not victim then break end
  used = used - tonumber(redis.call('HGET', KEYS[4], victim) or '0')
  redis.call('DEL', ARGV[4] .. victim)
  redis.call('HDEL', KEYS[4], victim)
  redis.call('ZREM', KEYS[3], victim)
  removed = removed + 1
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[4], name, size)
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[2]), name)
redis.call('SET', KEYS[5], used + size)
return removed
"""
# KEYS: the entries, then CLOCK and LRU. ARGV: their names in LRU. The entries, each one found
# marked used now.
_GET = """
local n = #ARGV
local values = redis.call('MGET', unpack(KEYS, 1, n))
for i = 1, n do
  if values[i] then redis.call('ZADD', KEYS[n + 2], 'XX', redis.call('INCR', KEYS[n + 1]), ARGV[i]) end
end
return values
"""


def _encode(value) -> bytes | memoryview:
    """What the packer sends for one argument: our keys are str, values bytes, counts int."""
    if isinstance(value, bytes | memoryview):
        return value
    return (value if isinstance(value, str) else repr(value)).encode()


# hiredis parses replies (4x faster GETs of MB-sized entries), but its command packer copies
# every value into one buffer (3x slower SETs); redis-py's own packer sends values over 6,000
# bytes as separate buffers. Take the best of both through the connection's `command_packer`.
_PACKER = PythonRespSerializer(6000, _encode)


class RedisStore:
    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S, capacity_bytes: int | None = None) -> None:
        parsed = urlparse(url)
        self.url = url
        self.capacity_bytes = capacity_bytes
        try:
            db, port = int(parsed.path.strip("/") or 0), parsed.port or 6379
        except ValueError as err:
            raise HybridKVError(f"store {url!r}: expected {parsed.scheme}://HOST:PORT[/DB] ({err})") from None
        pool = redis.ConnectionPool(
            command_packer=_PACKER,
            host=parsed.hostname or "127.0.0.1",
            port=port,
            db=db,
            password=parsed.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # redis-py retries ~10 times with backoff by default; one bounded attempt is the contract.
            retry=Retry(NoBackoff(), 0),
        )
        self._client = redis.Redis(connection_pool=pool)
        self._put_script = self._client.register_script(_PUT)
        self._get_script = self._client.register_script(_GET)
        self.evictions = 0  # entries this client's writes removed to make room

    def _call(self, operation, *args):
        try:
            return operation(*args)
        except redis.RedisError as err:
            unavailable = isinstance(err, redis.ConnectionError | redis.TimeoutError)
            raise StoreError(f"{self.url}: {type(err).__name__}: {err}", unavailable) from err

    def get(self, key: str) -> bytes | None:
        if self.capacity_bytes is not None:
            return self.get_many([key])[0]
        return self._call(self._client.get, NAMESPACE + key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        if self.capacity_bytes is None:
            return self._call(self._client.mget, [NAMESPACE + key for key in keys])
        return self._call(lambda: self._get_script([NAMESPACE + key for key in keys] + [CLOCK, LRU], keys))

    def put(self, key: str, data: bytes) -> None:
        if self.capacity_bytes is None:
            self._call(self._client.set, NAMESPACE + key, data)
            return
        if len(data) > self.capacity_bytes:
            raise StoreError(
                f"entry of {len(data)} bytes exceeds the store's capacity ({self.capacity_bytes})", unavailable=False
            )
        keys = [NAMESPACE + key, CLOCK, LRU, SIZES, USED]
        self.evictions += self._call(lambda: self._put_script(keys, [data, self.capacity_bytes, key, NAMESPACE]))

    def delete(self, key: str) -> None:
        # Under a capacity the entry stays counted until LRU reaches its name: the count errs high
        # (an early eviction), never low.
        self._call(self._client.delete, NAMESPACE + key)

    def _keys(self) -> list[bytes]:
        return self._call(lambda: list(self._client.scan_iter(match=NAMESPACE + "*", count=1000)))

    def stats(self) -> dict:
        keys = self._keys()
        sizes = [self._call(self._client.strlen, key) for key in keys]
        memory = self._call(self._client.info, "memory")
        stats = {"entries": len(keys), "bytes": sum(sizes), "server_used_memory": memory.get("used_memory")}
        if self.capacity_bytes is not None:
            used = self._call(self._client.get, USED)
            stats |= {
                "capacity_bytes": self.capacity_bytes,
                "counted_bytes": int(used or 0),
                "evictions": self.evictions,
            }
        return stats

    def clear(self) -> int:
        keys = self._keys()
        for start in range(0, len(keys), 1000):
            self._call(self._client.delete, *keys[start : start + 1000])
        self._call(self._client.delete, CLOCK, LRU, SIZES, USED)
        return len(keys)

    def close(self) -> None:
        self._client.close()
