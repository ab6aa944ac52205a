"""`HybridKVConnector`: token-level prefix reuse for hybrid models inside vLLM (v1 KV connector).

    vllm serve MODEL --no-enable-prefix-caching --kv-transfer-config '{"kv_connector": "HybridKVConnector",
        "kv_connector_module_path": "hybridkv.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "replay_budget": 0.05}}'

Scheduler side: for a new request, a background thread finds the longest stored prefix L
(token-level), picks the replay start s (an exact stored checkpoint within the budget, else
L − t), and reads and verifies the pages of [0, s). The scheduler waits for it a few milliseconds
(`LOOKUP_WAIT_S`); a slower store answers "not yet" and the scheduler serves other requests
meanwhile. A step on a loaded engine lasts far longer than a lookup, and every step a hit waits
for is time vLLM's own prefix cache does not spend, so the load is synchronous wherever the
scheduler could verify every page: vLLM schedules the request at once from s, and the worker
copies the pages before that step's forward pass. Worker side: the verified pages travel in the
step's metadata; the worker copies them into the request's attention blocks and writes every
linear layer's state slot — the exact checkpoint, or zeros — so vLLM's own prefill of [s, end) is
the tail replay. GLM-5.3-Flash's sparse-MLA pages have sizes only the worker knows: there the
load is asynchronous (copied after the step's forward, reported by `get_finished`), so a page the
worker rejects recomputes the request; s lies on the indexer's 16-token pool grid and the tail
ring is cleared (see `CacheGroups`). When a prompt's prefill completes, its new attention
blocks and its final linear states (an exact checkpoint at the prompt's end) are copied out in
that step and written to the store by a background thread, off the request's path.

Extra config: `store` (a hybridkv store URL, default a file store under the temp dir — shared by
the engine's processes), `replay_budget` (fraction of the match, or "256tok"; default 0.05),
`replay_horizon` (a token count, or "calibrated": the forgetting horizon `hybridkv calibrate`
wrote beside the model; it caps the budget's tail), `cache_salt` (the engine's namespace),
`save_states` (default true), `max_held_mib` (verified pages held in memory for requests not yet
admitted; past it, new lookups wait; default 1024). vLLM's per-request
`cache_salt` opens a namespace inside it: two tenants never share a page. A request may set its
own budget: `SamplingParams(extra_args={"kv_transfer_params": {"replay_budget": 0.1}})`. Each
finished request reports `{"hybridkv": {"matched", "reused", "exact_state"}}` in
`RequestOutput.kv_transfer_params`.

Needs `enable_prefix_caching=False`: with vLLM's own hybrid prefix cache on, the state slot the
connector writes would be hashed as vLLM's exact state at s. Set `"kv_load_failure_policy":
"recompute"` in the kv-transfer config: a load that fails in the worker (its pages were verified
before, so only a layout mismatch can) then recomputes the request instead of failing it.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)

from hybridkv.cache.prefix_index import common_length
from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import BlockStore, Pages, Resume, engine_fingerprint
from hybridkv.integrations.vllm.metrics import STORE_ERROR_KINDS, HybridKVPromMetrics, HybridKVStats
from hybridkv.methods import Budget
from hybridkv.models.calibration import calibrated_horizon
from hybridkv.store import open_store
from hybridkv.store.guarded import GuardedStore

log = logging.getLogger("hybridkv.vllm")

# KV-cache specs whose blocks hold plain per-token attention KV, restorable as whole blocks.
_WHOLE_BLOCK_SPECS = (FullAttentionSpec, MLAAttentionSpec)


@dataclass
class CacheGroups:
    """How the connector restores each of vLLM's KV-cache groups (`classify_groups`).

    vLLM 0.32 lays a model's caches out in KV-cache groups that share one raw buffer. For
    GLM-5.3-Flash (`glm5next`) the per-layer specs are
    - each KDA layer: a `MambaSpec` (the short-conv state in the model dtype and the fp32
      recurrent state, one block per request);
    - each MLA layer: an `MLAAttentionSpec` for the latent (`tokens_per_state` 1, marked
      `is_index_group_leader`), one for the DSA indexer's fp8 k-pool entries
      (`Glm5NextIndexerCache`: `cache_role` INDEXER, `tokens_per_state` = `index_kpool` = 16, so
      a block of B tokens holds B/16 pool entries, one per complete pool), and a
      `CircularBufferSpec` (`Glm5NextTailCache`: the raw K and gate score of the pool still in
      progress, a ring of 16·2^k slots, one block per request).
    Their page sizes differ, so vLLM packs them (`_get_packed_kv_cache_groups`, a block-outermost
    layout such as BLHNC): the latent and indexer specs share the `FullAttentionSpec` grouping
    base and become one `UniformTypeKVCacheSpecs` group (one block table), the KDA layers are
    split into several `MambaSpec` groups (as many states as fit in one block), and the rings form
    one `CircularBufferSpec` group. Every group aliases the same raw buffer, block b of each group
    being bytes [b·S, (b+1)·S) for one block stride S; a block id belongs to one group at a time.
    Inside the MLA group's block (its "slab", `get_kv_cache_config_from_groups`) the layers sit at
    fixed offsets: one `KVCacheTensor` per distinct spec, in the order vLLM meets the specs (the
    latent's first): the latent layers at offset 0, `page(latent)` apart, then the indexer layers
    at `n_mla · page(latent)`, `page(indexer)` apart. Packed groups are not split into kernel
    blocks (`prepare_kernel_block_sizes`), so a view's first dimension is vLLM's block.
    Each layer's tensor view (`create_kv_cache_views`) is `as_strided` over the raw buffer with
    shape [blocks, heads, states, content] (states = B / tokens_per_state), block stride S,
    storage offset = the tensor's offset + layer index · layer stride, viewed in the spec's dtype
    (raw int8 bytes for a `MambaSpec`). So `view[b]` is one layer's page of block b, contiguous,
    and copying it byte for byte through each layer's view restores the slab exactly.

    The restore: the MLA group's blocks covering [0, s) are stored and loaded whole, latent and
    indexer pages alike; the KDA groups are state groups (the checkpoint at s, or zeros); the ring
    is cleared. That is exact only if no pool is in progress at s, so s lies on the pool grid
    (`pool_alignment`: a multiple of every pooled spec's `tokens_per_state` and of every ring's
    capacity, itself a multiple of the pool) and vLLM's own prefill of [s, end) refills the ring.

    The scheduler's copy of the config carries one representative spec per group
    (`generate_scheduler_kv_cache_config`), the group's first layer's (the latent's); the worker's
    carries every layer's. The fingerprint is built from the representatives on both sides, so
    their keys agree. The scheduler takes the pool grid from the ring's capacity (it cannot see
    the indexer's pool); the worker, which sees both, fails a load off its own grid (vLLM then
    recomputes the request). A layer whose page size only the worker knows has size None here:
    the lookup checks its name, the worker its size.
    """

    attention: dict[int, list[str]]  # group -> layers whose blocks are stored and loaded whole
    mamba: dict[int, list[str]]  # group -> layers with one state slot per request
    rings: dict[int, list[str]]  # group -> layers with one ring block per request, cleared on load
    page_bytes: dict[str, int | None]  # layer -> bytes of its page (None: this side cannot know)
    pool_alignment: int  # s is a multiple of it: 1 without pooled caches
    layout: list[tuple[str, int, int, list[str]]]  # per group, for the engine fingerprint


def _pool(spec: KVCacheSpec) -> int | None:
    """Tokens per stored state of an attention layer restorable as whole blocks: 1 for per-token
    KV, the pool size for a pooled MLA cache (GLM-5.3-Flash's indexer), None if not restorable."""
    if type(spec) not in _WHOLE_BLOCK_SPECS:
        return None
    per_state = getattr(spec, "tokens_per_state", 1)
    if per_state in (1, -1):
        return 1
    pooled = isinstance(spec, MLAAttentionSpec) and isinstance(per_state, int) and per_state > 1
    return per_state if pooled and spec.block_size % per_state == 0 else None


def _page_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one layer's page as its tensor view holds them: without the padding to the block stride."""
    return getattr(spec, "real_page_size_bytes", spec.page_size_bytes)


def _sparse_mla_representative(spec: KVCacheSpec) -> bool:
    """A spec the scheduler sees for a group that also holds a sparse-MLA indexer's caches, whose
    page sizes differ from the representative's: vLLM marks the latent of an MLA layer with an
    indexer as the index group's leader."""
    return isinstance(spec, MLAAttentionSpec) and (
        spec.is_index_group_leader or spec.cache_role == SparseCacheRole.INDEXER or spec.tokens_per_state != 1
    )


def classify_groups(kv_cache_config: KVCacheConfig) -> CacheGroups:
    """Sort vLLM's KV-cache groups into what the connector restores; refuse any other group."""
    attention: dict[int, list[str]] = {}
    mamba: dict[int, list[str]] = {}
    rings: dict[int, list[str]] = {}
    page_bytes: dict[str, int | None] = {}
    alignment = 1
    layout = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        names = list(group.layer_names)
        spec = group.kv_cache_spec
        # The worker's config has one spec per layer; the scheduler's, the first of them for all.
        per_layer = (
            {name: spec.kv_cache_specs[name] for name in names} if isinstance(spec, UniformTypeKVCacheSpecs) else None
        )
        specs = list(iter_layer_specs(spec))
        if not specs:
            raise HybridKVError(f"HybridKVConnector: KV-cache group {g} has no layer spec")
        representative = specs[0]  # what generate_scheduler_kv_cache_config keeps
        layout.append((type(representative).__name__, representative.block_size, representative.page_size_bytes, names))
        if all(isinstance(spec, MambaSpec) for spec in specs):
            mamba[g] = names
        elif all(isinstance(spec, CircularBufferSpec) for spec in specs):
            rings[g] = names
            alignment = math.lcm(alignment, *(spec.block_size for spec in specs))
        elif all(_pool(spec) is not None for spec in specs):
            attention[g] = names
            alignment = math.lcm(alignment, *(_pool(spec) for spec in specs))
            if per_layer is None and _sparse_mla_representative(representative):
                page_bytes.update(dict.fromkeys(names))
                continue
        else:  # sliding windows, compressed caches of other models: not restorable block by block yet
            kinds = "+".join(dict.fromkeys(type(spec).__name__ for spec in specs))
            raise HybridKVError(
                f"HybridKVConnector cannot restore KV-cache group {g} ({kinds}, layers "
                f"{', '.join(names[:3])}...): it handles full-attention and Mamba-style state groups"
            )
        for name in names:
            page_bytes[name] = _page_bytes(per_layer[name] if per_layer is not None else representative)
    return CacheGroups(attention, mamba, rings, page_bytes, alignment, layout)


@dataclass
class LoadOp:
    req_id: str
    blocks: list[Pages]  # verified pages of the blocks covering [0, start), in order
    states: Pages | None  # the exact linear states at start, or None: zero them
    attention_blocks: dict[int, list[int]]  # attention group -> its block ids covering [0, start)
    state_slots: dict[int, int]  # mamba group -> the request's state slot
    failed: bool = False  # nothing to load: the worker reports the load failed, and vLLM recomputes
    ring_blocks: dict[int, int] = field(default_factory=dict)  # ring group -> the request's ring block
    start: int = 0  # tokens loaded: vLLM prefills [start, end)
    sync: bool = False  # copied before the step's forward, which already computes from start


@dataclass
class SaveOp:
    req_id: str
    tokens: list[int]
    first_block: int  # blocks before it were loaded from the store: not written again
    attention_blocks: dict[int, list[int]]  # attention group -> the prompt's block ids
    state_slots: dict[int, int]
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


@dataclass
class _Hit:  # scheduler-side record of a request's lookup, with its verified pages until loaded
    matched: int
    start: int
    exact_state: bool = False  # resumed from a stored state, and everything loaded was exact
    resume: Resume | None = None


@dataclass
class _Source:  # scheduler-side: a prompt to be computed (or saved) whose pages later lookups may want
    tokens: np.ndarray
    salt: str | None
    stored: int  # tokens of it the store held already when it was looked up
    saved_at: float | None = None  # when its save went to the worker (None: prefill in progress)


@dataclass
class _Tracked:  # scheduler-side view of a running request, until its prefill is saved
    tokens: list[int]
    block_ids: list[list[int]]
    first_block: int
    salt: str | None
    exact: bool = True
    saved: bool = False


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


def _mib(setting, name: str) -> int:
    """A positive size in MiB from the connector's config, in bytes."""
    try:
        mib = float(setting)
    except (TypeError, ValueError):
        mib = math.nan
    if not mib > 0 or math.isinf(mib):
        raise HybridKVError(f"{name} {setting!r}: a positive number of MiB")
    return int(mib * 2**20)


def _replay_horizon(setting, model: str) -> int | None:
    """`replay_horizon`: absent (the budget alone), a token count, or "calibrated" (the horizon
    `hybridkv calibrate` wrote beside the model; None there: some layer remembers past it)."""
    if setting is None:
        return None
    if setting == "calibrated":
        return calibrated_horizon(Path(model))
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return setting
    raise HybridKVError(f'replay_horizon {setting!r}: a token count or "calibrated"')


def _timed(counter: str):
    """Add a hook's wall time to the connector's `counter` (seconds, see metrics.COUNTERS)."""

    def wrap(hook):
        @functools.wraps(hook)
        def timed(self, *args, **kwargs):
            began = time.perf_counter()
            try:
                return hook(self, *args, **kwargs)
            finally:
                self._count(counter, time.perf_counter() - began)

        return timed

    return wrap


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    # How long the scheduler waits for a lookup before answering "not yet" (then the request waits
    # a whole engine step). A lookup reading a few MiB from a local store takes 5-30 ms.
    LOOKUP_WAIT_S = 0.05
    # A new prompt sharing at least this many more tokens with one being computed than the store
    # holds waits for that prompt's pages instead of computing them a second time alongside it
    # (with one whose pages are being written, any number of tokens).
    WAIT_FOR_PREFIX_TOKENS = 512
    SAVE_NOTICE_TIMEOUT_S = 10.0  # a save the worker never reports done stops holding lookups back

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.cache_config.enable_prefix_caching:
            raise HybridKVError(
                "HybridKVConnector needs vLLM's own prefix cache off (--no-enable-prefix-caching): with it on, "
                "vLLM would hash the linear state the connector writes as its own exact state"
            )
        # Keys are token ids under the engine's fingerprint: anything else that changes a page's
        # contents for the same tokens would share keys and read another's pages (per request, a
        # LoRA adapter or multimodal inputs: such requests are neither looked up nor saved).
        if vllm_config.parallel_config.world_size > 1:
            raise HybridKVError(
                "HybridKVConnector runs on one rank only: under tensor or pipeline parallelism every rank "
                "would store its own shard of a page under the same key"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.budget = Budget.parse(str(extra.get("replay_budget", 0.05)))
        self.save_states = bool(extra.get("save_states", True))
        self.horizon = _replay_horizon(extra.get("replay_horizon"), vllm_config.model_config.model)
        url = extra.get("store") or f"file://{Path(tempfile.gettempdir()) / 'hybridkv-vllm-store'}"
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "hybridkv: kv_load_failure_policy is %r; set it to 'recompute' so that a load failing in the "
                "worker recomputes the request instead of failing it", self._kv_transfer_config.kv_load_failure_policy,
            )  # fmt: skip

        groups = kv_cache_config.kv_cache_groups
        self.groups = classify_groups(kv_cache_config)
        self.attention_groups, self.mamba_groups = self.groups.attention, self.groups.mamba
        self.ring_groups = self.groups.rings
        if not self.attention_groups:
            raise HybridKVError("HybridKVConnector: the model has no full-attention KV-cache group to reuse")
        sizes = {groups[g].kv_cache_spec.block_size for g in self.attention_groups}
        if len(sizes) != 1:
            raise HybridKVError(f"HybridKVConnector: attention groups with different block sizes {sorted(sizes)}")
        self.block_size = sizes.pop()
        # s on the pool grid: the loaded blocks then hold whole pools only, and no pool is in progress
        self.pool_alignment = self.groups.pool_alignment
        # Synchronous loads cannot be reported failed (vLLM takes no per-request failure for a
        # running request of a hybrid model), so they are made only where the lookup verified
        # every page's size and nothing is left for the worker to reject.
        self.sync_loads = None not in self.groups.page_bytes.values()
        model = vllm_config.model_config
        fingerprint = engine_fingerprint(model.model, self.groups.layout, str(model.dtype))
        self.blocks = BlockStore(
            GuardedStore(open_store(url)), fingerprint, self.block_size, extra.get("cache_salt", "")
        )
        self.store_url = url
        self._stats = HybridKVStats()
        self._stats_lock = threading.Lock()  # the lookup thread counts too
        self._store_errors_seen = 0
        # scheduler side
        self._lookups: dict[str, Future[_Hit]] = {}
        self._hits: dict[str, _Hit] = {}
        self._loads: dict[str, LoadOp] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._salts: dict[str, str | None] = {}  # a request's cache_salt, until it finishes
        self._uncacheable: set[str] = set()  # requests with a LoRA adapter or multimodal inputs
        self._sources: dict[str, _Source] = {}  # prompts in flight, until their saves are done
        self._waiting_on: dict[str, str] = {}  # request -> the source whose pages it waits for
        self._lookup_pool: ThreadPoolExecutor | None = None
        # verified pages wait in memory for their request's admission: bound how many requests hold
        # them (lookups in flight included) and their bytes (a long prompt's pages weigh more)
        self._max_pending = 2 * vllm_config.scheduler_config.max_num_seqs
        self._max_held_bytes = _mib(extra.get("max_held_mib", 1024), "max_held_mib")
        self._held = 0  # hits holding verified pages
        self._held_bytes = 0
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._writer: _Writer | None = None
        self._saves_done: set[str] = set()  # filled by the writer thread, sent to the scheduler each step
        self._saves_done_lock = threading.Lock()

    # == scheduler side ==========================================================================

    @property
    def requires_kv_delivery(self) -> bool:  # a best-effort cache: a dropped save is a later miss
        return False

    @property
    def held_bytes(self) -> int:
        """Bytes of verified pages held in memory for requests vLLM has not admitted yet."""
        return self._held_bytes

    @property
    def lookups_in_flight(self) -> int:
        """Lookups submitted to the lookup thread and not yet taken by their request."""
        return len(self._lookups)

    def _layouts(self) -> tuple[dict[str, int | None], dict[str, int | None]]:
        """Bytes of each attention layer's block and each linear layer's state, without padding
        (None: a layer whose page size only the worker's config holds; the worker checks it)."""
        sizes = self.groups.page_bytes
        attention = {name: sizes[name] for names in self.attention_groups.values() for name in names}
        states = {name: sizes[name] for names in self.mamba_groups.values() for name in names}
        return attention, states

    def _count(self, name: str, value: float = 1) -> None:
        with self._stats_lock:
            self._stats.count(name, value)

    @_timed("hook_seconds")
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if num_computed_tokens:  # only with vLLM's prefix cache, which __init__ refuses
            return 0, False
        req_id = request.request_id
        if (
            getattr(request, "lora_request", None) is not None
            or getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            self._uncacheable.add(req_id)  # its pages depend on more than its token ids
            return 0, False
        if (hit := self._hits.get(req_id)) is None:
            lookup = self._lookups.get(req_id)
            if lookup is None and self._waits_for_source(request):
                return None, False
            if lookup is None:  # read and verify off the engine loop; other requests go on meanwhile
                if len(self._lookups) + self._held >= self._max_pending or (
                    self._held and self._held_bytes >= self._max_held_bytes
                ):
                    return None, False  # enough pages held for requests not yet admitted: ask later
                self._salts[req_id] = getattr(request, "cache_salt", None)
                if self._lookup_pool is None:
                    self._lookup_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hybridkv-lookup")
                lookup = self._lookups[req_id] = self._lookup_pool.submit(self._look_up, request)
                began = time.perf_counter()
                futures.wait([lookup], timeout=self.LOOKUP_WAIT_S)  # a quick store answers in this step
                waited = time.perf_counter() - began
                self._count("wait_seconds", waited)
                self._count("hook_seconds", -waited)  # counted apart from the hook's own work
            if not lookup.done():
                return None, False
            hit = self._hits[req_id] = self._lookups.pop(req_id).result()
            # From here on it computes the rest of its prompt: a request asked about later, even
            # in this same step (before vLLM builds the step's metadata), waits for its pages.
            tokens = np.asarray(request.prompt_token_ids, dtype=np.int64)
            self._sources[req_id] = _Source(tokens, self._salts.get(req_id), hit.matched)
            if hit.resume is not None:
                self._held += 1
                self._held_bytes += hit.resume.nbytes
            self._count("lookups")
            if hit.matched and not hit.start:  # nothing to load: the whole match is replayed
                self._record_hit(hit)
        elif hit.start and hit.resume is None:
            # Asked again after its load went out: vLLM preempted the request or its load failed,
            # and its computed tokens are gone. The pages left with the load: compute it in full.
            hit.start, hit.exact_state = 0, False
        return hit.start, hit.start > 0 and not self.sync_loads

    def _waits_for_source(self, request) -> bool:
        """Whether the request should wait for another one's pages: that one is to compute (its
        lookup has answered) or is computing at least `WAIT_FOR_PREFIX_TOKENS` more of this prompt
        than the store holds, or its pages are being written and hold any more of it. Two clients
        sending one long new prefix at once would otherwise both compute it (vLLM's own prefix
        cache shares blocks while they are computed, the store only once they are saved), and a
        conversation's next turn sent at once would miss the last turn's pages by milliseconds."""
        req_id = request.request_id
        now = time.monotonic()
        for source_id, source in list(self._sources.items()):
            if source.saved_at is not None and now - source.saved_at > self.SAVE_NOTICE_TIMEOUT_S:
                del self._sources[source_id]
        if self._waiting_on.get(req_id) in self._sources:
            return True
        self._waiting_on.pop(req_id, None)
        if not self._sources:
            return False
        salt = getattr(request, "cache_salt", None)
        prompt = np.asarray(request.prompt_token_ids[:-1], dtype=np.int64)  # one token is always computed
        for source_id, source in self._sources.items():
            if source_id == req_id:
                continue
            gain = common_length(source.tokens, prompt) - source.stored
            # a save in flight is milliseconds away: worth waiting for whatever it adds
            wanted = 1 if source.saved_at is not None else self.WAIT_FOR_PREFIX_TOKENS
            if source.salt == salt and gain >= wanted:
                self._waiting_on[req_id] = source_id
                self._count("lookups_deferred")
                return True
        return False

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HybridKVWorkerMetadata):
            for req_id in meta.saved:
                self._sources.pop(req_id, None)

    def _take_pages(self, hit: _Hit) -> Resume | None:
        """The hit's verified pages, which leave it (loaded, declined or dropped)."""
        resume, hit.resume = hit.resume, None
        if resume is not None:
            self._held -= 1
            self._held_bytes -= resume.nbytes
        return resume

    def _record_hit(self, hit: _Hit) -> None:
        with self._stats_lock:
            self._stats.record_hit(hit.matched, hit.start, hit.exact_state)

    @_timed("lookup_seconds")
    def _look_up(self, request) -> _Hit:
        """Find, read and verify a request's pages; claim nothing that is not verified in memory."""
        attention, states = self._layouts()
        try:
            _Writer.drain_all()  # this process's own saves first (see _Writer)
            resume = self.blocks.resume(
                list(request.prompt_token_ids), attention, states, self._request_budget(request),
                getattr(request, "cache_salt", None), self.horizon, self.pool_alignment,
            )  # fmt: skip
            exact_state = resume.states is not None and resume.exact
            return _Hit(resume.matched, resume.start, exact_state, resume if resume.start else None)
        except Exception:  # never take the engine down over a cache: recompute instead
            log.exception("hybridkv: lookup failed for request %s; computing it in full", request.request_id)
            return _Hit(0, 0)

    def _request_budget(self, request) -> Budget:
        params = getattr(request, "kv_transfer_params", None) or {}
        if "replay_budget" not in params:
            return self.budget
        try:
            return Budget.parse(str(params["replay_budget"]))
        except HybridKVError as err:
            log.warning("hybridkv: request %s: %s; using the engine's budget %s", request.request_id, err, self.budget)
            return self.budget

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        # The load writes every linear state slot (the checkpoint, or zeros) and clears every ring:
        # vLLM must not zero them after it, as it would a state group it thinks nothing restored.
        return tuple(sorted([*self.attention_groups, *self.mamba_groups, *self.ring_groups]))

    @_timed("hook_seconds")
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        hit = self._hits.get(request.request_id)
        if not num_external_tokens:  # no load, or the second call once a load is done
            if hit is not None and self._take_pages(hit) is not None:  # vLLM declined the load
                hit.start, hit.exact_state = 0, False
                self._record_hit(hit)
            return
        if hit is None or hit.start != num_external_tokens or hit.resume is None:
            # vLLM now waits for a load this connector cannot make: report it failed rather than
            # leave the request waiting for ever; vLLM then computes it in full.
            log.warning("hybridkv: request %s expects a load of %d tokens that is not staged; recomputing it",
                        request.request_id, num_external_tokens)  # fmt: skip
            self._loads[request.request_id] = LoadOp(
                request.request_id, [], None, {}, {}, failed=True, sync=self.sync_loads
            )
            if hit is not None:
                never_counted = self._take_pages(hit) is not None  # no load was made for it
                hit.start, hit.exact_state = 0, False
                if never_counted:
                    self._record_hit(hit)
            return
        ids = blocks.get_block_ids()
        resume = self._take_pages(hit)  # the pages leave with the load
        self._record_hit(hit)  # reuse counts once the load is made, not when it was found
        self._loads[request.request_id] = LoadOp(
            request.request_id,
            resume.blocks,
            resume.states,
            {g: list(ids[g][: len(resume.blocks)]) for g in self.attention_groups},
            {g: ids[g][0] for g in self.mamba_groups},
            ring_blocks={g: ids[g][0] for g in self.ring_groups if ids[g]},
            start=resume.start,
            sync=self.sync_loads,
        )

    @_timed("hook_seconds")
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = HybridKVMetadata()
        meta.loads, self._loads = list(self._loads.values()), {}
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._uncacheable:
                continue
            if (earlier := self._tracked.get(new.req_id)) is not None and earlier.saved:
                continue  # a resumed request sent again as new (vLLM's V2 runner): its prompt is stored
            hit = self._hits.get(new.req_id)
            matched = hit.matched if hit is not None else 0
            exact = hit is None or not hit.start or hit.exact_state  # a zero-state replay is approximate
            self._tracked[new.req_id] = _Tracked(
                list(new.prompt_token_ids or []), [list(b) for b in new.block_ids], matched // self.block_size,
                self._salts.get(new.req_id), exact,
            )  # fmt: skip
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.saved:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = [list(b) for b in new_ids]
                    hit = self._hits.get(req_id)  # recomputed in full after a preemption: exact
                    tracked.exact = hit is None or not hit.start or hit.exact_state
                else:
                    for group, ids in enumerate(new_ids):
                        tracked.block_ids[group].extend(ids)
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _maybe_save(self, meta: HybridKVMetadata, req_id: str, computed: int, scheduler_output) -> None:
        tracked = self._tracked[req_id]
        end = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        if tracked.saved or not tracked.tokens or end < len(tracked.tokens):
            return
        tracked.saved = True  # the prompt is complete after this step: save it once
        if (source := self._sources.get(req_id)) is not None:
            source.saved_at = time.monotonic()
        blocks = -(-len(tracked.tokens) // self.block_size)
        meta.saves.append(
            SaveOp(
                req_id,
                tracked.tokens,
                tracked.first_block,
                {g: tracked.block_ids[g][:blocks] for g in self.attention_groups},
                {g: tracked.block_ids[g][0] for g in self.mamba_groups} if self.save_states else {},
                tracked.salt,
                tracked.exact,
            )
        )

    def _forget(self, req_id: str) -> dict | None:
        self._uncacheable.discard(req_id)
        self._waiting_on.pop(req_id, None)
        self._tracked.pop(req_id, None)
        if (source := self._sources.get(req_id)) is not None and source.saved_at is None:
            del self._sources[req_id]  # finished before its prompt was complete: no save comes
        self._salts.pop(req_id, None)
        if (lookup := self._lookups.pop(req_id, None)) is not None:
            lookup.cancel()  # aborted while its lookup ran
        hit = self._hits.pop(req_id, None)
        if hit is None:
            return None
        self._take_pages(hit)
        return {"matched": hit.matched, "reused": hit.start, "exact_state": hit.exact_state}

    @_timed("hook_seconds")
    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        info = self._forget(request.request_id)
        return False, ({"hybridkv": info} if info is not None else None)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # == worker side =============================================================================

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

    @_timed("copy_seconds")
    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Copy each load's verified pages into the request's blocks and state slots. vLLM calls
        this before the step's forward pass when a load is synchronous (the forward computes from
        its start), after it when every load is asynchronous (the requests wait for `get_finished`)."""
        meta = self._get_connector_metadata()
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

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # saved whole in wait_for_save, once the prompt's last layer is written

    @_timed("copy_seconds")
    def wait_for_save(self) -> None:
        """Copy out each finished prompt's pages now (the next step may overwrite its state slot);
        hashing, encoding and the store writes happen on the writer thread."""
        meta = self._get_connector_metadata()
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

    # == both sides: figures for vLLM's log line and Prometheus endpoint ============================

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

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> HybridKVStats:
        return HybridKVStats(data=data) if data else HybridKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> HybridKVPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()  # every queued save reaches the store first
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        if os.environ.get("HYBRIDKV_VLLM_STATS"):
            log.info("hybridkv store %s: %s", self.store_url, self.blocks.store.stats())
