"""tail-replay-recompute: resume at L − t with zero linear state and recompute the tail's KV.

What an engine does when it reports only L − t tokens as cached: the tail is an ordinary
prefill, so its attention KV is recomputed from the (approximate) zero-started states instead
of kept exact. Same replay cost as the exact-KV variant; the comparison shows what keeping the
exact KV is worth.
"""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe


@dataclass(frozen=True)
class TailReplayRecompute:
    name: str = "tail-replay-recompute"
    uses_budget: bool = True
    uses_checkpoints: bool = False
    reuses_kv: bool = True
    engine_resumable: bool = True

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        start = hit.length - budget.tail_tokens(hit.length)
        return Recipe(exact_kv_tokens=start, state_position=start)
