"""The connector's worker side (`connector.py` tells the whole flow): copies each load's verified
pages into the request's blocks and state slots, before the step's forward for a synchronous load
and after it for an asynchronous one, and copies each finished prompt's pages out for a `StoreWriter` to
write to the store off the request's path."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import BlockStore
from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.group_kinds import Snapshot
from hybridkv.integrations.vllm.layout import CacheGroups
from hybridkv.integrations.vllm.metadata import HybridKVMetadata, HybridKVWorkerMetadata, SaveOp
from hybridkv.integrations.vllm.side import ConnectorSide, timed
from hybridkv.integrations.vllm.writes import StoreWriter

log = logging.getLogger("hybridkv.vllm")


class WorkerSide(ConnectorSide):
    def __init__(self, config: ConnectorConfig, groups: CacheGroups, blocks: BlockStore) -> None:
        super().__init__(config, groups, blocks)
        self._kv: dict[str, torch.Tensor] = {}
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._writer: StoreWriter | None = None
        self._saves_done: set[str] = set()  # filled by the writer thread, sent to the scheduler each step
        self._saves_done_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = kv_caches

    def page(self, layer: str, block: int) -> torch.Tensor:
        """One layer's page of a block (or state slot), as its raw bytes."""
        page = self._kv[layer][block]
        if not page.is_contiguous():
            raise HybridKVError(f"{layer}: a KV-cache block is not contiguous; this vLLM layout is not supported")
        return page.view(torch.uint8).reshape(-1)

    def restore_page(self, layer: str, block: int, stored: torch.Tensor) -> None:
        page = self.page(layer, block)
        if stored.numel() * stored.element_size() != page.numel():  # copy_ would broadcast a 1-byte page
            raise HybridKVError(f"{layer}: a stored page of {stored.numel()} bytes for a {page.numel()}-byte page")
        page.copy_(stored.view(torch.uint8).reshape(-1))

    def clear_block(self, layer: str, block: int) -> None:
        self._kv[layer][block].zero_()

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
                for group, ids in load.targets.items():
                    self.kind_of[group].restore(self, group, ids, load)
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
            self._writer = StoreWriter(self.config.store)
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
        copied = Snapshot()
        for group, ids in save.sources.items():
            self.kind_of[group].copy_out(self, group, ids, save, copied)
        pages, states = copied.blocks, copied.states

        def write() -> None:
            began = time.perf_counter()
            try:
                # blocks first: the state depends on its block (a capacity refuses it without). A block
                # that marks a checkpoint the store then refused is a miss there, never a wrong state.
                state_at = len(save.tokens) if states else None
                self.blocks.save_blocks(save.tokens, save.first_block, pages, state_at, save.salt, save.exact)
                if states:
                    self.blocks.save_state(save.tokens, len(save.tokens), states, save.salt, save.exact)
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
