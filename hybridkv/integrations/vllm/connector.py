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

vLLM builds one connector per role, and each role's connector builds that side only:
`scheduler_side.SchedulerSide` or `worker_side.WorkerSide`, which talk through the step's metadata
(`metadata.py`); both take the settings (`config.ConnectorConfig`: `store`, `replay_budget`,
`replay_horizon`, `cache_salt`, `save_states`, `max_held_mib`, and the shadow checks' `shadow_*`) and
the engine's cache layout (`layout.CacheGroups`). A request may set its own budget:
`SamplingParams(extra_args={"kv_transfer_params": {"replay_budget": 0.1}})`. Each finished
request reports `{"hybridkv": {"matched", "reused", "exact_state"}}` in
`RequestOutput.kv_transfer_params`.

Needs `enable_prefix_caching=False`: with vLLM's own hybrid prefix cache on, the state slot the
connector writes would be hashed as vLLM's exact state at s. Set `"kv_load_failure_policy":
"recompute"` in the kv-transfer config: a load that fails in the worker (its pages were verified
before, so only a layout mismatch can) then recomputes the request instead of failing it.
"""

from __future__ import annotations

import logging

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import BlockStore, EntryWorths, engine_fingerprint, token_count
from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.layout import classify_groups
from hybridkv.integrations.vllm.metadata import HybridKVWorkerMetadata
from hybridkv.integrations.vllm.metrics import HybridKVPromMetrics, HybridKVStats
from hybridkv.integrations.vllm.scheduler_side import SchedulerSide
from hybridkv.integrations.vllm.worker_side import WorkerSide
from hybridkv.models.meta import cost_model
from hybridkv.store import open_store
from hybridkv.store.guarded import GuardedStore

log = logging.getLogger("hybridkv.vllm")


def entry_worths(config: ConnectorConfig, hf_config) -> EntryWorths:
    """What the worker's saves are worth to a store kept by value: prefill FLOPs from the served
    model's own cost model (`hybridkv.models.meta.cost_model`; tokens where it cannot be built), and
    for `save_states` "value" the tail a zero-state resume would replay instead."""
    try:
        costs = cost_model(hf_config)
    except Exception as error:  # an architecture only vLLM knows: every token costs the same
        log.warning("hybridkv: no cost model for %s (%s); entries are worth their token counts",
                    type(hf_config).__name__, error)  # fmt: skip
        flops = token_count
    else:

        def flops(start: int, end: int) -> float:
            return costs.prefill_flops(start, end) - costs.head_flops if end > start else 0.0

    if config.save_states != "value":
        return EntryWorths(flops)
    horizon = config.replay_horizon

    def tail(position: int) -> int:
        tokens = config.replay_budget.tail_tokens(position)
        return tokens if horizon is None else min(tokens, horizon)

    return EntryWorths(flops, tail)


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Checks the engine, reads the settings and the cache layout, builds the side of its role and
    hands it each of vLLM's hooks. What the connector itself lacks reads from that side (its
    block store, layout and counters: `connector.held_bytes` is the scheduler side's)."""

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
        model = vllm_config.model_config
        config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config, model.model)
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "hybridkv: kv_load_failure_policy is %r; set it to 'recompute' so that a load failing in the "
                "worker recomputes the request instead of failing it", self._kv_transfer_config.kv_load_failure_policy,
            )  # fmt: skip
        groups = classify_groups(kv_cache_config)
        download_dir = vllm_config.load_config.download_dir  # where vLLM fetched a model named by its repository
        fingerprint = engine_fingerprint(model.model, groups.layout, str(model.dtype), model.revision, download_dir)
        worths = entry_worths(config, model.hf_config) if role == KVConnectorRole.WORKER else EntryWorths()
        store = GuardedStore(open_store(config.store))
        blocks = BlockStore(store, fingerprint, groups.block_size, config.cache_salt, worths)
        self._side: SchedulerSide | WorkerSide
        if role == KVConnectorRole.SCHEDULER:
            max_num_seqs = vllm_config.scheduler_config.max_num_seqs
            dtype = str(model.dtype).removeprefix("torch.")
            self._side = SchedulerSide(config, groups, blocks, max_num_seqs, model.model, dtype)
        else:
            self._side = WorkerSide(config, groups, blocks)

    @property
    def _scheduler(self) -> SchedulerSide:
        if not isinstance(self._side, SchedulerSide):
            raise HybridKVError("HybridKVConnector: a scheduler hook was called on the worker's connector")
        return self._side

    @property
    def _worker(self) -> WorkerSide:
        if not isinstance(self._side, WorkerSide):
            raise HybridKVError("HybridKVConnector: a worker hook was called on the scheduler's connector")
        return self._side

    # == scheduler side ==========================================================================

    @property
    def requires_kv_delivery(self) -> bool:  # a best-effort cache: a dropped save is a later miss
        return False

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return self._scheduler.get_loaded_kv_cache_group_ids(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request, block_ids)

    # == worker side =============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # saved whole in wait_for_save, once the prompt's last layer is written

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> HybridKVWorkerMetadata | None:
        return self._worker.build_connector_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # == both sides: figures for vLLM's log line and Prometheus endpoint ============================

    def get_kv_connector_stats(self) -> HybridKVStats | None:
        return self._side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> HybridKVStats:
        return HybridKVStats(data=data) if data else HybridKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> HybridKVPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._side.shutdown()
