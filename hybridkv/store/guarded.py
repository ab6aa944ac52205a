"""A store that never raises into the request path.

Every backend failure — down, timed out, full — becomes a miss (for reads) or a dropped write,
is counted, and is logged once per kind of failure. After a failure the backend is left alone
for `retry_after_s`, so a dead server costs one timeout, not one per block of every request.
The caller then recomputes: a failing store costs time, never correctness.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from hybridkv.errors import CorruptEntry, StoreError
from hybridkv.store.base import NO_WORTH, Store, Worth, get_many
from hybridkv.store.codec import Entry, decode

log = logging.getLogger("hybridkv.store")


class GuardedStore:
    def __init__(self, inner: Store, retry_after_s: float = 5.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.retry_after_s = retry_after_s
        self.counts: Counter[str] = Counter()
        # A backend that is down is left alone entirely; one that refused a write (full) still serves reads.
        self._down_until = {"get": 0.0, "put": 0.0}
        self._logged: set[str] = set()

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            where = "" if message.startswith(self.url) else f"{self.url}: "
            log.warning("%s%s (further %s events are counted, not logged)", where, message, kind)

    def _available(self, operation: str) -> bool:
        return time.monotonic() >= self._down_until[operation]

    def _failed(self, kind: str, err: Exception, operation: str | None = None) -> None:
        self.counts[kind] += 1
        until = time.monotonic() + self.retry_after_s
        if getattr(err, "unavailable", True):
            self._down_until = dict.fromkeys(self._down_until, until)
        elif operation is not None:
            self._down_until[operation] = until
        self._log_once(kind, f"{err}; treating as a miss and recomputing")

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """`get` of every key, in one round trip where the backend has one."""
        if not self._available("get"):
            self.counts["skipped_while_down"] += len(keys)
            return [None] * len(keys)
        try:
            found = get_many(self.inner, keys)
        except (StoreError, OSError) as err:
            self._failed("get_errors", err, "get")
            return [None] * len(keys)
        hits = sum(data is not None for data in found)
        self.counts["hits"] += hits
        self.counts["misses"] += len(keys) - hits
        return found

    def put(self, key: str, data: bytes, worth: Worth = NO_WORTH) -> bool:
        """Whether `data` is now stored: False when the store is down or failed (counted as an
        error) or its capacity's rule refused it (counted as `refused`, per kind)."""
        if not self._available("put"):
            self.counts["skipped_while_down"] += 1
            return False
        try:
            admitted = self.inner.put(key, data, worth)
        except (StoreError, OSError) as err:
            self._failed("put_errors", err, "put")
            return False
        if admitted is False:
            self.counts[f"refused:{worth.kind}"] += 1
            return False
        self.counts["puts"] += 1
        self.counts[f"admitted:{worth.kind}"] += 1
        return True

    def contains(self, key: str) -> bool:
        """Whether the store holds `key` (False when it cannot say: down or failing)."""
        if not self._available("get"):
            return False
        try:
            return self.inner.contains(key)
        except (StoreError, OSError) as err:
            self._failed("get_errors", err, "get")
            return False

    def delete(self, key: str) -> None:
        try:
            self.inner.delete(key)
        except (StoreError, OSError) as err:
            self._failed("delete_errors", err, "put")

    def corrupt(self, key: str, reason: str) -> None:
        """An entry failed verification: count it, log it once, and remove it."""
        self.counts["corrupt"] += 1
        self._log_once("corrupt", f"entry {key[:16]}… rejected ({reason}); removed")
        self.delete(key)

    def read_entry(self, key: str, kind: str, fingerprint: str) -> Entry | None:
        """The verified entry of `kind` under `key`, or None — missing, unreachable, or corrupt
        (then removed)."""
        return self.verified(key, self.get(key), kind, fingerprint)

    @property
    def batched(self) -> bool:
        """Whether the backend reads several keys in one round trip (else get_many gets one by one)."""
        return hasattr(self.inner, "get_many")

    def verified(self, key: str, data: bytes | None, kind: str, fingerprint: str) -> Entry | None:
        """`data` read under `key` as a verified entry of `kind`, or None (missing, or corrupt:
        then removed)."""
        if data is None:
            return None
        try:
            entry = decode(data, key=key, fingerprint=fingerprint)
            if entry.kind != kind:
                raise CorruptEntry(f"expected a {kind} entry, found {entry.kind}")
            return entry
        except CorruptEntry as err:
            self.corrupt(key, str(err))
            return None

    def stats(self) -> dict:
        return dict(self.counts)
