"""lmcache://<inner URL> — entries kept by LMCache 0.5.6's own storage layer.

For users who already run LMCache: hybridkv's entries (opaque bytes) go into LMCache storage
backends, addressed by LMCache `CacheEngineKey`s whose chunk hash is our SHA-256 key.

    lmcache://cpu?pool_gib=0.5                 LMCache's local CPU backend (in-process LRU)
    lmcache://fs://localhost:0/path/to/dir     its fs:// remote connector (shared directory)
    lmcache://lm://host:port                   its own server (`lmcache_server host port cpu`)
    lmcache://valkey://host:port               a Valkey/Redis server through LMCache's worker pool

Why not `LMCacheEngine`: it stores token chunks of one fixed KV shape; hybridkv's entries are
variable-sized (KV blocks, state checkpoints), so we use the backends beneath it, staging each
entry in a uint8 buffer from LMCache's CPU allocator. Known limits of LMCache 0.5.6 that show
here: its lm:// protocol has no delete (a corrupted entry is skipped on every read instead of
removed) and its client does not reconnect (we reopen after a failure); its Valkey connector
reads one fixed chunk shape, so we talk to its worker pool and keep each entry's length under a
side key.
"""

from __future__ import annotations

import asyncio
import os
import threading
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch

from hybridkv.errors import HybridKVError, StoreError
from hybridkv.store.base import NO_WORTH, Worth

PREFIX = "lmcache://"
NAMESPACE = "hybridkv"
_INNER = ("cpu", "fs", "lm", "valkey")
_FAILURES = (TimeoutError, ConnectionError, OSError, MemoryError, RuntimeError)


def _key(hex_key: str):
    from lmcache.utils import CacheEngineKey

    # Every field must be identical in every process; the chunk hash carries our digest.
    return CacheEngineKey(NAMESPACE, 1, 0, int(hex_key, 16), torch.uint8)


