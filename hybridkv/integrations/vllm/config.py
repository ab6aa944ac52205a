"""The connector's settings: vLLM's `kv_connector_extra_config`, parsed once for both sides.

    "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "replay_budget": 0.05}

Every setting is optional. A bad value, or a key the connector does not read (a misspelt setting
would otherwise run at its default), stops the engine at start, in one line naming it. Each
setting is one field of `ConnectorConfig`: its default there, its key and the function that reads
it in the field's metadata, so nothing is written twice.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.methods import Budget, RecoveryMethod, get_method
from hybridkv.methods.seeded_replay import SeededReplay
from hybridkv.models.calibration import calibrated_horizon

DEFAULT_REPLAY_BUDGET = Budget(fraction=0.05)
DEFAULT_STORE = f"file://{Path(tempfile.gettempdir()) / 'hybridkv-vllm-store'}"  # shared by the engine's processes

Reader = Callable[[Any, str, str], Any]  # (the setting's value, its key, the served model) -> the field's value


def setting(read: Reader, key: str | None = None, **default: Any) -> Any:
    """A field of `ConnectorConfig`: read from `kv_connector_extra_config[key]` (the field's name
    unless given) by `read`, else `default` / `default_factory`."""
    return field(metadata={"read": read, "key": key}, **default)


def _store(value, key: str, model: str) -> str:
    if not value:  # null or "": the default
        return DEFAULT_STORE
    if not isinstance(value, str):
        raise HybridKVError(f"{key} {value!r}: a hybridkv store URL")
    return value


def _budget(value, key: str, model: str) -> Budget:
    return Budget.parse(str(value))


def _method(value, key: str, model: str) -> RecoveryMethod:
    return engine_method(value)


SAVE_STATES = ("always", "never", "value")


def _save_states(value, key: str, model: str) -> str:
    if isinstance(value, bool):  # the setting's earlier form
        return "always" if value else "never"
    if value not in SAVE_STATES:
        raise HybridKVError(f"{key} {value!r}: one of {', '.join(SAVE_STATES)} (or true / false)")
    return value


def _text(value, key: str, model: str) -> str:
    if not isinstance(value, str):
        raise HybridKVError(f"{key} {value!r}: a string")
    return value


def _mib(value, key: str, model: str) -> int:
    """A positive size in MiB, in bytes."""
    try:
        mib = float(value)
    except (TypeError, ValueError):
        mib = math.nan
    if not mib > 0 or math.isinf(mib):
        raise HybridKVError(f"{key} {value!r}: a positive number of MiB")
    return int(mib * 2**20)


def _replay_horizon(value, key: str, model: str) -> int | None:
    """A token count, or "calibrated" (the horizon `hybridkv calibrate` wrote beside the model; None
    there: some layer remembers past it); null: the budget alone."""
    if value is None:
        return None
    if value == "calibrated":
        return calibrated_horizon(Path(model))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise HybridKVError(f'{key} {value!r}: a token count or "calibrated"')


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _share(value, key: str, model: str) -> float:
    if not _number(value) or not 0 <= value <= 1:
        raise HybridKVError(f"{key} {value!r}: a share of requests to check, from 0 to 1")
    return float(value)


def _floor(value, key: str, model: str) -> float | None:
    if value is None:  # none: checks are counted, nothing acts
        return None
    if not _number(value) or not 0 < value <= 1:
        raise HybridKVError(f"{key} {value!r}: an excess divergence rate above 0, at most 1")
    return float(value)


def _window(value, key: str, model: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise HybridKVError(f"{key} {value!r}: a number of checks, at least 2")
    return value


def _ladder(value, key: str, model: str) -> tuple[Budget, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(t, str | int | float) for t in value):
        raise HybridKVError(f'{key} {value!r}: a list of replay budgets (fractions or "256tok")')
    try:
        return tuple(Budget.parse(str(t)) for t in value)
    except HybridKVError as err:
        raise HybridKVError(f"{key} {value!r}: {err}") from None


def _on_error(value, key: str, model: str) -> str:
    if value not in ("ignore", "exact"):
        raise HybridKVError(f'{key} {value!r}: "ignore" or "exact"')
    return value


def _path(value, key: str, model: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise HybridKVError(f"{key} {value!r}: a file path")
    return value


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, one field per key of `kv_connector_extra_config` (named in quotes)."""

    # `store`: a hybridkv store URL; default a file store under the temp dir, shared by the
    # engine's processes
    store: str = setting(_store, default=DEFAULT_STORE)
    # `replay_budget`: a fraction of the match, or "256tok"; default 0.05. A request may set its own:
    # `SamplingParams(extra_args={"kv_transfer_params": {"replay_budget": 0.1}})`
    replay_budget: Budget = setting(_budget, default=DEFAULT_REPLAY_BUDGET)
    # `method`: the recovery method whose recipe picks where a hit resumes (`hybridkv.methods`, or one
    # registered under `hybridkv.recipes`); default "seeded-replay". A method that cannot run as the
    # engine resumes (`engine_resumable` false) is refused at start. A request may name its own, as
    # `"method"` beside `"replay_budget"` in its kv_transfer_params
    method: RecoveryMethod = setting(_method, default=SeededReplay())
    # `replay_horizon`: a token count, or "calibrated" (the forgetting horizon `hybridkv calibrate`
    # wrote beside the model); it caps the budget's tail. None: the budget alone (the default), or a
    # calibration that found some layer remembering past its sample
    replay_horizon: int | None = setting(_replay_horizon, default=None)
    # `cache_salt`: the engine's namespace; vLLM's per-request `cache_salt` opens a namespace inside
    # it, so two tenants never share a page. Default "" (none)
    cache_salt: str = setting(_text, default="")
    # `save_states`: which saved prompts' final linear states (an exact checkpoint at the prompt's
    # end) are written, and what the store's capacity weighs them by (`block_store.Worth`):
    # "always" (the default; true): every one, worth the whole prefix's prefill it restores;
    # "never" (false): none, hits resume by tail replay; "value": every one, worth only the tail
    # replay it spares (what `hybridkv trace-sim`'s hybridkv-value counts), so a store kept by
    # `policy=value` admits a state only where that saves more compute per byte than what it evicts.
    # "value" needs such a store
    save_states: str = setting(_save_states, default="always")
    # `max_held_mib`, in bytes: verified pages held in memory for requests not yet admitted; past
    # it, new lookups wait. Default 1024 MiB
    max_held_bytes: int = setting(_mib, key="max_held_mib", default=1024 * 2**20)
    # `shadow_rate`: the share of finished requests whose served answer is checked against exact full
    # prefill in a shadow process, off the request's path (`shadow.py`): every kind of request alike,
    # so full prefills give the control group. 0 (the default) turns checks off; 1 checks every one.
    # Sampled by a hash of the request id
    shadow_rate: float = setting(_share, default=0.0)
    # `shadow_floor`: an excess divergence rate in (0, 1]. Once the last `shadow_window` checks of
    # requests that read the store diverge this much more often than the last `shadow_window` full
    # prefills, the connector steps up its ladder (`shadow.ShadowGuard`). Needs `shadow_rate` > 0.
    # Default none: checks are counted, nothing acts
    shadow_floor: float | None = setting(_floor, default=None)
    # `shadow_window`: the checks the floor judges at a time (at least 2)
    shadow_window: int = setting(_window, default=50)
    # `shadow_ladder`: the tails stepped through above the configured budget before exact stored
    # states only, then full prefills
    shadow_ladder: tuple[Budget, ...] = setting(_ladder, default=(Budget(fraction=0.2), Budget(fraction=0.5)))
    # `shadow_on_error`: when checks stop (the shadow process dead, failing, or its queue full):
    # "ignore" (count it, resume as configured) or "exact" (resume from exact stored states only
    # until a check succeeds again)
    shadow_on_error: str = setting(_on_error, default="ignore")
    # `shadow_log`: a file each check's result is appended to, one JSON line per request (its id,
    # kind, where its answer diverged); default none
    shadow_log: str | None = setting(_path, default=None)

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
        values = {}
        for f in fields(cls):
            key = f.metadata["key"] or f.name
            if key in extra:
                values[f.name] = f.metadata["read"](extra[key], key, model)
        config = cls(**values)
        if config.save_states == "value" and "policy=value" not in config.store:
            raise HybridKVError(
                f"save_states 'value' needs a store kept by value (?capacity=BYTES&policy=value), not {config.store!r}"
            )
        if config.shadow_floor is not None and config.shadow_rate == 0:
            raise HybridKVError(
                f"shadow_floor {config.shadow_floor!r} needs shadow_rate > 0: the floor reads the checks"
            )
        return config


# Every key `parse` reads.
SETTINGS = frozenset(f.metadata["key"] or f.name for f in fields(ConnectorConfig))


def engine_method(name) -> RecoveryMethod:
    """The recovery method called `name`, refused in one line unless it may run as vLLM resumes."""
    if not isinstance(name, str):
        raise HybridKVError(f"method {name!r}: a recovery method's name")
    method = get_method(name)
    if not method.engine_resumable:
        raise HybridKVError(
            f"method {name!r} cannot run in vLLM: its recipe needs more than loading the KV before its state "
            "position and prefilling the rest (engine_resumable is false)"
        )
    return method
