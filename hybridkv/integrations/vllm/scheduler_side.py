"""The connector's scheduler side (`connector.py` tells the whole flow): a lookup per new request on
a background thread, its verified pages held until vLLM admits the request, the loads and saves
each step's metadata carries to the worker, and requests held back for the pages of a prefix
another request is computing."""

from __future__ import annotations

import logging
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hybridkv.integrations.vllm.block_store import BlockStore
from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.in_flight import PromptsInFlight
from hybridkv.integrations.vllm.layout import CacheGroups
from hybridkv.integrations.vllm.lookup import HeldPages, Lookup, look_up
from hybridkv.integrations.vllm.metadata import HybridKVMetadata, HybridKVWorkerMetadata, LoadOp, SaveOp
from hybridkv.integrations.vllm.scheduler_shadow import ShadowChecks
from hybridkv.integrations.vllm.side import ConnectorSide, timed

log = logging.getLogger("hybridkv.vllm")


@dataclass
class _Tracked:  # scheduler-side view of a running request, until its prefill is saved
    tokens: list[int]
    block_ids: list[list[int]]
    first_block: int
    salt: str | None
    exact: bool = True
    saved: bool = False


class SchedulerSide(ConnectorSide):
    # How long the scheduler waits for a lookup before answering "not yet" (then the request waits
    # a whole engine step). A lookup reading a few MiB from a local store takes 5-30 ms.
    LOOKUP_WAIT_S = 0.05

    def __init__(
        self, config: ConnectorConfig, groups: CacheGroups, blocks: BlockStore, max_num_seqs: int,
        model: str = "", dtype: str = "bfloat16",
    ) -> None:  # fmt: skip
        super().__init__(config, groups, blocks)
        self.block_size = groups.block_size
        # Synchronous loads cannot be reported failed (vLLM takes no per-request failure for a
        # running request of a hybrid model), so they are made only where the lookup verified
        # every page's size and nothing is left for the worker to reject.
        self.sync_loads = None not in groups.page_bytes.values()
        self._lookups: dict[str, Future[Lookup]] = {}
        self._hits: dict[str, Lookup] = {}
        self._loads: dict[str, LoadOp] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._salts: dict[str, str | None] = {}  # a request's cache_salt, until it finishes
        self._uncacheable: set[str] = set()  # requests with a LoRA adapter or multimodal inputs
        self.in_flight = PromptsInFlight(lambda: self._count("lookups_deferred"))
        self._lookup_pool: ThreadPoolExecutor | None = None
        self.held = HeldPages(2 * max_num_seqs, config.max_held_bytes)
        # shadow checks (`shadow.py`) of the served checkpoint `model`, served in `dtype`
        self.shadow = ShadowChecks(self, model, dtype)
        self.shadow_guard = self.shadow.guard

    @property
    def held_bytes(self) -> int:
        """Bytes of verified pages held in memory for requests vLLM has not admitted yet."""
        return self.held.bytes

    @property
    def lookups_in_flight(self) -> int:
        """Lookups submitted to the lookup thread and not yet taken by their request."""
        return len(self._lookups)

    @timed("hook_seconds")
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if num_computed_tokens:  # only with vLLM's prefix cache, which the connector refuses
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
            if lookup is None and self.in_flight.holds_back(request):
                return None, False
            if lookup is None:  # read and verify off the engine loop; other requests go on meanwhile
                if self.held.full(len(self._lookups)):
                    return None, False
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
            self.in_flight.computing(req_id, tokens, self._salts.get(req_id), hit.matched)
            self.held.hold(hit)
            self._count("lookups")
            if hit.matched and not hit.start:  # nothing to load: the whole match is replayed
                self._record_hit(hit)
        elif hit.start and hit.resume is None:
            # Asked again after its load went out: vLLM preempted the request or its load failed,
            # and its computed tokens are gone. The pages left with the load: compute it in full.
            hit.start, hit.exact_state = 0, False
        return hit.start, hit.start > 0 and not self.sync_loads

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HybridKVWorkerMetadata):
            self.in_flight.saved(meta.saved)

    def _record_hit(self, hit: Lookup) -> None:
        with self._stats_lock:
            self._stats.record_hit(hit.matched, hit.start, hit.exact_state)

    @timed("lookup_seconds")
    def _look_up(self, request) -> Lookup:
        return look_up(self, self.shadow_guard, request)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        # The load writes every linear state slot (the checkpoint, or zeros) and clears every ring:
        # vLLM must not zero them after it, as it would a state group it thinks nothing restored.
        return tuple(sorted(self.kind_of))

    @timed("hook_seconds")
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        hit = self._hits.get(request.request_id)
        if not num_external_tokens:  # no load, or the second call once a load is done
            if hit is not None and self.held.take(hit) is not None:  # vLLM declined the load
                hit.start, hit.exact_state = 0, False
                self._record_hit(hit)
            return
        if hit is None or hit.start != num_external_tokens or hit.resume is None:
            # vLLM now waits for a load this connector cannot make: report it failed rather than
            # leave the request waiting for ever; vLLM then computes it in full.
            log.warning("hybridkv: request %s expects a load of %d tokens that is not staged; recomputing it",
                        request.request_id, num_external_tokens)  # fmt: skip
            self._loads[request.request_id] = LoadOp(
                request.request_id, [], None, {}, failed=True, sync=self.sync_loads
            )
            if hit is not None:
                never_counted = self.held.take(hit) is not None  # no load was made for it
                hit.start, hit.exact_state = 0, False
                if never_counted:
                    self._record_hit(hit)
            return
        ids = blocks.get_block_ids()
        resume = self.held.take(hit)  # the pages leave with the load
        self._record_hit(hit)  # reuse counts once the load is made, not when it was found
        targets = {g: b for kind in self.kinds for g, b in kind.load_targets(ids, len(resume.blocks)).items()}
        self._loads[request.request_id] = LoadOp(
            request.request_id, resume.blocks, resume.states, targets, start=resume.start, sync=self.sync_loads
        )

    @timed("hook_seconds")
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
        self.in_flight.saving(req_id)
        blocks = -(-len(tracked.tokens) // self.block_size)
        sources = {
            group: ids
            for kind in self.kinds
            for group, ids in kind.save_sources(tracked.block_ids, blocks, self.config.save_states != "never").items()
        }
        meta.saves.append(SaveOp(req_id, tracked.tokens, tracked.first_block, sources, tracked.salt, tracked.exact))

    def _forget(self, req_id: str) -> dict | None:
        self._uncacheable.discard(req_id)
        self.in_flight.forget(req_id)
        self._tracked.pop(req_id, None)
        self._salts.pop(req_id, None)
        if (lookup := self._lookups.pop(req_id, None)) is not None:
            lookup.cancel()  # aborted while its lookup ran
        hit = self._hits.pop(req_id, None)
        if hit is None:
            return None
        self.held.take(hit)
        return {"matched": hit.matched, "reused": hit.start, "exact_state": hit.exact_state}

    @timed("hook_seconds")
    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        hit = self._hits.get(request.request_id)
        uncacheable = request.request_id in self._uncacheable
        info = self._forget(request.request_id)
        if self.shadow.checker is not None and not uncacheable:
            self.shadow.queue(request, hit)
        return False, ({"hybridkv": info} if info is not None else None)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def shutdown(self) -> None:
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self.shadow.shutdown()
        super().shutdown()
