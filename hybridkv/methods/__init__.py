"""Recovery methods: one file each, one protocol (`RecoveryMethod.recipe`), one executor."""

from hybridkv.errors import HybridKVError
from hybridkv.methods.adaptive_replay import AdaptiveReplay
from hybridkv.methods.base import (
    Budget,
    Match,
    Outcome,
    PositionsMatch,
    Recipe,
    RecoveryMethod,
    dropped_state_bound,
    execute,
)
from hybridkv.methods.batch import execute_batch
from hybridkv.methods.checkpoint import Checkpoint
from hybridkv.methods.full import Full
from hybridkv.methods.seeded_replay import SeededReplay
from hybridkv.methods.tail_replay import TailReplay
from hybridkv.methods.tail_replay_recompute import TailReplayRecompute
from hybridkv.methods.zero_state import ZeroState

METHODS: dict[str, RecoveryMethod] = {
    method.name: method
    for method in (
        Full(),
        ZeroState(),
        Checkpoint(),
        TailReplay(),
        TailReplayRecompute(),
        SeededReplay(),
        AdaptiveReplay(),
    )
}


def get_method(name: str) -> RecoveryMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise HybridKVError(f"unknown method {name!r}; known: {', '.join(METHODS)}") from None


__all__ = [
    "METHODS",
    "Budget",
    "Match",
    "Outcome",
    "Recipe",
    "RecoveryMethod",
    "PositionsMatch",
    "dropped_state_bound",
    "execute",
    "execute_batch",
    "get_method",
]
