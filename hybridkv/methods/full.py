"""full: recompute the whole prompt — the quality oracle and the speed baseline."""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe


@dataclass(frozen=True)
class Full:
    name: str = "full"
    uses_budget: bool = False
    uses_checkpoints: bool = False
    reuses_kv: bool = False
    engine_resumable: bool = True

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        return Recipe(exact_kv_tokens=0, state_position=0)
