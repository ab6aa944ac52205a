"""What the connector's two sides tell each other once per step: the scheduler the loads and saves
to make (`HybridKVMetadata`), the worker the saves it has finished (`HybridKVWorkerMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from hybridkv.integrations.vllm.block_store import Pages


@dataclass
class LoadOp:
    req_id: str
    blocks: list[Pages]  # verified pages of the blocks covering [0, start), in order
    states: Pages | None  # the exact linear states at start, or None: zero them
    # group -> the blocks the load writes (`group_kinds`): an attention group's covering [0, start),
    # a state group's slot, a ring group's ring
    targets: dict[int, list[int]]
    failed: bool = False  # nothing to load: the worker reports the load failed, and vLLM recomputes
    start: int = 0  # tokens loaded: vLLM prefills [start, end)
    sync: bool = False  # copied before the step's forward, which already computes from start


@dataclass
class SaveOp:
    req_id: str
    tokens: list[int]
    first_block: int  # blocks before it were loaded from the store: not written again
    # group -> the blocks the save reads (`group_kinds`): an attention group's holding the prompt, a
    # state group's slot (none when states are not saved)
    sources: dict[int, list[int]]
    salt: str | None = None  # the request's cache_salt
    exact: bool = True  # False: the prompt was resumed from a zero state, its pages are approximate


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


@dataclass
class HybridKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker to scheduler, once per step: the requests whose saves are done (written, failed or
    dropped), so the scheduler stops holding back lookups that wait for their pages."""

    saved: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HybridKVWorkerMetadata:
        return HybridKVWorkerMetadata(self.saved | getattr(other, "saved", set()))
