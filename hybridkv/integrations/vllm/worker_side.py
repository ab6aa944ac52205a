"""The connector's worker side (`connector.py` tells the whole flow): copies each load's verified
pages into the request's blocks and state slots, before the step's forward for a synchronous load
and after it for an asynchronous one, and copies each finished prompt's pages out for `_Writer` to
write to the store off the request's path."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import BlockStore
from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.layout import CacheGroups
from hybridkv.integrations.vllm.metadata import HybridKVMetadata, HybridKVWorkerMetadata, SaveOp
from hybridkv.integrations.vllm.side import ConnectorSide, timed

log = logging.getLogger("hybridkv.vllm")


class _Writer:
    """Writes saved prompts to the store on one background thread, in the order they were queued.

    Every writer of the process is registered, so a lookup in the same process (the scheduler of an
    engine whose worker runs in its process) first waits for the writes queued before it began,
    not for later ones. Across processes (`vllm serve` runs its worker in one of its own) a prompt's
    pages land milliseconds after its answer, and a request looked up in that window misses them.
    The backlog is bounded: with a slow or stalled store a save beyond it is dropped (a later miss),
    never held in memory without limit."""

    MAX_BACKLOG = 64  # queued saves, each holding its pages' copies
    DRAIN_TIMEOUT_S = 5.0  # a lookup waits no longer for earlier saves (a stalled store)

    registry: list[_Writer] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._submitted = self._completed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hybridkv-writer", daemon=True)
        self._thread.start()
        with self._lock:
            _Writer.registry.append(self)

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
            if self in _Writer.registry:
                _Writer.registry.remove(self)

    @classmethod
    def drain_all(cls) -> None:
        for writer in list(cls.registry):
            writer.drain()


def drain_local_saves() -> None:
    """Wait for the saves this process's workers queued so far (each writer a bounded time): a
    lookup in the same process then finds them (see `_Writer`)."""
    _Writer.drain_all()


class WorkerSide(ConnectorSide):
    def __init__(self, config: ConnectorConfig, groups: CacheGroups, blocks: BlockStore) -> None:
        super().__init__(config, groups, blocks)
        self._kv: dict[str, torch.Tensor] = {}
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._writer: _Writer | None = None
        self._saves_done: set[str] = set()  # filled by the writer thread, sent to the scheduler each step
        self._saves_done_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = kv_caches

    def _page(self, layer: str, block: int) -> torch.Tensor:
        page = self._kv[layer][block]
        if not page.is_contiguous():
            raise HybridKVError(f"{layer}: a KV-cache block is not contiguous; this vLLM layout is not supported")
        return page.view(torch.uint8).reshape(-1)

    def _restore(self, layer: str, block: int, stored: torch.Tensor) -> None:
        page = self._page(layer, block)
        if stored.numel() * stored.element_size() != page.numel():  # copy_ would broadcast a 1-byte page
            raise HybridKVError(f"{layer}: a stored page of {stored.numel()} bytes for a {page.numel()}-byte page")
        page.copy_(stored.view(torch.uint8).reshape(-1))

    @timed("copy_seconds")
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Copy each load's verified pages into the request's blocks and state slots. vLLM calls
        this before the step's forward pass when a load is synchronous (the forward computes from
        its start), after it when every load is asynchronous (the requests wait for `get_finished`)."""
        if not isinstance(meta, HybridKVMetadata):
            return
        for load in meta.loads:
            try:
                if load.failed:
                    raise HybridKVError("nothing was staged for this load")
                if load.start % self.pool_alignment:  # a pool in progress at start: its ring is not stored
                    raise HybridKVError(f"start {load.start} is off the {self.pool_alignment}-token pool grid")
                for group, ids in load.attention_blocks.items():
                    for block, pages in zip(ids, load.blocks, strict=True):
                        for layer in self.attention_groups[group]:
                            self._restore(layer, block, pages[layer])
                for group, slot in load.state_slots.items():
                    for layer in self.mamba_groups[group]:
                        if load.states is not None:
                            self._restore(layer, slot, load.states[layer])
                        else:
                            self._page(layer, slot).zero_()
                for group, block in load.ring_blocks.items():  # no pool in progress at start
                    for layer in self.ring_groups[group]:
                        self._kv[layer][block].zero_()
            except Exception as err:  # vLLM recomputes the request (kv_load_failure_policy "recompute")
                if load.sync:  # the forward is about to compute from start over these blocks: stop it
                    raise HybridKVError(
                        f"hybridkv: the synchronous load of request {load.req_id} failed ({err}); vLLM cannot "
                        "recompute a running request of a hybrid model, so the step is not run"
                    ) from err
                log.exception("hybridkv: loading request %s failed; it is recomputed", load.req_id)
                self._failed.add(load.req_id)
            if not load.sync:
                self._loaded.add(load.req_id)

    @timed("copy_seconds")
    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Copy out each finished prompt's pages now (the next step may overwrite its state slot);
        hashing, encoding and the store writes happen on the writer thread."""
        if not isinstance(meta, HybridKVMetadata) or not meta.saves:
            return
        if self._writer is None:
            self._writer = _Writer()
        for save in meta.saves:
            try:
                if self._writer.full():  # checked before the pages are copied out
                    self._count("saves_dropped")
                    self._save_done(save.req_id)
                    continue
                self._writer.submit(self._snapshot(save))
            except Exception:  # a cache that cannot be written costs reuse later, never this request
                log.exception("hybridkv: saving a prompt of %d tokens failed", len(save.tokens))
                self._save_done(save.req_id)

    def _save_done(self, req_id: str) -> None:
        with self._saves_done_lock:
            self._saves_done.add(req_id)

    def build_connector_worker_meta(self) -> HybridKVWorkerMetadata | None:
        with self._saves_done_lock:
            done, self._saves_done = self._saves_done, set()
        return HybridKVWorkerMetadata(done) if done else None

    def _snapshot(self, save: SaveOp) -> Callable[[], None]:
        count = len(next(iter(save.attention_blocks.values())))
        pages = [
            {
                layer: self._page(layer, save.attention_blocks[group][index]).clone()
                for group, layers in self.attention_groups.items()
                for layer in layers
            }
            for index in range(save.first_block, count)
        ]
        states = {
            layer: self._page(layer, slot).clone()
            for group, slot in save.state_slots.items()
            for layer in self.mamba_groups[group]
        }

        def write() -> None:
            began = time.perf_counter()
            try:
                state_at = None
                if states and self.blocks.save_state(save.tokens, len(save.tokens), states, save.salt, save.exact):
                    state_at = len(save.tokens)
                self.blocks.save_blocks(save.tokens, save.first_block, pages, state_at, save.salt, save.exact)
            finally:
                self._count("write_seconds", time.perf_counter() - began)
                self._save_done(save.req_id)

        return write

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        loaded, self._loaded = self._loaded, set()
        return None, (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        failed, self._failed = self._failed, set()
        _, loaded = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=set(loaded or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failures are reported per request (failed_recving): vLLM cannot take block ids from a hybrid

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()  # every queued save reaches the store first
        super().shutdown()
