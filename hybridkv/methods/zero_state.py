"""zero-state: exact attention KV of the matched prefix; linear layers restart from zero at L."""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe


@dataclass(frozen=True)
class ZeroState:
    name: str = "zero-state"
    uses_budget: bool = False
    uses_checkpoints: bool = False
    reuses_kv: bool = True
    engine_resumable: bool = True

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        return Recipe(exact_kv_tokens=hit.length, state_position=hit.length)
