"""file:///path[?capacity=BYTES] — one file per entry under a directory; survives restarts, shareable
by the processes of one host.

Writes go to a temporary file in the same directory and are renamed into place, so a reader (or a
crash) never sees half an entry.

With a capacity the store is an LRU over its entries' bytes, kept by every process that writes to
it: a read marks its entry used (the file's modification time, `_mark_used`), and each write is admitted under an
exclusive lock on the directory (`.lock`), where the bytes held are read from `.usage`. When the
entry does not fit, the store is scanned and the least recently used entries are removed until it
does; only then is the entry renamed into place, so the entries on disk never exceed the capacity
once a write is done. `.usage` is only ever an estimate from above: a write counts its bytes before
its file lands, and an eviction that dies half way leaves its removed entries as misses and the
estimate high, which the next write that does not fit corrects by scanning. Removing an entry can
only make a lookup miss, never hit the wrong bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hybridkv.errors import HybridKVError, StoreError
from hybridkv.store.base import NO_WORTH, Worth

SUFFIX = ".hkv"
LOCK, USAGE = ".lock", ".usage"
STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died


class FileStore:
    def __init__(self, root: str | Path, url: str | None = None, capacity_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise HybridKVError(f"store {self.url!r}: capacity must be a positive byte count")
        self.capacity_bytes = capacity_bytes
        self.evictions = 0  # entries this process removed to make room
        self._last_stamp = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"{self.root}: cannot create store directory ({err.strerror})") from err

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"file store keys are lowercase hex digests, got {key!r}")
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise StoreError(f"{self.root}: read failed ({err.strerror})") from err
        if self.capacity_bytes is not None:
            with contextlib.suppress(OSError):  # evicted since: the bytes read are still whole
                self._mark_used(path)
        return data

    def put(self, key: str, data: bytes, worth: Worth = NO_WORTH) -> bool:
        """`worth` is not used: a file store's capacity is an LRU (its entries carry no ledger)."""
        path = self._path(key)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            raise StoreError(
                f"entry of {len(data)} bytes exceeds the file store's capacity ({self.capacity_bytes})",
                unavailable=False,
            )
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                if self.capacity_bytes is None:
                    os.replace(tmp, path)
                else:
                    with self._locked():
                        self._make_room(path, len(data))
                        os.replace(tmp, path)
                        self._mark_used(path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as err:
            raise StoreError(f"{self.root}: write failed ({err.strerror})") from err
        return True

    def _mark_used(self, path: Path) -> None:
        """Stamp the entry used now, in nanoseconds (the file system's own clock ticks in
        milliseconds), later than anything this process stamped before: LRU's order."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        os.utime(path, ns=(self._last_stamp, self._last_stamp))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's lock, held by one process (and thread) at a time; freed if it dies."""
        with open(self.root / LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _make_room(self, path: Path, nbytes: int) -> None:
        """Under the lock: count `nbytes` for `path` (replacing what it held), evicting the least
        recently used entries first when they do not fit."""
        usage = self.root / USAGE
        try:
            held = int(usage.read_text() or 0)
        except (OSError, ValueError):
            held = None  # no estimate (a new store, or a torn one): scan
        with contextlib.suppress(OSError):
            held = None if held is None else held - path.stat().st_size  # replaced, not added
        if held is None or held + nbytes > self.capacity_bytes:
            held = self._evict(path, self.capacity_bytes - nbytes)
        self._write_usage(held + nbytes)

    def _evict(self, keep: Path, budget: int) -> int:
        """Remove the least recently used entries (never `keep`) until the others hold at most
        `budget` bytes; the bytes they hold then. Temporary files a killed writer left behind (older
        than any write takes) go too: they are never entries, and not counted."""
        stale = time.time() - STALE_TMP_S
        for tmp in self.root.glob("??/.tmp-*"):
            with contextlib.suppress(OSError):  # another writer's, renamed or removed meanwhile
                if tmp.stat().st_mtime < stale:
                    tmp.unlink()
        entries = []
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):  # removed by a clear meanwhile
                stat = path.stat()
                if path != keep:
                    entries.append((stat.st_mtime_ns, str(path), stat.st_size))
        held = sum(size for _, _, size in entries)
        for _, name, size in sorted(entries):
            if held <= budget:
                break
            Path(name).unlink(missing_ok=True)
            self.evictions += 1
            held -= size
        return held

    def _write_usage(self, held: int) -> None:
        spare = self.root / f"{USAGE}.{os.getpid()}"
        spare.write_text(str(held))
        spare.replace(self.root / USAGE)

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def held_bytes(self) -> int | None:
        """The bytes the capacity counts as held (an estimate from above; None: no capacity)."""
        if self.capacity_bytes is None:
            return None
        try:
            return int((self.root / USAGE).read_text() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            return None

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as err:
            raise StoreError(f"{self.root}: delete failed ({err.strerror})") from err

    def _files(self):
        return self.root.glob(f"??/*{SUFFIX}")

    def stats(self) -> dict:
        sizes = [path.stat().st_size for path in self._files()]
        stats = {"entries": len(sizes), "bytes": sum(sizes), "path": str(self.root)}
        if self.capacity_bytes is not None:
            stats |= {"capacity_bytes": self.capacity_bytes, "evictions": self.evictions}
        return stats

    def clear(self) -> int:
        removed = 0
        for path in self._files():
            path.unlink(missing_ok=True)
            removed += 1
        (self.root / USAGE).unlink(missing_ok=True)
        return removed

    def close(self) -> None:
        pass
