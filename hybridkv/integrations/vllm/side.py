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

from hybridkv.errors import StoreError
from hybridkv.integrations.vllm.block_store import BlockStore, Layout
from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.group_kinds import AttentionBlocks, RingBlocks, StateSlots
from hybridkv.integrations.vllm.layout import CacheGroups
from hybridkv.integrations.vllm.metrics import STORE_COUNTS, STORE_ERROR_KINDS, HybridKVStats

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
        self._store_counts_seen: dict[str, int] = {}
        self._held_read_at = 0.0

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

    def _store_counts(self) -> dict[str, int]:
        """The connector's counters its store counts, as totals so far."""
        store = self.blocks.store
        counts = store.stats()
        evicted = getattr(store.inner, "evicted", {})
        totals = {"store_errors": sum(counts.get(kind, 0) for kind in STORE_ERROR_KINDS)}
        for name, key in STORE_COUNTS.items():
            source, _, kind = key.partition(":")
            totals[name] = evicted.get(kind, 0) if source == "evicted" else counts.get(key, 0)
        return totals

    def _bytes_held(self) -> int | None:
        """What a capacity-bound store counts as held, read at most once a second (None: not now)."""
        held = getattr(self.blocks.store.inner, "held_bytes", None)
        if held is None or time.monotonic() - self._held_read_at < 1.0:
            return None
        self._held_read_at = time.monotonic()
        try:
            return held()
        except (StoreError, OSError):  # a store that is down: the gauge waits for the next read
            return None

    def get_kv_connector_stats(self) -> HybridKVStats | None:
        totals, held = self._store_counts(), self._bytes_held()
        with self._stats_lock:
            for name, total in totals.items():
                if total != self._store_counts_seen.get(name, 0):
                    self._stats.count(name, total - self._store_counts_seen.get(name, 0))
                    self._store_counts_seen[name] = total
            if held is not None:
                self._stats.data["gauges"]["store_bytes_held"] = held
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
