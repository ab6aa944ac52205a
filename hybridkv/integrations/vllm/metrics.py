"""The connector's figures through vLLM's own connector-stats path: its periodic log line and its
Prometheus endpoint (`/metrics` of `vllm serve`), as `vllm:hybridkv_*` series per engine.

Both sides of the connector report: the scheduler its lookups (hits, tokens reused, tokens
replayed, a replay-length histogram), its store's read errors and its shadow checks (`shadow.py`:
counters and a KL histogram, reported with the engine step after each check's result came back);
the worker its store's write errors. vLLM aggregates the two (`aggregate`) and hands the sum to
`HybridKVPromMetrics.observe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from hybridkv.eval.stats import Excess
from hybridkv.integrations.vllm.shadow import CONTROL

COUNTERS = {
    "lookups": "Requests the connector looked up in its store.",
    "lookups_deferred": "Requests held back for the pages of a longer shared prefix another request was computing.",
    "hits": "Requests admitted with a stored prefix (any matched tokens), counted when their load is made.",
    "exact_states": "Hits resumed from an exact stored linear-state checkpoint.",
    "tokens_reused": "Prompt tokens loaded from the store instead of computed.",
    "tokens_replayed": "Matched prompt tokens recomputed anyway (the tail replay).",
    "store_errors": "Store operations that failed (down, timed out, full) or returned a corrupt entry.",
    # A store with a capacity (`?capacity=BYTES&policy=`): what its rule admitted, refused and evicted
    "kv_blocks_admitted": "KV blocks the store took.",
    "states_admitted": "Linear-state checkpoints the store took.",
    "kv_blocks_refused": "KV blocks the store's capacity refused (worth less than what they would evict, or "
    "their parent block gone).",
    "states_refused": "Linear-state checkpoints the store's capacity refused.",
    "kv_blocks_evicted": "KV blocks this engine's writes evicted to make room.",
    "states_evicted": "Linear-state checkpoints this engine's writes evicted to make room.",
    # Where the connector's time goes. Hooks run on the engine loop, and wait there a little for a
    # lookup (a hit then loads in the same step); copies move pages between
    # vLLM's cache and the connector; lookups (key hashing, store reads, checksums) run on a
    # background thread, before a request's load, off the engine loop.
    "hook_seconds": "Seconds in the connector's hooks on the engine loop, page copies excluded.",
    "wait_seconds": "Seconds the engine loop waited for lookups to answer (at most 50 ms a request).",
    "copy_seconds": "Seconds copying pages into vLLM's cache (loads) and out of it (saves).",
    "lookup_seconds": "Seconds of lookups (hashing, store reads, verification) on the lookup thread.",
    "write_seconds": "Seconds writing saved prompts (hashing, encoding, store puts) on the writer thread.",
    "saves_dropped": "Prompts not saved because the writer's backlog was full (a slow or stalled store).",
    # Shadow checks (`shadow_rate`, `shadow.py`): sampled finished requests against exact full prefill.
    "shadow_queued": "Finished requests sampled for a shadow check and queued.",
    "shadow_checks": "Shadow checks completed (every kind; their answers are counted per kind in shadow_answers).",
    "shadow_first_token_checks": "Zero-state resumes whose recipe's first token was checked against the exact one.",
    "shadow_top1_disagreements": "Of those, checks whose served recipe's top-1 first token differs from the exact one.",
    "shadow_reproduced_checked": "Zero-state checks of greedy requests: first served token against the shadow's.",
    "shadow_reproduced": "Of those, checks where the served recipe's top-1 (in the shadow) is the token vLLM served.",
    "shadow_dropped": "Sampled requests not checked because the shadow's queue was full.",
    "shadow_failed": "Shadow checks that could not be made (the shadow model failed to load or its process died).",
    "shadow_unavailable_spells": "Times checks stopped (dropped or failed) after working (see shadow_on_error).",
    "shadow_escalations": "Times the shadow guard stepped up its ladder (excess divergence at shadow_floor).",
    "shadow_steps_down": "Times the shadow guard stepped back down after a clean window.",
}
REPLAY_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# KL(exact || served recipe) in nats, per decade: the float32 shadow's exact run against one unsplit
# forward is ~2e-14 (below every bucket), a zeroed state the gates have forgotten 1e-7 to 1e-5, a few
# tokens from zero states 1e-3 to 1e-1 (the random-weight bench model).
SHADOW_KL_BUCKETS = tuple(10.0**e for e in range(-9, 2))
# The first diverging answer position (0: the first token), per kind.
DIVERGENCE_POSITION_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STORE_ERROR_KINDS = ("get_errors", "put_errors", "delete_errors", "corrupt", "skipped_while_down")
# Counters read off the store's own counts (`GuardedStore.counts`, the backend's `evicted` by kind)
STORE_COUNTS = {
    "kv_blocks_admitted": "admitted:kv-block", "states_admitted": "admitted:state",
    "kv_blocks_refused": "refused:kv-block", "states_refused": "refused:state",
    "kv_blocks_evicted": "evicted:kv-block", "states_evicted": "evicted:state",
}  # fmt: skip


@dataclass
class HybridKVStats(KVConnectorStats):
    """`data`: {"counters": {name: count}, "replay_tokens": [one sample per hit], "shadow_kl": [one
    sample per first-token check], "shadow_answers": {kind: [checks, divergences, [positions]]},
    "gauges": {name: value}} (plain types: it crosses from the engine to the API server process)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {
            "counters": dict.fromkeys(COUNTERS, 0), "replay_tokens": [], "shadow_kl": [], "shadow_answers": {},
            "gauges": {},
        }  # fmt: skip

    def count(self, name: str, value: float = 1) -> None:
        self.data["counters"][name] += value

    def record_hit(self, matched: int, reused: int, exact_state: bool) -> None:
        """A request admitted with `matched` stored tokens, `reused` of them loaded."""
        if matched:
            self.count("hits")
            self.count("exact_states", int(exact_state))
            self.count("tokens_reused", reused)
            self.count("tokens_replayed", matched - reused)
            self.data["replay_tokens"].append(matched - reused)

    def record_shadow(self, kind: str, result) -> None:
        """One completed shadow check (`shadow.ShadowResult`) of a request of `kind` (its label)."""
        self.count("shadow_checks")
        if result.answer_length:
            tally = self.data["shadow_answers"].setdefault(kind, [0, 0, []])
            tally[0] += 1
            if result.diverged_at is not None:
                tally[1] += 1
                tally[2].append(result.diverged_at)
        if result.top1_agrees is not None:
            self.count("shadow_first_token_checks")
            self.count("shadow_top1_disagreements", int(not result.top1_agrees))
            self.data["shadow_kl"].append(result.kl)
        if result.reproduced is not None:
            self.count("shadow_reproduced_checked")
            self.count("shadow_reproduced", int(result.reproduced))

    def set_gauges(self, guard) -> None:
        """The shadow guard's state (`shadow.ShadowGuard`), sent with these figures."""
        self.data["gauges"].update(shadow_rung=guard.effective_rung, shadow_unavailable=int(guard.unavailable))

    def aggregate(self, other: KVConnectorStats) -> HybridKVStats:
        for name, value in other.data.get("counters", {}).items():
            self.data["counters"][name] = self.data["counters"].get(name, 0) + value
        self.data["replay_tokens"].extend(other.data.get("replay_tokens", []))
        self.data.setdefault("shadow_kl", []).extend(other.data.get("shadow_kl", []))
        answers = self.data.setdefault("shadow_answers", {})
        for kind, (checks, diverged, positions) in other.data.get("shadow_answers", {}).items():
            tally = answers.setdefault(kind, [0, 0, []])
            tally[0] += checks
            tally[1] += diverged
            tally[2].extend(positions)
        self.data.setdefault("gauges", {}).update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        lengths, kls = self.data["replay_tokens"], self.data.get("shadow_kl", [])
        return {
            **self.data["counters"],
            "replay_tokens_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            **({"shadow_kl_mean": sum(kls) / len(kls)} if kls else {}),
            **{
                f"shadow_divergence_rate[{kind}]": diverged / checks
                for kind, (checks, diverged, _) in self.data.get("shadow_answers", {}).items()
            },
        }

    def is_empty(self) -> bool:
        return (
            not any(self.data["counters"].values())
            and not self.data["replay_tokens"]
            and not self.data.get("shadow_kl")
            and not self.data.get("shadow_answers")
            and not self.data.get("gauges")
        )


class HybridKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:hybridkv_{name}", documentation=doc, labelnames=labelnames)
            self.counters[name] = {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}

        def histogram(name: str, documentation: str, buckets) -> dict:  # one child per engine
            metric = self._histogram_cls(
                name=f"vllm:hybridkv_{name}", documentation=documentation, buckets=list(buckets), labelnames=labelnames
            )
            return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}

        self.replay = histogram(
            "replay_tokens", "Matched tokens each hit recomputed (its tail replay), per hit.", REPLAY_BUCKETS
        )
        self.shadow_kl = histogram(
            "shadow_kl",
            "KL(exact || served recipe) of each shadow check's first-token distribution, in nats.",
            SHADOW_KL_BUCKETS,
        )

        # the shadow's answer checks per kind (`shadow.py`: full, exact, stored, zero@<budget>)
        kind_labels = [*labelnames, "kind"]
        self._labelvalues = per_engine_labelvalues
        self.answers = self._counter_cls(
            name="vllm:hybridkv_shadow_answers", labelnames=kind_labels,
            documentation="Served answers the shadow teacher-forced through exact full prefill, per kind.",
        )  # fmt: skip
        self.divergences = self._counter_cls(
            name="vllm:hybridkv_shadow_answer_divergences", labelnames=kind_labels,
            documentation="Of those, answers with a served token that is not the exact argmax, per kind.",
        )  # fmt: skip
        self.positions = self._histogram_cls(
            name="vllm:hybridkv_shadow_divergence_position", labelnames=kind_labels,
            buckets=list(DIVERGENCE_POSITION_BUCKETS),
            documentation="The first diverging answer position of each diverging answer (0: the first token).",
        )  # fmt: skip

        def gauge(name: str, documentation: str, labels: list[str]):
            return self._gauge_cls(
                name=f"vllm:hybridkv_{name}", documentation=documentation, labelnames=labels,
                multiprocess_mode="mostrecent",
            )  # fmt: skip

        self.excess = {
            "": gauge("shadow_excess", "A kind's answer-divergence rate minus the full prefills' (the control).",
                      kind_labels),
            "_low": gauge("shadow_excess_low", "shadow_excess's 95% interval's lower end (Newcombe).", kind_labels),
            "_high": gauge("shadow_excess_high", "The 95% interval's upper end of shadow_excess.", kind_labels),
        }  # fmt: skip
        self.guard = {
            "shadow_rung": gauge(
                "shadow_rung", "The shadow guard's rung: 0 the configured budget, then the ladder's tails, "
                "exact stored states only, full prefills.", labelnames,
            ),
            "shadow_unavailable": gauge(
                "shadow_unavailable", "1 while shadow checks are not being made (dropped or failed).", labelnames
            ),
            "store_bytes_held": gauge(
                "store_bytes_held", "Bytes a capacity-bound store counts as held (all its writers').", labelnames
            ),
        }  # fmt: skip
        self._tallies: dict[int, dict[str, list[int]]] = {}  # engine -> kind -> [checks, divergences]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if value and name in self.counters:
                self.counters[name][engine_idx].inc(value)
        for value in transfer_stats_data.get("replay_tokens", []):
            self.replay[engine_idx].observe(value)
        for value in transfer_stats_data.get("shadow_kl", []):
            self.shadow_kl[engine_idx].observe(value)
        labels = self._labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self.guard:
                self.guard[name].labels(*labels).set(value)
        answers = transfer_stats_data.get("shadow_answers", {})
        if not answers:
            return
        tallies = self._tallies.setdefault(engine_idx, {})
        for kind, (checks, diverged, positions) in answers.items():
            self.answers.labels(*labels, kind).inc(checks)
            self.divergences.labels(*labels, kind).inc(diverged)
            for position in positions:
                self.positions.labels(*labels, kind).observe(position)
            tally = tallies.setdefault(kind, [0, 0])
            tally[0] += checks
            tally[1] += diverged
        control = tallies.get(CONTROL, [0, 0])
        for kind, (checks, diverged) in tallies.items():
            if kind != CONTROL and (excess := Excess.of(diverged, checks, control[1], control[0])) is not None:
                for suffix, value in (("", excess.excess), ("_low", excess.low), ("_high", excess.high)):
                    self.excess[suffix].labels(*labels, kind).set(value)
