"""Shadow checks (`shadow_rate`, `shadow_floor`) without a server: settings, sampling, the floor,
and which finished requests the scheduler queues, on vLLM's own classes (`test_vllm_scheduling`'s
engine). `test_vllm_serve.py` runs the checks themselves through `vllm serve`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hybridkv.errors import HybridKVError  # noqa: E402
from hybridkv.integrations.vllm.config import ConnectorConfig  # noqa: E402
from hybridkv.integrations.vllm.shadow import FLOOR_MIN_CHECKS, ShadowFloor, ShadowResult, sampled  # noqa: E402
from tests.test_vllm_glm_groups import BLOCK, load, look_up, make_engine, request, tokens  # noqa: E402
from tests.test_vllm_scheduling import plain_config, plain_hybrid_specs, request_blocks, save  # noqa: E402, F401


def test_shadow_settings_parse_and_bad_values_stop_the_engine_in_one_line():
    default = ConnectorConfig.parse({}, "model")
    assert (default.shadow_rate, default.shadow_floor) == (0.0, None)
    set_ = ConnectorConfig.parse({"shadow_rate": 0.25, "shadow_floor": 0.3}, "model")
    assert (set_.shadow_rate, set_.shadow_floor) == (0.25, 0.3)
    assert ConnectorConfig.parse({"shadow_rate": 1}, "model").shadow_rate == 1.0
    for bad in (-0.1, 1.5, "0.5", True, math.nan, None):
        with pytest.raises(HybridKVError, match=r"^shadow_rate .*: a share of inexact hits to check, from 0 to 1$"):
            ConnectorConfig.parse({"shadow_rate": bad}, "model")
    for bad in (0, 1.2, "0.1", False, math.nan):
        with pytest.raises(HybridKVError, match=r"^shadow_floor .*: a top-1 disagreement rate above 0, at most 1$"):
            ConnectorConfig.parse({"shadow_rate": 0.5, "shadow_floor": bad}, "model")
    with pytest.raises(HybridKVError, match=r"^shadow_floor 0\.2 needs shadow_rate > 0"):
        ConnectorConfig.parse({"shadow_floor": 0.2}, "model")


def test_sampling_is_a_hash_of_the_request_id_at_the_rate():
    ids = [f"cmpl-{i}" for i in range(4000)]
    assert not any(sampled(i, 0.0) for i in ids) and all(sampled(i, 1.0) for i in ids)
    picked = [i for i in ids if sampled(i, 0.25)]
    assert picked == [i for i in ids if sampled(i, 0.25)]  # the same ids every time
    # binomial(4000, 0.25): sd 27; 5 sd either side
    assert abs(len(picked) - 1000) < 140
    assert set(picked) <= {i for i in ids if sampled(i, 0.5)}  # a higher rate keeps every lower one's ids


def test_the_floor_trips_once_enough_checks_disagree_at_its_rate_and_stays_tripped():
    floor = ShadowFloor(0.5)
    for _ in range(FLOOR_MIN_CHECKS - 1):
        assert not floor.record(True)  # every check disagrees, but too few to judge
    assert not floor.tripped
    assert floor.record(True) and floor.tripped and floor.rate == 1.0
    assert not floor.record(False) and floor.tripped  # trips once, stays
    below = ShadowFloor(0.5)
    for index in range(3 * FLOOR_MIN_CHECKS):
        below.record(index % 3 == 0)  # a third disagree
    assert not below.tripped and below.checks == 3 * FLOOR_MIN_CHECKS
    at = ShadowFloor(0.25)
    for index in range(FLOOR_MIN_CHECKS):
        at.record(index % 4 == 0)  # exactly a quarter: at the floor trips it
    assert at.tripped
    never = ShadowFloor(None)
    for _ in range(5 * FLOOR_MIN_CHECKS):
        never.record(True)
    assert not never.tripped and never.rate == 1.0


class RecordingShadow:
    """Stands in for the shadow process: records the checks queued, takes at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.jobs = []
        self.dead = False

    def submit(self, job) -> bool:
        if len(self.jobs) >= self.capacity:
            return False
        self.jobs.append(job)
        return True

    def shutdown(self) -> None:
        pass


@pytest.fixture
def shadowed_engine(plain_config, tmp_path):  # noqa: F811
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    from hybridkv.integrations.vllm.worker_side import _Writer

    groups = get_kv_cache_groups(plain_config, plain_hybrid_specs())
    engine = make_engine(
        plain_config, get_kv_cache_config_from_groups(plain_config, groups, 16 * 2**20),
        f"file://{tmp_path / 'store'}", shadow_rate=1.0, shadow_floor=0.5,
    )  # fmt: skip
    yield engine
    engine.worker.shutdown()
    engine.scheduler.shutdown()
    _Writer.drain_all()


def served(req, first_token: int):
    """The request as vLLM hands it to `request_finished`: answered greedily with `first_token`."""
    req.output_token_ids = [first_token]
    req.sampling_params = SimpleNamespace(temperature=0.0)
    return req


