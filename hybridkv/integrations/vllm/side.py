"""What the connector's scheduler side and worker side share: the settings, the engine's cache
layout and block store, and the figures each side reports through vLLM's connector-stats path."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from hybridkv.integrations.vllm.block_store import BlockStore, Layout
from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.group_kinds import AttentionBlocks, RingBlocks, StateSlots
from hybridkv.integrations.vllm.layout import CacheGroups
from hybridkv.integrations.vllm.metrics import STORE_ERROR_KINDS, HybridKVStats

log = logging.getLogger("hybridkv.vllm")


class ConnectorSide:
    def __init__(self, config: ConnectorConfig, groups: CacheGroups, blocks: BlockStore) -> None:
        self.config = config
        self.groups = groups
        self.attention_groups, self.mamba_groups = groups.attention, groups.mamba
        self.ring_groups = groups.rings
        # one manager per kind of group (`group_kinds`), and each group's
        self.kinds = (AttentionBlocks(groups.attention), StateSlots(groups.mamba), RingBlocks(groups.rings))
        self.kind_of = {group: kind for kind in self.kinds for group in kind.groups}
        # s on the pool grid: the loaded blocks then hold whole pools only, and no pool is in progress
        self.pool_alignment = groups.pool_alignment
        self.blocks = blocks
        self._stats = HybridKVStats()
        self._stats_lock = threading.Lock()  # the lookup and writer threads count too
        self._store_errors_seen = 0

    def _layouts(self) -> tuple[Layout, Layout]:
        """Bytes of each attention layer's block and each linear layer's state, without padding
        (None: a layer whose page size only the worker's config holds; the worker checks it)."""
        sizes = self.groups.page_bytes
        attention = {name: sizes[name] for names in self.attention_groups.values() for name in names}
        states = {name: sizes[name] for names in self.mamba_groups.values() for name in names}
        return attention, states

    @contextmanager
    def stats(self) -> Iterator[HybridKVStats]:
        """The figures of the current stats period, held for updating (other threads count too)."""
        with self._stats_lock:
            yield self._stats

    def _count(self, name: str, value: float = 1) -> None:
        with self._stats_lock:
            self._stats.count(name, value)

    def get_kv_connector_stats(self) -> HybridKVStats | None:
        counts = self.blocks.store.stats()
        errors = sum(counts.get(kind, 0) for kind in STORE_ERROR_KINDS)
        with self._stats_lock:
            self._stats.count("store_errors", errors - self._store_errors_seen)
            self._store_errors_seen = errors
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, HybridKVStats()
        return stats

    def shutdown(self) -> None:
        if os.environ.get("HYBRIDKV_VLLM_STATS"):
            log.info("hybridkv store %s: %s", self.config.store, self.blocks.store.stats())


def timed(counter: str):
    """Add a hook's wall time to its side's `counter` (seconds, see metrics.COUNTERS)."""

    def wrap(hook):
        @functools.wraps(hook)
        def timed_hook(self: ConnectorSide, *args, **kwargs):
            began = time.perf_counter()
            try:
                return hook(self, *args, **kwargs)
            finally:
                self._count(counter, time.perf_counter() - began)

        return timed_hook

    return wrap
