"""A request's lookup on the scheduler side: the method and budget it resumes with (its own
`kv_transfer_params`, else the connector's settings, unless the shadow guard's ladder has stepped
up), its pages read and verified off the engine loop, and the verified pages held in memory until
vLLM admits the request (`HeldPages`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import ResumePlan
from hybridkv.integrations.vllm.config import ConnectorConfig, engine_method
from hybridkv.integrations.vllm.shadow import ShadowGuard
from hybridkv.integrations.vllm.side import ConnectorSide
from hybridkv.integrations.vllm.writes import StoreWriter
from hybridkv.methods import Budget, RecoveryMethod
from hybridkv.methods.seeded_replay import SeededReplay

log = logging.getLogger("hybridkv.vllm")
# Above the ladder's first rung the configured method gives way: seeded-replay at a longer tail, then
# an exact stored state anywhere in the match (`shadow.ShadowGuard`).
LADDER_METHOD = SeededReplay()


@dataclass
class Lookup:  # scheduler-side record of a request's lookup, with its verified pages until loaded
    matched: int
    start: int
    exact_state: bool = False  # resumed from a stored state, and everything loaded was exact
    resume: ResumePlan | None = None
    zero_state: bool = False  # resumed at start from zeroed linear states (a tail replay)
    budget: str = ""  # the replay budget it was looked up with
    rung: int = 0  # the shadow guard's rung it was looked up at


def look_up(side: ConnectorSide, guard: ShadowGuard, request) -> Lookup:
    """Find, read and verify a request's pages; claim nothing that is not verified in memory."""
    attention, states = side._layouts()
    config = side.config
    method, budget, horizon = request_method(config, request), request_budget(config, request), config.replay_horizon
    rung = guard.effective_rung
    if rung >= guard.top:  # the ladder's top: nothing is read
        return Lookup(0, 0, rung=rung)
    if rung >= guard.exact_rung:  # the whole match is in reach: an exact stored state anywhere in it
        method, budget, horizon = LADDER_METHOD, Budget(fraction=1.0), None
    elif rung > 0:
        method, budget, horizon = LADDER_METHOD, guard.tails[rung - 1], None
    try:
        StoreWriter.drain_store(side.config.store)  # this process's own saves to it first
        resume = side.blocks.resume(
            list(request.prompt_token_ids), attention, states, method, budget,
            getattr(request, "cache_salt", None), horizon, side.pool_alignment,
        )  # fmt: skip
        if rung >= guard.exact_rung and resume.start and not resume.exact:
            return Lookup(resume.matched, 0, rung=rung)  # only an inexact state in reach: a full prefill
        exact_state = resume.states is not None and resume.exact
        zero_state = resume.start > 0 and resume.states is None
        return Lookup(
            resume.matched, resume.start, exact_state, resume if resume.start else None, zero_state, str(budget), rung
        )
    except Exception:  # never take the engine down over a cache: recompute instead
        log.exception("hybridkv: lookup failed for request %s; computing it in full", request.request_id)
        return Lookup(0, 0, rung=rung)


def request_method(config: ConnectorConfig, request) -> RecoveryMethod:
    """The method a request resumes with: its own `method`, else the connector's."""
    return _request_setting(request, "method", engine_method, config.method)


def request_budget(config: ConnectorConfig, request) -> Budget:
    """The replay budget a request resumes with: its own `replay_budget`, else the connector's."""
    return _request_setting(request, "replay_budget", lambda value: Budget.parse(str(value)), config.replay_budget)


def _request_setting(request, key: str, read: Callable[[Any], Any], configured: Any) -> Any:
    """A request's own `key` in its kv_transfer_params, read by `read`; the engine's `configured`
    when it sets none, or one that is refused (with a warning: the request is served, not failed)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if key not in params:
        return configured
    try:
        return read(params[key])
    except HybridKVError as err:
        shown = getattr(configured, "name", configured)
        log.warning("hybridkv: request %s: %s; using the engine's %s %s", request.request_id, err, key, shown)
        return configured


class HeldPages:
    """Verified pages wait in memory for their request's admission: this bounds how many requests
    hold them (lookups in flight included) and their bytes (a long prompt's pages weigh more)."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = 0  # hits holding verified pages
        self.bytes = 0

    def full(self, lookups_in_flight: int) -> bool:
        """No new lookup now: enough pages are held for requests not yet admitted (ask later)."""
        return lookups_in_flight + self.requests >= self.max_requests or (
            self.requests > 0 and self.bytes >= self.max_bytes
        )

    def hold(self, hit: Lookup) -> None:
        if hit.resume is not None:
            self.requests += 1
            self.bytes += hit.resume.nbytes

    def take(self, hit: Lookup) -> ResumePlan | None:
        """The hit's verified pages, which leave it (loaded, declined or dropped)."""
        resume, hit.resume = hit.resume, None
        if resume is not None:
            self.requests -= 1
            self.bytes -= resume.nbytes
        return resume