def test_zero_state_resumes_are_queued_for_checks_and_a_tripped_floor_stops_them(shadowed_engine):
    """A finished request the connector resumed from zero states is queued with its prompt, resume
    point and served token; an exact resume is not, and a full queue drops one (counted). Once the
    checks' disagreement rate reaches `shadow_floor`, a prompt diverging inside a stored one is
    computed in full instead, and one extending it still resumes from the stored exact state."""
    engine = shadowed_engine
    side = engine.scheduler._side
    shadow = side._shadow = RecordingShadow(capacity=1)
    stored = tokens(4 * BLOCK, 1)
    save(engine, stored, request_blocks(engine, 0, 4))  # its state at its end: an exact checkpoint there

    diverging = stored[: 3 * BLOCK] + tokens(30, 2)
    zero = request("zero", diverging)
    start = look_up(engine, zero)
    assert start == 3 * BLOCK - round(0.05 * 3 * BLOCK)  # the budget's tail, from zero states
    load(engine, zero, start, request_blocks(engine, 20, 4))
    engine.scheduler.request_finished_all_groups(served(zero, 17), ())
    assert [(j.request_id, j.tokens, j.start, j.served_token) for j in shadow.jobs] == [("zero", diverging, start, 17)]

    extending = request("exact", stored + tokens(30, 3))
    start = look_up(engine, extending)
    assert start == len(stored)  # the stored exact state: nothing to check
    load(engine, extending, start, request_blocks(engine, 40, 5))
    engine.scheduler.request_finished_all_groups(served(extending, 5), ())
    assert len(shadow.jobs) == 1

    second = request("second", stored[: 2 * BLOCK] + tokens(30, 4))
    second_start = look_up(engine, second)
    load(engine, second, second_start, request_blocks(engine, 60, 4))
    engine.scheduler.request_finished_all_groups(served(second, 9), ())  # the queue is full: dropped
    counters = engine.scheduler.get_kv_connector_stats().data["counters"]
    assert (counters["shadow_queued"], counters["shadow_dropped"]) == (1, 1)

    for index in range(FLOOR_MIN_CHECKS):  # results come back: most first tokens flipped
        side._shadow_done(ShadowResult(f"r{index}", top1_agrees=index % 3 == 0, kl=0.01, reproduced=True))
    stats = engine.scheduler.get_kv_connector_stats().data
    assert stats["counters"]["shadow_checks"] == FLOOR_MIN_CHECKS
    assert stats["counters"]["shadow_top1_disagreements"] == FLOOR_MIN_CHECKS - 7
    assert stats["counters"]["shadow_floor_trips"] == 1 and len(stats["shadow_kl"]) == FLOOR_MIN_CHECKS
    assert side.shadow_floor.tripped

    assert look_up(engine, request("after", stored[: 3 * BLOCK] + tokens(30, 5))) == 0  # no exact state in reach
    assert look_up(engine, request("exact-after", stored + tokens(30, 6))) == len(stored)  # exact resumes go on


def test_a_shadow_model_that_does_not_load_fails_each_check_with_why_and_nothing_waits(tmp_path):
    """The shadow process answers every job with the reason its model did not load; the checker
    hands that to the scheduler as a failed check (counted in `shadow_failed`)."""
    import threading

    from hybridkv.integrations.vllm.shadow import ShadowChecker, ShadowJob

    results, done = [], threading.Event()

    def on_result(result):
        results.append(result)
        done.set()

    checker = ShadowChecker(str(tmp_path / "no-such-checkpoint"), "bfloat16", on_result, capacity=1)
    try:
        assert checker.submit(ShadowJob("a", [5, 6, 7], 2, None))
        assert not checker.submit(ShadowJob("b", [5, 6, 7], 2, None))  # capacity 1: dropped at once
        assert done.wait(timeout=120), "the shadow process never answered"
    finally:
        checker.shutdown()
    assert [(r.request_id, r.error is not None) for r in results] == [("a", True)]
    assert "did not load" in results[0].error and "no-such-checkpoint" in results[0].error
    assert checker.pending == 0


def test_a_misspelt_connector_setting_is_refused_and_every_known_one_is_read():
    """A setting the connector does not read would silently run at its default; every key `SETTINGS`
    lists parses with a valid value."""
    from hybridkv.integrations.vllm.config import SETTINGS

    with pytest.raises(HybridKVError, match=r"^unknown kv_connector_extra_config setting\(s\) 'replay_bugdet'; known"):
        ConnectorConfig.parse({"replay_bugdet": 0.2}, "model")
    valid = {"store": "file:///tmp/x", "replay_budget": 0.2, "replay_horizon": 64, "cache_salt": "a",
             "save_states": False, "max_held_mib": 8, "shadow_rate": 0.5, "shadow_floor": 0.3}  # fmt: skip
    assert set(valid) == SETTINGS
    config = ConnectorConfig.parse(valid, "model")
    assert (config.replay_budget.fraction, config.replay_horizon, config.save_states, config.max_held_bytes) == (
        0.2, 64, False, 8 * 2**20,
    )  # fmt: skip