class LMCacheStore:
    def __init__(self, url: str) -> None:
        if not url.startswith(PREFIX):
            raise HybridKVError(f"store {url!r}: expected lmcache://<inner URL>")
        self.url = url
        inner, _, query = url[len(PREFIX) :].partition("?")
        options = {k: v[0] for k, v in parse_qs(query).items()}
        self.inner_url = inner
        self.scheme = "cpu" if inner == "cpu" else urlparse(inner).scheme
        if self.scheme not in _INNER:
            raise HybridKVError(f"store {url!r}: inner URL must be cpu, fs://, lm:// or valkey://")
        try:
            self.pool_gib = float(options.get("pool_gib", 0.5))
            self.timeout_s = float(options.get("timeout_s", 5))
        except ValueError as err:
            raise HybridKVError(f"store {url!r}: pool_gib and timeout_s must be numbers") from err
        self._open()

    # -- lifecycle ---------------------------------------------------------------------------

    def _open(self) -> None:
        # Read by LMCache when it is first imported: no usage reports, no per-operation logging.
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        remote = self.scheme in ("fs", "lm")
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=self.scheme == "cpu",  # otherwise the CPU pool only stages transfers
            max_local_cpu_size=self.pool_gib,
            remote_url=self.inner_url if remote else None,
            remote_serde="naive",
            blocking_timeout_secs=int(max(1, self.timeout_s)),
            extra_config={"save_chunk_meta": True},
        )
        # Required by the constructors; entries are 1-D uint8 buffers, not KV of this shape.
        metadata = LMCacheMetadata(
            model_name=NAMESPACE, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.uint8, kv_shape=(1, 2, 256, 1, 64), role="worker",
        )  # fmt: skip
        self._cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="hybridkv-lmcache")
        self._thread.start()
        self._backend = self._cpu
        self._valkey = None
        self._broken = False
        if remote:
            from lmcache.v1.storage_backend.remote_backend import RemoteBackend

            self._backend = RemoteBackend(config, metadata, self._loop, self._cpu, "cpu")
            if self._backend.connection is None:
                self.close()
                raise StoreError(f"{self.url}: cannot connect to {self.inner_url}")
        elif self.scheme == "valkey":
            from glide_sync import Logger, LogLevel
            from lmcache.v1.storage_backend.valkey.worker_pool import ValkeyWorkerPool

            Logger.set_logger_config(LogLevel.ERROR)
            parsed = urlparse(self.inner_url)
            timeout_ms = int(self.timeout_s * 1000)
            self._valkey = ValkeyWorkerPool(
                [(parsed.hostname, parsed.port or 6379)], num_workers=2, request_timeout=timeout_ms,
                connection_timeout=timeout_ms,
            )  # fmt: skip

    def _ensure_open(self) -> None:
        if self._broken:  # LMCache's remote client never reconnects by itself
            self.close()
            self._open()

    def _call(self, operation):
        try:
            self._ensure_open()
            return operation()
        except StoreError:
            raise
        except _FAILURES as err:
            unavailable = not isinstance(err, MemoryError)
            self._broken = unavailable and self.scheme in ("fs", "lm")
            raise StoreError(f"{self.url}: {type(err).__name__}: {err}", unavailable) from err

    # -- Store interface ---------------------------------------------------------------------

    def put(self, key: str, data: bytes, worth: Worth = NO_WORTH) -> bool:
        """`worth` is not used: LMCache evicts by its own rules."""

        def put() -> None:
            lmkey = _key(key)
            if self._valkey is not None:
                name = lmkey.to_string()
                self._valkey.submit_set(name, data).result(self.timeout_s)
                self._valkey.submit_set(name + "#len", len(data).to_bytes(8, "little")).result(self.timeout_s)
                return
            from lmcache.v1.memory_management import MemoryFormat

            if self.scheme != "lm" and self._backend.contains(lmkey):
                self._backend.remove(lmkey)  # LMCache keeps the first value; the Store contract replaces

            if not 0 < len(data) <= self._cpu.memory_allocator.size:
                raise MemoryError(f"entry of {len(data)} bytes does not fit LMCache's pool ({self.pool_gib} GiB)")
            buffer = self._cpu.allocate(torch.Size([len(data)]), torch.uint8, MemoryFormat.KV_2LTD, busy_loop=False)
            if buffer is None:
                raise MemoryError(f"LMCache's pool cannot hold {len(data)} more bytes")
            try:
                buffer.tensor.numpy()[:] = np.frombuffer(data, np.uint8)
                future = self._backend.submit_put_task(lmkey, buffer)
                if future is not None and hasattr(future, "result"):
                    future.result(self.timeout_s)
            finally:
                buffer.ref_count_down()

        self._call(put)
        return True

    def get(self, key: str) -> bytes | None:
        def get() -> bytes | None:
            lmkey = _key(key)
            if self._valkey is not None:
                name = lmkey.to_string()
                length = bytearray(8)
                if self._valkey.submit_get_into(name + "#len", length).result(self.timeout_s) < 0:
                    return None
                data = bytearray(int.from_bytes(length, "little"))
                if self._valkey.submit_get_into(name, data).result(self.timeout_s) < 0:
                    return None
                return bytes(data)
            buffer = self._backend.get_blocking(lmkey)
            if buffer is None:
                return None
            try:
                return buffer.tensor.numpy().tobytes()
            finally:
                buffer.ref_count_down()

        return self._call(get)

    def contains(self, key: str) -> bool:
        if self.scheme == "lm":  # its protocol has no lookup of its own that we trust: read it
            return self.get(key) is not None

        def contains() -> bool:
            lmkey = _key(key)
            if self._valkey is not None:
                length = bytearray(8)
                return self._valkey.submit_get_into(lmkey.to_string() + "#len", length).result(self.timeout_s) >= 0
            return bool(self._backend.contains(lmkey))

        return self._call(contains)

    def delete(self, key: str) -> None:
        def delete() -> None:
            lmkey = _key(key)
            if self._valkey is not None:
                name = lmkey.to_string()
                self._valkey.submit_delete(name + "#len").result(self.timeout_s)
                self._valkey.submit_delete(name).result(self.timeout_s)
            elif self.scheme != "lm":  # lm:// has no delete
                self._backend.remove(lmkey)

        self._call(delete)

    def stats(self) -> dict:
        entries = len(self._cpu.get_keys()) if self.scheme == "cpu" else None
        return {"entries": entries, "backend": f"LMCache {self.scheme}", "inner_url": self.inner_url}

    def clear(self) -> int:
        if self.scheme != "cpu":
            raise StoreError(f"{self.url}: LMCache's {self.scheme} backend cannot list its entries to clear them")
        keys = list(self._cpu.get_keys())
        for key in keys:
            self._cpu.remove(key)
        return len(keys)

    def close(self) -> None:
        try:
            if self._valkey is not None:
                self._valkey.close()
            elif self._backend is not self._cpu:
                self._backend.close()
            for key in list(self._cpu.get_keys()):  # its clear() assumes KV-shaped entries
                self._cpu.remove(key)
            self._cpu.close()
        finally:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result(
                    self.timeout_s
                )
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(self.timeout_s)
