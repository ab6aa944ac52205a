"""adaptive-replay (ours): tail-replay whose tail is as short as the gates allow.

A fixed budget replays 5% of the prefix whether the linear layers forget in 50 tokens or in
5,000. When the prompt was cached, its linear layers' per-span log-decays were summarised
(`hybridkv.models.decay`); on a hit, pick the shortest tail whose bound on the dropped state's
contribution — the product of the slowest channel's decays over the tail, worst layer and
head — is below the tolerance ε, never longer than the budget. If even the budget's tail
does not reach ε it is replayed anyway (the bound, reported beside the KL, then says so).
A cached prompt without a summary (an architecture without a gate probe in
`hybridkv.models.decay`, or an entry stored without one) gets the budget's tail, as in
tail-replay; its reported bound is then None.
The tail's attention KV stays the exact cached one, as in tail-replay.

The bound covers the dropped state itself; errors it causes in later layers' inputs during
the tail are damped by the same decays but not counted.
"""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe

DEFAULT_TOLERANCE = 0.01  # at most 1% of the dropped state's norm may survive to the hit


@dataclass(frozen=True)
class AdaptiveReplay:
    name: str = "adaptive-replay"
    uses_budget: bool = True
    uses_checkpoints: bool = False
    reuses_kv: bool = True
    engine_resumable: bool = True
    tolerance: float = DEFAULT_TOLERANCE

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        longest = budget.tail_tokens(hit.length)
        if hit.decay is None:  # no summary (a miss, or stored without one): the budget's tail
            return Recipe(exact_kv_tokens=hit.length, state_position=hit.length - longest)
        tail, _ = hit.decay.shortest_tail(hit.length, self.tolerance, longest)
        return Recipe(exact_kv_tokens=hit.length, state_position=hit.length - tail)
