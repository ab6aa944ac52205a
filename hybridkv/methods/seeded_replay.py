"""seeded-replay (ours): tail-replay that starts from a stored checkpoint when one is in reach.

If a checkpoint lies inside the replay window [L − t, L], replay from it instead of from zero:
the states at L are then exact (the replay continues a true state), at a cost of at most t
tokens. Otherwise it is plain tail-replay, so it is never worse.
"""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe


@dataclass(frozen=True)
class SeededReplay:
    name: str = "seeded-replay"
    uses_budget: bool = True
    uses_checkpoints: bool = True
    reuses_kv: bool = True
    engine_resumable: bool = True

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        window_start = hit.length - budget.tail_tokens(hit.length)
        seed = hit.checkpoint_at_or_before(hit.length)
        if seed is not None and seed >= window_start:
            return Recipe(exact_kv_tokens=hit.length, state_position=seed, state_seed=True)
        return Recipe(exact_kv_tokens=hit.length, state_position=window_start)
