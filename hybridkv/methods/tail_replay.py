"""tail-replay (exact-KV variant, the Tail-Replay paper).

Reuse the exact attention KV of [0, L); rebuild every linear state by replaying the last
t = budget × L matched tokens through the whole model from zero state, attention layers
attending the exact cached KV before the tail. Only the states are kept from the replay; the
tail's attention KV stays the exact cached one. A linear layer forgets geometrically, so a
short tail recovers most of the state; no state ever has to be stored. An engine (vLLM, through
the connector) prefills the tail itself, so there it runs in its recompute form.
"""

from dataclasses import dataclass

from hybridkv.methods.base import Budget, Match, Recipe


@dataclass(frozen=True)
class TailReplay:
    name: str = "tail-replay"
    uses_budget: bool = True
    uses_checkpoints: bool = False
    reuses_kv: bool = True
    engine_resumable: bool = True

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe:
        tail = budget.tail_tokens(hit.length)
        return Recipe(exact_kv_tokens=hit.length, state_position=hit.length - tail)
