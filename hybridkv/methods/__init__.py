"""Recovery methods: one file each, one protocol (`RecoveryMethod.recipe`), one executor.

The built-in methods are listed in `METHODS`. A method living in another package registers its
class under the entry point group `hybridkv.recipes` (in that package's pyproject:
`[project.entry-points."hybridkv.recipes"] last-128 = "my_pkg.last_128:Last128"`), and every
engine finds it by name through `get_method`: `validate`, `ttft`, the arena and the vLLM connector.
"""

from importlib.metadata import entry_points

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


RECIPE_ENTRY_POINTS = "hybridkv.recipes"
# What every method declares besides `recipe` (see `RecoveryMethod`).
DECLARED = ("name", "uses_budget", "uses_checkpoints", "reuses_kv", "engine_resumable")


# Registered methods already loaded, by name: a request naming one (the vLLM connector's per-request
# `method`) does not scan the installed packages again.
_REGISTERED: dict[str, RecoveryMethod] = {}


def recovery_methods() -> dict[str, RecoveryMethod]:
    """Every recovery method by name: the built-in ones, then those registered under
    `hybridkv.recipes` (a built-in name cannot be taken). A registered method that does not declare
    what the protocol asks is refused in one line naming what it lacks."""
    found = dict(METHODS)
    for entry_point in entry_points(group=RECIPE_ENTRY_POINTS):
        if entry_point.name not in found:
            found[entry_point.name] = _REGISTERED.get(entry_point.name) or _load(entry_point)
    return found


def _load(entry_point) -> RecoveryMethod:
    method = entry_point.load()()
    where = f"method {entry_point.name!r} ({entry_point.value})"
    if missing := [flag for flag in DECLARED if not hasattr(method, flag)]:
        raise HybridKVError(f"{where} does not declare {', '.join(missing)}; see RecoveryMethod")
    if not callable(getattr(method, "recipe", None)):
        raise HybridKVError(f"{where} has no recipe(hit, budget); see RecoveryMethod")
    if method.name != entry_point.name:
        raise HybridKVError(f"{where} is named {method.name!r}: register it under its own name")
    _REGISTERED[entry_point.name] = method
    return method


def get_method(name: str) -> RecoveryMethod:
    if (method := METHODS.get(name) or _REGISTERED.get(name)) is not None:
        return method
    methods = recovery_methods()  # not seen yet: scan what is installed now
    try:
        return methods[name]
    except KeyError:
        raise HybridKVError(f"unknown method {name!r}; known: {', '.join(methods)}") from None


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
    "recovery_methods",
]
