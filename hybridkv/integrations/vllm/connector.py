"""`HybridKVConnector`: token-level prefix reuse for hybrid models inside vLLM (v1 KV connector).

    vllm serve MODEL --no-enable-prefix-caching --kv-transfer-config '{"kv_connector": "HybridKVConnector",
        "kv_connector_module_path": "hybridkv.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "replay_budget": 0.05}}'

Scheduler side: for a new request, find the longest stored prefix L (token-level), pick the replay
start s (an exact stored checkpoint within the budget, else L − t), read and verify the pages of
[0, s) and stage them locally, and report s tokens as computed. Worker side: before the forward
pass, copy the staged attention blocks into the request's blocks and write every linear layer's
state slot — the exact checkpoint, or zeros — so vLLM's own prefill of [s, end) is the tail
replay. When a prompt's prefill completes, its new attention blocks and its final linear states
(an exact checkpoint at the prompt's end) are written to the store.

Extra config: `store` (a hybridkv store URL, default a file store under the temp dir — shared by
the engine's processes), `replay_budget` (fraction of the match, or "256tok"; default 0.05),
`cache_salt` (tenant namespace), `save_states` (default true), `stage_dir`. A request may set its own
budget: `SamplingParams(extra_args={"kv_transfer_params": {"replay_budget": 0.1}})`. Each finished
request reports `{"hybridkv": {"matched", "reused", "exact_state"}}` in `RequestOutput.kv_transfer_params`.

Needs `enable_prefix_caching=False`: with vLLM's own hybrid prefix cache on, the state slot the
connector writes would be hashed as vLLM's exact state at s.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import (
    BlockStore,
    engine_fingerprint,
    read_staged,
    write_staged,
)
from hybridkv.methods import Budget
from hybridkv.store import open_store
from hybridkv.store.guarded import GuardedStore

log = logging.getLogger("hybridkv.vllm")

# KV-cache specs whose blocks hold plain per-token attention KV, restorable as whole blocks.
_WHOLE_BLOCK_SPECS = (FullAttentionSpec, MLAAttentionSpec)


@dataclass
class LoadOp:
    req_id: str
    staged: str  # path of the staged pages
    attention_blocks: dict[int, list[int]]  # attention group -> its block ids covering [0, start)
    state_slots: dict[int, int]  # mamba group -> the request's state slot


@dataclass
class SaveOp:
    tokens: list[int]
    first_block: int  # blocks before it were loaded from the store: not written again
    attention_blocks: dict[int, list[int]]  # attention group -> the prompt's block ids
    state_slots: dict[int, int]


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


@dataclass
class _Hit:  # scheduler-side record of a request's lookup; its pages wait in `staged`
    matched: int
    start: int
    exact_state: bool = False
    blocks: int = 0
    staged: str | None = None


@dataclass
class _Tracked:  # scheduler-side view of a running request, until its prefill is saved
    tokens: list[int]
    block_ids: list[list[int]]
    first_block: int
    saved: bool = False


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.cache_config.enable_prefix_caching:
            raise HybridKVError(
                "HybridKVConnector needs vLLM's own prefix cache off (--no-enable-prefix-caching): with it on, "
                "vLLM would hash the linear state the connector writes as its own exact state"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.budget = Budget.parse(str(extra.get("replay_budget", 0.05)))
        self.save_states = bool(extra.get("save_states", True))
        url = extra.get("store") or f"file://{Path(tempfile.gettempdir()) / 'hybridkv-vllm-store'}"
        self.stage_dir = Path(extra.get("stage_dir") or Path(tempfile.gettempdir()) / "hybridkv-vllm-stage")
        self.stage_dir.mkdir(parents=True, exist_ok=True)

        groups = kv_cache_config.kv_cache_groups
        self.attention_groups, self.mamba_groups = {}, {}
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                self.mamba_groups[g] = list(group.layer_names)
            elif type(spec) in _WHOLE_BLOCK_SPECS and getattr(spec, "tokens_per_state", 1) in (1, -1):
                self.attention_groups[g] = list(group.layer_names)
            else:  # sliding windows, ring buffers, pooled indexer caches: not restorable block by block yet
                raise HybridKVError(
                    f"HybridKVConnector cannot restore KV-cache group {g} ({type(spec).__name__}, layers "
                    f"{', '.join(group.layer_names[:3])}...): it handles full-attention and Mamba-style state groups"
                )
        if not self.attention_groups:
            raise HybridKVError("HybridKVConnector: the model has no full-attention KV-cache group to reuse")
        sizes = {groups[g].kv_cache_spec.block_size for g in self.attention_groups}
        if len(sizes) != 1:
            raise HybridKVError(f"HybridKVConnector: attention groups with different block sizes {sorted(sizes)}")
        self.block_size = sizes.pop()
        spec_layout = [
            (type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes, g.layer_names)
            for g in groups
        ]
        model = vllm_config.model_config
        fingerprint = engine_fingerprint(model.model, spec_layout, str(model.dtype))
        self.blocks = BlockStore(
            GuardedStore(open_store(url)), fingerprint, self.block_size, extra.get("cache_salt", "")
        )
        self.store_url = url
        # scheduler side
        self._hits: dict[str, _Hit] = {}
        self._loads: dict[str, LoadOp] = {}
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._kv: dict[str, torch.Tensor] = {}

    # == scheduler side ==========================================================================

    @property
    def requires_kv_delivery(self) -> bool:  # loads are synchronous: nothing to hand over on preemption
        return False

    def _layouts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes of each attention layer's block and each linear layer's state, without padding."""
        groups = self._kv_cache_config.kv_cache_groups

        def size(group: int) -> int:
            spec = groups[group].kv_cache_spec
            return getattr(spec, "real_page_size_bytes", spec.page_size_bytes)

        attention = {name: size(g) for g, names in self.attention_groups.items() for name in names}
        states = {name: size(g) for g, names in self.mamba_groups.items() for name in names}
        return attention, states

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if num_computed_tokens:  # only with vLLM's prefix cache, which __init__ refuses
            return 0, False
        hit = self._hits.get(request.request_id)
        if hit is None:
            hit = self._hits[request.request_id] = self._look_up(request)
        return hit.start, False

    def _look_up(self, request) -> _Hit:
        """Find, read, verify and stage a request's pages; claim nothing that is not staged."""
        attention, states = self._layouts()
        try:
            resume = self.blocks.resume(
                list(request.prompt_token_ids), attention, states, self._request_budget(request)
            )
            hit = _Hit(resume.matched, resume.start, resume.states is not None, len(resume.blocks))
            if resume.start:
                path = self.stage_dir / f"{uuid.uuid4().hex}.hkvs"
                write_staged(path, resume)
                hit.staged = str(path)
            return hit
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

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        hit = self._hits.get(request.request_id)
        if not num_external_tokens or hit is None or hit.start != num_external_tokens or hit.staged is None:
            return
        ids = blocks.get_block_ids()
        self._loads[request.request_id] = LoadOp(
            request.request_id,
            hit.staged,
            {g: list(ids[g][: hit.blocks]) for g in self.attention_groups},
            {g: ids[g][0] for g in self.mamba_groups},
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = HybridKVMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if (load := self._loads.pop(new.req_id, None)) is not None:
                meta.loads.append(load)
            hit = self._hits.get(new.req_id)
            matched = hit.matched if hit is not None else 0
            self._tracked[new.req_id] = _Tracked(
                list(new.prompt_token_ids or []), [list(b) for b in new.block_ids], matched // self.block_size
            )
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
        blocks = -(-len(tracked.tokens) // self.block_size)
        meta.saves.append(
            SaveOp(
                tracked.tokens,
                tracked.first_block,
                {g: tracked.block_ids[g][:blocks] for g in self.attention_groups},
                {g: tracked.block_ids[g][0] for g in self.mamba_groups} if self.save_states else {},
            )
        )

    def _forget(self, req_id: str) -> dict | None:
        self._tracked.pop(req_id, None)
        self._loads.pop(req_id, None)
        hit = self._hits.pop(req_id, None)
        if hit is None:
            return None
        if hit.staged is not None:
            Path(hit.staged).unlink(missing_ok=True)
        return {"matched": hit.matched, "reused": hit.start, "exact_state": hit.exact_state}

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

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HybridKVMetadata):
            return
        for load in meta.loads:
            # Written and verified by the scheduler just before; it removes the file when the request
            # ends (a preempted request loads it again when it is rescheduled).
            _, blocks, states = read_staged(Path(load.staged))
            for group, ids in load.attention_blocks.items():
                for block, pages in zip(ids, blocks, strict=True):
                    for layer in self.attention_groups[group]:
                        self._page(layer, block).copy_(pages[layer])
            for group, slot in load.state_slots.items():
                for layer in self.mamba_groups[group]:
                    page = self._page(layer, slot)
                    page.copy_(states[layer]) if states is not None else page.zero_()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # saved whole in wait_for_save, once the prompt's last layer is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HybridKVMetadata):
            return
        for save in meta.saves:
            try:
                self._save(save)
            except Exception:  # a cache that cannot be written costs reuse later, never this request
                log.exception("hybridkv: saving a prompt of %d tokens failed", len(save.tokens))

    def _save(self, save: SaveOp) -> None:
        count = len(next(iter(save.attention_blocks.values())))
        pages = [
            {
                layer: self._page(layer, save.attention_blocks[group][index]).clone()
                for group, layers in self.attention_groups.items()
                for layer in layers
            }
            for index in range(save.first_block, count)
        ]
        state_at = None
        if save.state_slots:
            states = {
                layer: self._page(layer, slot).clone()
                for group, slot in save.state_slots.items()
                for layer in self.mamba_groups[group]
            }
            if self.blocks.save_state(save.tokens, len(save.tokens), states):
                state_at = len(save.tokens)
        self.blocks.save_blocks(save.tokens, save.first_block, pages, state_at)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # loads read local staged files the scheduler verified; see block_store

    def shutdown(self) -> None:
        if os.environ.get("HYBRIDKV_VLLM_STATS"):
            log.info("hybridkv store %s: %s", self.store_url, self.blocks.store.stats())
