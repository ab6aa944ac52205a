"""file:///path — one file per entry under a directory; survives restarts, shareable on one host.

Writes go to a temporary file in the same directory and are renamed into place, so a reader
(or a crash) never sees half an entry.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hybridkv.errors import StoreError

SUFFIX = ".hkv"


class FileStore:
    def __init__(self, root: str | Path, url: str | None = None) -> None:
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"{self.root}: cannot create store directory ({err.strerror})") from err

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"file store keys are lowercase hex digests, got {key!r}")
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise StoreError(f"{self.root}: read failed ({err.strerror})") from err

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as err:
            raise StoreError(f"{self.root}: write failed ({err.strerror})") from err

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as err:
            raise StoreError(f"{self.root}: delete failed ({err.strerror})") from err

    def _files(self):
        return self.root.glob(f"??/*{SUFFIX}")

    def stats(self) -> dict:
        sizes = [path.stat().st_size for path in self._files()]
        return {"entries": len(sizes), "bytes": sum(sizes), "path": str(self.root)}

    def clear(self) -> int:
        removed = 0
        for path in self._files():
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def close(self) -> None:
        pass
