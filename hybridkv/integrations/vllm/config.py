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
from hybridkv.methods import Budget, RecoveryMethod, get_method
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
    # `method`: the recovery method whose recipe picks where a hit resumes (`hybridkv.methods`, or one
    # registered under `hybridkv.recipes`); default "seeded-replay". A method that cannot run as the
    # engine resumes (`engine_resumable` false) is refused at start. A request may name its own, as
    # `"method"` beside `"replay_budget"` in its kv_transfer_params
    method: RecoveryMethod
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
    # `shadow_rate`: the share of finished requests whose served answer is checked against exact full
    # prefill in a shadow process, off the request's path (`shadow.py`): every kind of request alike,
    # so full prefills give the control group. 0 (the default) turns checks off; 1 checks every one.
    # Sampled by a hash of the request id
    shadow_rate: float = 0.0
    # `shadow_floor`: an excess divergence rate in (0, 1]. Once the last `shadow_window` checks of
    # requests that read the store diverge this much more often than the last `shadow_window` full
    # prefills, the connector steps up its ladder (`shadow.ShadowGuard`). Needs `shadow_rate` > 0.
    # Default none: checks are counted, nothing acts
    shadow_floor: float | None = None
    # `shadow_window`: the checks the floor judges at a time (at least 2)
    shadow_window: int = 50
    # `shadow_ladder`: the tails stepped through above the configured budget before exact stored
    # states only, then full prefills
    shadow_ladder: tuple[Budget, ...] = (Budget(fraction=0.2), Budget(fraction=0.5))
    # `shadow_on_error`: when checks stop (the shadow process dead, failing, or its queue full):
    # "ignore" (count it, resume as configured) or "exact" (resume from exact stored states only
    # until a check succeeds again)
    shadow_on_error: str = "ignore"
    # `shadow_log`: a file each check's result is appended to, one JSON line per request (its id,
    # kind, where its answer diverged); default none
    shadow_log: str | None = None

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
            method=engine_method(extra.get("method", "seeded-replay")),
            save_states=_flag(extra.get("save_states", True), "save_states"),
            replay_horizon=_replay_horizon(extra.get("replay_horizon"), model),
            store=_store(extra.get("store")),
            cache_salt=_text(extra.get("cache_salt", ""), "cache_salt"),
            max_held_bytes=_mib(extra.get("max_held_mib", 1024), "max_held_mib"),
            **_shadow(extra),
        )


# Every key `parse` reads (`max_held_mib` fills `max_held_bytes`).
SETTINGS = frozenset(
    {"store", "replay_budget", "method", "replay_horizon", "cache_salt", "save_states", "max_held_mib", "shadow_rate",
     "shadow_floor", "shadow_window", "shadow_ladder", "shadow_on_error",
     "shadow_log"}
)  # fmt: skip


def engine_method(setting) -> RecoveryMethod:
    """The recovery method named `setting`, refused in one line unless it may run as vLLM resumes."""
    if not isinstance(setting, str):
        raise HybridKVError(f"method {setting!r}: a recovery method's name")
    method = get_method(setting)
    if not method.engine_resumable:
        raise HybridKVError(
            f"method {setting!r} cannot run in vLLM: its recipe needs more than loading the KV before its state "
            "position and prefilling the rest (engine_resumable is false)"
        )
    return method


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


def _shadow(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The shadow settings: `shadow_rate` in [0, 1]; `shadow_floor` in (0, 1] (or absent), which
    needs checks to read; `shadow_window` a count of at least 2; `shadow_ladder` a list of budgets;
    `shadow_on_error` "ignore" or "exact"."""
    defaults = {f: ConnectorConfig.__dataclass_fields__[f].default for f in ("shadow_window", "shadow_ladder")}
    rate, floor = extra.get("shadow_rate", 0.0), extra.get("shadow_floor")
    window = extra.get("shadow_window", defaults["shadow_window"])
    on_error = extra.get("shadow_on_error", "ignore")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
        raise HybridKVError(f"shadow_rate {rate!r}: a share of requests to check, from 0 to 1")
    if floor is not None:
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 < floor <= 1:
            raise HybridKVError(f"shadow_floor {floor!r}: an excess divergence rate above 0, at most 1")
        if rate == 0:
            raise HybridKVError(f"shadow_floor {floor!r} needs shadow_rate > 0: the floor reads the checks")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise HybridKVError(f"shadow_window {window!r}: a number of checks, at least 2")
    if on_error not in ("ignore", "exact"):
        raise HybridKVError(f'shadow_on_error {on_error!r}: "ignore" or "exact"')
    ladder = extra.get("shadow_ladder")
    if ladder is None:
        tails = defaults["shadow_ladder"]
    elif isinstance(ladder, list | tuple) and all(isinstance(t, str | int | float) for t in ladder):
        try:
            tails = tuple(Budget.parse(str(t)) for t in ladder)
        except HybridKVError as err:
            raise HybridKVError(f"shadow_ladder {ladder!r}: {err}") from None
    else:
        raise HybridKVError(f'shadow_ladder {ladder!r}: a list of replay budgets (fractions or "256tok")')
    log_path = extra.get("shadow_log")
    if log_path is not None and (not isinstance(log_path, str) or not log_path):
        raise HybridKVError(f"shadow_log {log_path!r}: a file path")
    return {
        "shadow_rate": float(rate), "shadow_floor": None if floor is None else float(floor),
        "shadow_window": window, "shadow_ladder": tails, "shadow_on_error": on_error, "shadow_log": log_path,
    }  # fmt: skip


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
