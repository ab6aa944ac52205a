"""The connector's settings: vLLM's `kv_connector_extra_config`, parsed once for both sides.

    "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "replay_budget": 0.05}

Every setting is optional. A bad value stops the engine at start, in one line naming the setting.
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

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, model: str) -> ConnectorConfig:
        """The settings in `extra`, for the engine serving `model` (a checkpoint directory, where a
        "calibrated" horizon is read)."""
        extra = extra or {}
        return cls(
            replay_budget=Budget.parse(str(extra.get("replay_budget", 0.05))),
            save_states=_flag(extra.get("save_states", True), "save_states"),
            replay_horizon=_replay_horizon(extra.get("replay_horizon"), model),
            store=_store(extra.get("store")),
            cache_salt=_text(extra.get("cache_salt", ""), "cache_salt"),
            max_held_bytes=_mib(extra.get("max_held_mib", 1024), "max_held_mib"),
        )


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
