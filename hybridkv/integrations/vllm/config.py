"""The connector's settings: vLLM's `kv_connector_extra_config`, parsed once for both sides.

    "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "replay_budget": 0.05}

Every setting is optional. A bad value, or a key the connector does not read (a misspelt setting
would otherwise run at its default), stops the engine at start, in one line naming it.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.methods import Budget
from hybridkv.models.calibration import calibrated_horizon


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, one field per key of `kv_connector_extra_config` (named in quotes)."""

    # `store`: a hybridkv store URL; default a file store under the temp dir, shared by the
    # engine's processes
    store: str
    # `replay_budget`: a fraction of the match, or "256tok"; default 0.05. A request may set its own:
    # `SamplingParams(extra_args={"kv_transfer_params": {"replay_budget": 0.1}})`
    replay_budget: Budget
    # `replay_horizon`: a token count, or "calibrated" (the forgetting horizon `hybridkv calibrate`
    # wrote beside the model); it caps the budget's tail. None: the budget alone (the default), or a
    # calibration that found some layer remembering past its sample
    replay_horizon: int | None
    # `cache_salt`: the engine's namespace; vLLM's per-request `cache_salt` opens a namespace inside
    # it, so two tenants never share a page. Default "" (none)
    cache_salt: str
    # `save_states`: store each saved prompt's final linear states (an exact checkpoint at its
    # end); default true
    save_states: bool
    # `max_held_mib`, in bytes: verified pages held in memory for requests not yet admitted; past
    # it, new lookups wait. Default 1024 MiB
    max_held_bytes: int
    # `shadow_rate`: the share of zero-state resumes (inexact hits) checked against the exact
    # answer's first token in a shadow process, off the request's path (`shadow.py`). 0 (the
    # default) turns checks off; 1 checks every one. Sampled by a hash of the request id
    shadow_rate: float = 0.0
    # `shadow_floor`: a disagreement rate in (0, 1]; once the checks' rate (over at least 20) reaches
    # it, the engine stops resuming from zero states: an exact stored state within the match, else a
    # full prefill. Needs `shadow_rate` > 0. Default none
    shadow_floor: float | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, model: str) -> ConnectorConfig:
        """The settings in `extra`, for the engine serving `model` (a checkpoint directory, where a
        "calibrated" horizon is read)."""
        extra = extra or {}
        if unknown := sorted(set(extra) - SETTINGS):  # a misspelt setting would otherwise be its default
            raise HybridKVError(
                f"unknown kv_connector_extra_config setting(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(SETTINGS))}"
            )
        return cls(
            replay_budget=Budget.parse(str(extra.get("replay_budget", 0.05))),
            save_states=_flag(extra.get("save_states", True), "save_states"),
            replay_horizon=_replay_horizon(extra.get("replay_horizon"), model),
            store=_store(extra.get("store")),
            cache_salt=_text(extra.get("cache_salt", ""), "cache_salt"),
            max_held_bytes=_mib(extra.get("max_held_mib", 1024), "max_held_mib"),
            **_shadow(extra.get("shadow_rate", 0.0), extra.get("shadow_floor")),
        )


# Every key `parse` reads (`max_held_mib` fills `max_held_bytes`).
SETTINGS = frozenset(
    {"store", "replay_budget", "replay_horizon", "cache_salt", "save_states", "max_held_mib", "shadow_rate",
     "shadow_floor"}
)  # fmt: skip


def _store(setting) -> str:
    if not setting:
        return f"file://{Path(tempfile.gettempdir()) / 'hybridkv-vllm-store'}"
    if not isinstance(setting, str):
        raise HybridKVError(f"store {setting!r}: a hybridkv store URL")
    return setting


def _flag(setting, name: str) -> bool:
    if not isinstance(setting, bool):  # bool("false") would be True
        raise HybridKVError(f"{name} {setting!r}: true or false")
    return setting


def _text(setting, name: str) -> str:
    if not isinstance(setting, str):
        raise HybridKVError(f"{name} {setting!r}: a string")
    return setting


def _mib(setting, name: str) -> int:
    """A positive size in MiB from the connector's config, in bytes."""
    try:
        mib = float(setting)
    except (TypeError, ValueError):
        mib = math.nan
    if not mib > 0 or math.isinf(mib):
        raise HybridKVError(f"{name} {setting!r}: a positive number of MiB")
    return int(mib * 2**20)


def _shadow(rate, floor) -> dict[str, float | None]:
    """`shadow_rate` in [0, 1] and `shadow_floor` in (0, 1] (or absent), which needs checks to read."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
        raise HybridKVError(f"shadow_rate {rate!r}: a share of inexact hits to check, from 0 to 1")
    if floor is not None:
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 < floor <= 1:
            raise HybridKVError(f"shadow_floor {floor!r}: a top-1 disagreement rate above 0, at most 1")
        if rate == 0:
            raise HybridKVError(f"shadow_floor {floor!r} needs shadow_rate > 0: the floor reads the checks' rate")
    return {"shadow_rate": float(rate), "shadow_floor": None if floor is None else float(floor)}


def _replay_horizon(setting, model: str) -> int | None:
    """`replay_horizon`: absent (the budget alone), a token count, or "calibrated" (the horizon
    `hybridkv calibrate` wrote beside the model; None there: some layer remembers past it)."""
    if setting is None:
        return None
    if setting == "calibrated":
        return calibrated_horizon(Path(model))
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return setting
    raise HybridKVError(f'replay_horizon {setting!r}: a token count or "calibrated"')
