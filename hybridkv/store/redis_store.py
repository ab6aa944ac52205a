"""redis://host:port[/db] and valkey://host:port[/db] — a shared server; the distributed case.

Several processes and machines share one cache through it. Every call has a socket timeout, so
a slow or dead server costs a bounded wait and surfaces as StoreError, never as a hang.
"""

from __future__ import annotations

from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from hybridkv.errors import HybridKVError, StoreError

NAMESPACE = "hybridkv:"
DEFAULT_TIMEOUT_S = 1.0


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
    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        parsed = urlparse(url)
        self.url = url
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

    def _call(self, operation, *args):
        try:
            return operation(*args)
        except redis.RedisError as err:
            unavailable = isinstance(err, redis.ConnectionError | redis.TimeoutError)
            raise StoreError(f"{self.url}: {type(err).__name__}: {err}", unavailable) from err

    def get(self, key: str) -> bytes | None:
        return self._call(self._client.get, NAMESPACE + key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._call(self._client.mget, [NAMESPACE + key for key in keys]) if keys else []

    def put(self, key: str, data: bytes) -> None:
        self._call(self._client.set, NAMESPACE + key, data)

    def delete(self, key: str) -> None:
        self._call(self._client.delete, NAMESPACE + key)

    def _keys(self) -> list[bytes]:
        return self._call(lambda: list(self._client.scan_iter(match=NAMESPACE + "*", count=1000)))

    def stats(self) -> dict:
        keys = self._keys()
        sizes = [self._call(self._client.strlen, key) for key in keys]
        memory = self._call(self._client.info, "memory")
        return {"entries": len(keys), "bytes": sum(sizes), "server_used_memory": memory.get("used_memory")}

    def clear(self) -> int:
        keys = self._keys()
        for start in range(0, len(keys), 1000):
            self._call(self._client.delete, *keys[start : start + 1000])
        return len(keys)

    def close(self) -> None:
        self._client.close()
