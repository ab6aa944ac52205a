"""The scheduler side's shadow checks: which finished requests go to the shadow process (`shadow.py`),
and what their results do to the counters, the log and the guard's ladder."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from hybridkv.integrations.vllm.config import ConnectorConfig
from hybridkv.integrations.vllm.shadow import (
    EXACT,
    FULL,
    STORED,
    ZERO,
    ShadowChecker,
    ShadowGuard,
    ShadowJob,
    ShadowResult,
    sampled,
    zero_label,
)
from hybridkv.integrations.vllm.side import ConnectorSide
from hybridkv.methods import Budget

log = logging.getLogger("hybridkv.vllm")


class ShadowChecks:
    """One scheduler side's checks of `model` served in `dtype` (no process unless `shadow_rate` > 0)."""

    def __init__(self, side: ConnectorSide, model: str, dtype: str) -> None:
        self.side = side
        self.config = side.config
        self.guard = ShadowGuard(
            self.config.shadow_floor, self.config.shadow_window, _larger_tails(self.config),
            self.config.shadow_on_error,
        )  # fmt: skip
        self._failed_seen = False  # the first failure is logged, later ones only counted
        self._log_failed = False
        self.checker: ShadowChecker | None = None
        if self.config.shadow_rate > 0:
            self.checker = ShadowChecker(model, dtype, self.done, on_down=self.stopped)

    def queue(self, request, hit) -> None:  # hit: the request's scheduler-side lookup, if it had one
        """A finished request, sampled at `shadow_rate`, goes to the shadow process with how its
        prompt was computed; its answer is out, so the check delays nothing. Greedy answers are
        checked; a zero-state resume's first token is checked whatever the sampling. A full queue
        drops it (counted)."""
        if not sampled(request.request_id, self.config.shadow_rate):
            return
        if hit is not None and hit.start and hit.resume is not None:
            return  # its load was never made (aborted before admission): nothing was served
        if hit is None or not hit.start:
            kind, label = FULL, FULL
        elif hit.exact_state:
            kind, label = EXACT, EXACT
        elif hit.zero_state:
            kind, label = ZERO, zero_label(hit.budget)
        else:
            kind, label = STORED, STORED
        params = getattr(request, "sampling_params", None)
        greedy = params is not None and getattr(params, "temperature", 1.0) < 1e-5  # vLLM's _SAMPLING_EPS
        outputs = [int(t) for t in getattr(request, "output_token_ids", None) or []]
        served = outputs if greedy and outputs else None
        if served is None and kind != ZERO:
            return  # nothing to check: only a greedy answer has one right continuation
        rung = hit.rung if hit is not None else self.guard.effective_rung
        job = ShadowJob(request.request_id, list(request.prompt_token_ids), kind, label,
                        hit.start if hit is not None else 0, served, rung)  # fmt: skip
        queued = self.checker.submit(job)
        with self.side.stats() as stats:  # a full queue drops it; a shadow process that is gone fails it
            stats.count("shadow_queued" if queued else "shadow_failed" if self.checker.dead else "shadow_dropped")
        if queued:
            return
        self.stopped("the shadow process is down" if self.checker.dead else "the shadow queue is full")

    def stopped(self, why: str) -> None:
        """Checks are not being made: with `shadow_on_error` "exact", lookups hold at exact stored
        states until one succeeds again."""
        guard = self.guard
        with self.side.stats() as stats:
            if guard.unavailable:
                return
            guard.unavailable = True
            stats.count("shadow_unavailable_spells")
            stats.set_gauges(guard)
        if guard.on_error == "exact":
            log.warning("hybridkv: %s: exact stored states or full prefills only, until checks resume", why)

    def done(self, job: ShadowJob, result: ShadowResult) -> None:
        """A check's result, on the shadow's reading thread: counted for the next step's stats, and
        weighed by the guard."""
        guard = self.guard
        if result.error is not None:
            with self.side.stats() as stats:
                first, self._failed_seen = not self._failed_seen, True
                stats.count("shadow_failed")
            if first:
                log.warning("hybridkv: a shadow check failed: %s", result.error)
            self.stopped(f"a shadow check failed ({result.error})")
            return
        if self.config.shadow_log is not None:
            self._log(job, result)
        with self.side.stats() as stats:
            stats.record_shadow(job.label, result)
            before, recovered = guard.describe(guard.effective_rung), guard.unavailable
            guard.unavailable = False
            step = guard.record(job.kind, result.flagged, job.rung)
            if step:
                stats.count("shadow_escalations" if step > 0 else "shadow_steps_down")
            stats.set_gauges(guard)
            excess = guard.judged
        if recovered and guard.on_error == "exact":
            log.warning("hybridkv: shadow checks resumed: %s again", guard.describe(guard.effective_rung))
        if step > 0:
            log.warning(
                "hybridkv: shadow checks: answers read from the store diverge %.2f more often than full prefills' "
                "over the last %d (shadow_floor %.2f): stepping up from %s to %s",
                excess, guard.window, guard.floor, before, guard.describe(),
            )  # fmt: skip
        elif step < 0:
            log.warning("hybridkv: shadow checks clean over a window: stepping down to %s", guard.describe())

    def _log(self, job: ShadowJob, result: ShadowResult) -> None:
        """One JSON line per check in `shadow_log` (on the shadow's reading thread, one at a time)."""
        line = {"request_id": job.request_id, "kind": job.kind, "label": job.label, "start": job.start,
                "rung": job.rung, **{k: v for k, v in asdict(result).items() if k != "request_id"}}  # fmt: skip
        try:
            with open(self.config.shadow_log, "a") as sink:
                sink.write(json.dumps(line) + "\n")
        except OSError as err:
            with self.side.stats():  # the lock: checks finish on the reading thread
                first, self._log_failed = not self._log_failed, True
            if first:
                log.warning("hybridkv: shadow_log %s cannot be written: %s", self.config.shadow_log, err)

    def shutdown(self) -> None:
        if self.checker is not None:
            self.checker.shutdown()


def _larger_tails(config: ConnectorConfig) -> tuple[Budget, ...]:
    """The ladder's tails that replay more than the configured budget (all of them where one of
    the two is a token count: which is larger depends on the match)."""
    configured = config.replay_budget.fraction
    return tuple(
        tail for tail in config.shadow_ladder
        if configured is None or tail.fraction is None or tail.fraction > configured
    )  # fmt: skip
