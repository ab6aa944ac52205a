"""checkpoint: resume exactly at the last stored state checkpoint ≤ L, recompute the rest.

vLLM's align mode: exact, but reuse stops at the checkpoint grid, so up to one interval of
the match is recomputed (and nothing is reused when the match is shorter than one interval).
"""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe


@dataclass(frozen=True)
class Checkpoint:
    name: str = "checkpoint"
    uses_budget: bool = False
    uses_checkpoints: bool = True
    reuses_kv: bool = True
    engine_resumable: bool = True

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        position = hit.checkpoint_at_or_before(hit.length)
        if position is None:
            return Recipe(exact_kv_tokens=0, state_position=0)
        return Recipe(exact_kv_tokens=position, state_position=position, state_seed=True)
