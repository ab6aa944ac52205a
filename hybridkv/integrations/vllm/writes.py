"""Saved prompts written to the store off the request's path (`StoreWriter`), and the drain that lets
a lookup in the same process see the writes queued before it."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import ClassVar

log = logging.getLogger("hybridkv.vllm")


class StoreWriter:
    """Writes saved prompts to one store on one background thread, in the order they were queued.

    Every writer of the process is registered under its store's URL, so a lookup in the same process
    reading that store (the scheduler of an engine whose worker runs in its process) first waits for
    the writes queued before it began (`drain_store`), not for later ones, nor for other stores'.
    Across processes (`vllm serve` runs its worker in one of its own) a prompt's pages land
    milliseconds after its answer, and a request looked up in that window misses them.
    The backlog is bounded: with a slow or stalled store a save beyond it is dropped (a later miss),
    never held in memory without limit."""

    MAX_BACKLOG = 64  # queued saves, each holding its pages' copies
    DRAIN_TIMEOUT_S = 5.0  # a lookup waits no longer for earlier saves (a stalled store)

    registry: ClassVar[dict[str, list[StoreWriter]]] = {}  # store URL -> its writers in this process
    _lock = threading.Lock()

    def __init__(self, store: str) -> None:
        self.store = store
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._submitted = self._completed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hybridkv-writer", daemon=True)
        self._thread.start()
        with self._lock:
            StoreWriter.registry.setdefault(store, []).append(self)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a cache that cannot be written costs reuse later, never a request
                log.exception("hybridkv: a background save failed")
            finally:
                with self._cond:
                    self._completed += 1
                    self._cond.notify_all()

    def full(self) -> bool:
        with self._cond:
            return len(self._jobs) >= self.MAX_BACKLOG

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            self._submitted += 1
            self._cond.notify_all()

    def mark(self) -> int:
        """How many writes were submitted so far: what a drain begun now waits for."""
        with self._cond:
            return self._submitted

    def wait(self, mark: int, timeout: float | None = DRAIN_TIMEOUT_S) -> bool:
        """Wait until the first `mark` writes are done; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._completed >= mark, timeout)

    def drain(self, timeout: float | None = DRAIN_TIMEOUT_S) -> bool:
        """Wait until the writes submitted before this call are done; False if `timeout` passed."""
        return self.wait(self.mark(), timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()  # every queued save reaches the store first
        with self._lock:
            writers = StoreWriter.registry.get(self.store, [])
            if self in writers:
                writers.remove(self)

    @classmethod
    def drain_store(cls, store: str) -> None:
        """Wait for the writes to `store` this process's writers queued so far (each writer a bounded
        time): a lookup in the same process then finds them."""
        with cls._lock:
            writers = list(cls.registry.get(store, []))
        for writer in writers:
            writer.drain()

    @classmethod
    def drain_all(cls) -> None:
        """Wait for every store's queued writes (tests and shutdown)."""
        for store in list(cls.registry):
            cls.drain_store(store)
